// A meshd client in Node.js, written from proto/meshd.proto alone (docs/clients.md; tested by
// tests/test_node_client.py). Usage: node client.js unix:/path/to/api.sock "a prompt"
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [api, prompt] = process.argv.slice(2);
const definition = protoLoader.loadSync(process.env.MESHD_PROTO || "proto/meshd.proto", {
  keepCase: true, // the proto's field names (max_tokens, finish_reason)
  longs: String, // uint64 seeds exceed 2^53: a JavaScript number would round them
  oneofs: true, // event.event names the field set: "text" or "done"
});
const { Local } = grpc.loadPackageDefinition(definition).meshd.v1;
const local = new Local(api, grpc.credentials.createInsecure());

const request = { prompt, sampling: { temperature: 0.7, max_tokens: 24 } };
const call = local.Generate(request, { deadline: Date.now() + 60_000 });
call.on("data", (event) => {
  if (event.event === "text") process.stdout.write(event.text);
  else console.log(`\n[${event.done.finish_reason}, seed ${event.done.seed}]`);
});
call.on("error", (error) => {
  console.error(`${grpc.status[error.code]}: ${error.details}`); // e.g. INVALID_ARGUMENT: ...
  process.exitCode = 1;
});
