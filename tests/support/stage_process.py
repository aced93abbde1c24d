"""One data-plane node in a process of its own: the benchmarks' and multi-process tests' stage.

``python -m tests.support.stage_process --serve --node-id n2 --state-dir DIR`` (from the
repository root). It is a test tool, not part of the daemon: a real node is a `meshd run`.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshd.inference.assignment import Assignment
from meshd.inference.errors import InferenceError
from meshd.inference.fencing import CommittedPlans
from meshd.inference.generation_events import TokenEvent
from meshd.inference.origin.runtime import DEFAULT_PREFILL_CHUNK
from meshd.inference.sampling import SamplingParams
from meshd.inference.serving.dataplane import DataPlane
from meshd.inference.transport.links import start_server
from meshd.mesh import security
from meshd.mesh.channels import peer_channel_factory


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.support.stage_process --serve --node-id n2 --state-dir DIR``: one node.

    The state dir must hold ``mesh.secret`` (the driver writes it). The node prints
    ``{"node_id", "port"}`` as one JSON line, then reads JSON commands, one per line, from
    stdin and answers each with one JSON line: ``{"install": <Assignment.to_dict()>}``,
    ``{"uninstall": plan_id}``, ``{"stats": true}``. It exits when stdin closes.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.stage_process", description=main.__doc__
    )
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument(
        "--colocated-stages",
        type=int,
        default=1,
        help="stages of the plan on this machine (the daemon derives it from fingerprints)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    asyncio.run(_serve_node(args))
    return 0


async def _serve_node(args: argparse.Namespace) -> None:
    secret = security.load_secret(args.state_dir)
    if secret is None:
        raise SystemExit(
            f"{args.state_dir} has no mesh.secret; write one with security.save_secret"
        )
    credentials = security.load_or_create_node_credentials(args.state_dir, secret, args.node_id)
    committed = CommittedPlans(args.node_id)
    plane = DataPlane(
        args.node_id,
        peer_channel_factory(credentials),
        committed.check,
        prefill_chunk=args.prefill_chunk,
    )
    server, port = await start_server(plane.servicer(), credentials, args.listen)
    await plane.transport.open_lanes(args.listen.rpartition(":")[0], credentials)
    _emit({"node_id": args.node_id, "port": port})
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            _emit(await _run_command(plane, committed, command, args.colocated_stages))
    finally:
        await plane.close()
        await server.stop(0.5)


async def _run_command(
    plane: DataPlane, committed: CommittedPlans, command: dict[str, Any], colocated_stages: int
) -> Any:
    from google.protobuf.json_format import MessageToDict

    try:
        if "install" in command:
            assignment = Assignment.from_dict(command["install"])
            committed.add(assignment.plan_id)
            await plane.install(assignment, colocated_stages=colocated_stages)
            return {"installed": assignment.plan_id}
        if "uninstall" in command:
            committed.discard(command["uninstall"])
            await plane.uninstall(command["uninstall"], command.get("reason", "uninstalled"))
            return {"uninstalled": command["uninstall"]}
        if "stats" in command:
            return MessageToDict(plane.stats(), preserving_proto_field_name=True)
        if "generate" in command:
            return await _run_generate(plane, command["generate"])
        return {"error": f"unknown command {sorted(command)}"}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


async def _run_generate(plane: DataPlane, spec: dict[str, Any]) -> dict[str, Any]:
    """``{"plan_id", "prompts": [[ids], ...], "max_tokens", "temperature"?, "seed"?,
    "ignore_eos"?}``: all prompts at once, each request's usage, and the wall time."""
    params = SamplingParams(
        temperature=spec.get("temperature", 0.0),
        seed=spec.get("seed"),
        max_tokens=spec["max_tokens"],
    )
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            _generate_one(plane, spec, prompt, params, f"{plane.node_id}-{index}-{time.time_ns()}")
            for index, prompt in enumerate(spec["prompts"])
        )
    )
    return {"wall_s": time.perf_counter() - started, "requests": results}


async def _generate_one(
    plane: DataPlane,
    spec: dict[str, Any],
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
) -> dict[str, Any]:
    texts: list[str] = []
    stream = plane.generate(
        spec["plan_id"],
        prompt,
        params,
        request_id=request_id,
        ignore_eos=spec.get("ignore_eos", False),
    )
    try:
        async for event in stream:
            if isinstance(event, TokenEvent):
                texts.append(event.text)
                continue
            usage = event.usage
            return {
                "finish_reason": event.finish_reason,
                "error": None,
                "text": "".join(texts) + event.text,
                **vars(usage),
                "decode_tokens_per_s": usage.decode_tokens_per_s,
                "transport_s_per_token": usage.transport_s_per_token,
            }
    except InferenceError as error:
        return {"finish_reason": "error", "error": f"{error.kind.name}: {error}"}
    raise RuntimeError("the request ended without a final event")


def _emit(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
