// meshd dashboard: the mesh, the plan, requests, events and a chat box, live from the daemon.
// Data: GET /meshd/status once, then server-sent events from /meshd/stream ("status" on
// every change of the mesh, "activity" every second). The chat uses /v1/chat/completions.
// The model picker lists GET /meshd/models and loads with POST /meshd/load; the plan card's
// download lines then show each node fetching its stage's files.
"use strict";

const STAGE_COLORS = ["#4f9cf9", "#f5a524", "#3ecf8e", "#e5484d", "#a78bfa", "#f472b6",
  "#22d3ee", "#facc15"];
const $ = (id) => document.getElementById(id);
const num = (v) => Number(v || 0);

const state = { status: null, graph: null, chart: null, rates: [[], []], history: [],
  shape: "", busy: false };

function gb(bytes) { return (num(bytes) / 1e9).toFixed(2) + " GB"; }
function mb(bytes) { return (num(bytes) / 1e6).toFixed(0) + " MB"; }
function rate(bytesPerS) {
  const bits = num(bytesPerS) * 8;
  return bits >= 1e9 ? (bits / 1e9).toFixed(1) + " Gbit/s" : (bits / 1e6).toFixed(0) + " Mbit/s";
}
function ms(seconds) {
  const v = num(seconds) * 1e3;
  return (v < 1 ? v.toFixed(3) : v.toFixed(1)) + " ms";
}
// Mirrors partitioner.humanize.format_wait and format_token_rate: "0.57 s", "6.5 tokens/s".
function wait(seconds) {
  const v = num(seconds);
  if (v < 0.1) return (v * 1e3).toFixed(0) + " ms";
  if (v < 10) return v < 1 ? v.toFixed(2) + " s" : v.toFixed(1) + " s";
  return v.toFixed(0) + " s";
}
function tokenRate(perS) {
  const v = num(perS);
  return (v < 100 ? v.toFixed(1) : v.toFixed(0)) + " tokens/s";
}
// One predicted figure and what this node's requests measured: "predicted 6.5 tokens/s,
// measured 6.9 tokens/s (1.06×, 12 requests)".
function figure(f, show) {
  if (!f) return "";
  const predicted = num(f.predicted) > 0 ? `predicted ${show(f.predicted)}` : "no prediction";
  if (!num(f.requests)) return `${predicted}, not measured yet`;
  return `${predicted}, measured ${show(f.measured)} (${num(f.ratio).toFixed(2)}×, ` +
    `${f.requests} request${num(f.requests) === 1 ? "" : "s"})`;
}
function predictionLines(status, plan) {
  const check = status.prediction_check;
  const p = plan.prediction;
  if (!check || !check.plan_id) {
    return p ? [`predicted ${tokenRate(p.tokens_per_s)}, first token ${wait(p.ttft_s)} ` +
      `for ${p.prompt_len} prompt tokens`] : [];
  }
  const lines = [`decode alone: ${figure(check.decode_alone, tokenRate)}`];
  if (check.decode_concurrent && num(check.concurrency) > 1)
    lines.push(`decode at ${check.concurrency}: ${figure(check.decode_concurrent, tokenRate)} per request`);
  lines.push(`prefill: ${figure(check.prefill, tokenRate)}`);
  lines.push(`first token: ${figure(check.ttft, wait)}`);
  for (const c of status.speed_corrections || []) {
    const parts = [];
    if (num(c.samples) > 0) parts.push(`median of ${c.samples} decode steps`);
    if (num(c.row_flops) > 0) parts.push(`each batched row ${(num(c.row_flops) / 1e9).toFixed(1)} GFLOP/s`);
    if (num(c.compute_factor) > 0) parts.push(`prompts ${num(c.compute_factor).toFixed(2)}×`);
    if (num(c.collective_overhead_s) > 0)
      parts.push(`collectives ${(num(c.collective_overhead_s) * 1e3).toFixed(2)} ms each`);
    lines.push(`speed correction ${nameOf(status, c.node_id)}: ${num(c.factor || 1).toFixed(2)}×` +
      (parts.length ? ` (${parts.join("; ")})` : ""));
  }
  return lines;
}
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") node.style.cssText = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) node.append(child);
  return node;
}

// ------------------------------------------------------------------ what the status says

function nameOf(status, nodeId) {
  const peer = status.nodes.find((n) => n.profile.node_id === nodeId);
  return (peer && peer.profile.name) || nodeId;
}

function stageIndex(plan) {
  const index = {};
  if (plan) plan.stages.forEach((stage, i) => stage.nodes.forEach((n) => { index[n] = i; }));
  return index;
}

function plannedMemory(plan) {
  const memory = {};
  if (plan) plan.memory.forEach((m) => { memory[m.node] = m; });
  return memory;
}

// ------------------------------------------------------------------ the mesh as a picture

function ensureGraph() {
  if (state.graph || typeof cytoscape === "undefined") return state.graph;
  state.graph = cytoscape({
    container: $("graph"),
    userZoomingEnabled: false,
    boxSelectionEnabled: false,
    autoungrabify: false,
    style: [
      { selector: "node", style: {
        "background-color": "data(color)", "border-width": 3, "border-color": "data(ring)",
        width: "data(size)", height: "data(size)", label: "data(label)", color: "#e6e9ef",
        "font-size": 12, "text-wrap": "wrap", "text-valign": "bottom", "text-margin-y": 6,
        "text-background-color": "#0f1218", "text-background-opacity": 0.7,
        "text-background-padding": 3, "text-background-shape": "roundrectangle" } },
      { selector: "edge", style: {
        width: "data(width)", "line-color": "#3b455a", "curve-style": "bezier",
        label: "data(label)", "font-size": 11, color: "#aab3c5", "text-rotation": "autorotate",
        "text-background-color": "#141821", "text-background-opacity": 0.9,
        "text-background-padding": 2 } },
    ],
  });
  new ResizeObserver(() => { state.graph.resize(); state.graph.fit(undefined, 24); })
    .observe($("graph"));
  return state.graph;
}

function drawGraph(status) {
  const cy = ensureGraph();
  if (!cy) return;
  const plan = status.plan;
  const stages = stageIndex(plan);
  const alive = status.nodes.filter((n) => n.alive);
  const budgets = alive.map((n) => num(n.profile.memory_budget));
  const maxBudget = Math.max(1, ...budgets);
  const elements = alive.map((peer) => {
    const p = peer.profile;
    const stage = stages[p.node_id];
    const color = stage === undefined ? "#5b6475" : STAGE_COLORS[stage % STAGE_COLORS.length];
    const flops = num(p.flops) > 0 ? (num(p.flops) / 1e9).toFixed(0) + " GFLOP/s" : "measuring";
    const self = peer.source === "self";
    return { group: "nodes", data: {
      id: p.node_id, color, ring: self ? "#ffffff" : "#0f1218",
      size: 34 + 30 * Math.sqrt(num(p.memory_budget) / maxBudget),
      label: `${p.name || p.node_id}${self ? " (this node)" : ""}\n` +
        `${gb(p.memory_budget)} · ${flops}` },
    };
  });
  const ids = new Set(alive.map((n) => n.profile.node_id));
  const pairs = {};
  for (const link of status.links) {
    if (!ids.has(link.src) || !ids.has(link.dst) || num(link.bandwidth) <= 0) continue;
    const key = [link.src, link.dst].sort().join("|");
    (pairs[key] = pairs[key] || []).push(link);
  }
  const maxBw = Math.max(1, ...Object.values(pairs).flat().map((l) => num(l.bandwidth)));
  for (const [key, links] of Object.entries(pairs)) {
    const [a, b] = key.split("|");
    const bw = Math.min(...links.map((l) => num(l.bandwidth)));
    const latency = links.reduce((s, l) => s + num(l.latency_s), 0) / links.length;
    const trusted = links.length === 2 && links.every((l) => l.trusted);
    elements.push({ group: "edges", data: {
      id: key, source: a, target: b, width: 1.5 + 4 * bw / maxBw,
      label: `${rate(bw)} · ${ms(latency)}${trusted ? " · TP" : ""}` } });
  }
  const shape = [...ids].sort().join(",");
  cy.batch(() => {
    cy.elements().forEach((e) => { if (!elements.some((x) => x.data.id === e.id())) e.remove(); });
    for (const item of elements) {
      const existing = cy.getElementById(item.data.id);
      if (existing.nonempty()) existing.data(item.data); else cy.add(item);
    }
  });
  if (shape !== state.shape) {
    state.shape = shape;
    const box = $("graph");
    const radius = Math.max(60, Math.min(box.clientWidth, box.clientHeight) / 2 - 40);
    const layout = cy.nodes().length <= 6
      ? { name: "circle", padding: 60, radius, startAngle: -Math.PI / 2, animate: false }
      : { name: "cose", padding: 60, animate: false, nodeRepulsion: 9000, idealEdgeLength: 140 };
    cy.layout(layout).run();
    cy.fit(undefined, 24);
    if (cy.zoom() > 1.4) { cy.zoom(1.4); cy.center(); }
  }
}

// "±4%": half the p10-p90 spread of a profile's samples ("" when not known).
function spread(value) {
  const v = num(value);
  return v > 0 ? ` ±${(50 * v).toFixed(0)}%` : "";
}

function drawNodeTable(status) {
  const plan = status.plan;
  const stages = stageIndex(plan);
  const memory = plannedMemory(plan);
  const body = $("node-table").tBodies[0];
  body.replaceChildren();
  const alive = status.nodes.filter((n) => n.alive);
  for (const peer of alive) {
    const p = peer.profile;
    const stage = stages[p.node_id];
    const self = peer.source === "self";
    const budget = num(p.memory_budget);
    const planned = memory[p.node_id] ? num(memory[p.node_id].total_bytes) : 0;
    const used = self ? num(status.memory.mlx_active) : 0;
    const bar = el("div", { className: "membar", title: "planned / budget" },
      el("span", { className: "planned", style: `width:${Math.min(100, 100 * planned / Math.max(1, budget))}%` }),
      el("span", { className: "used", style: `width:${Math.min(100, 100 * used / Math.max(1, budget))}%` }));
    const overhead = num(p.process_overhead);
    const memText = `${planned ? mb(planned) + " planned" : "none planned"}` +
      `${self ? " · " + mb(used) + " in use" : ""} / ${gb(budget)} budget` +
      `${overhead ? " · " + mb(overhead) + " process overhead" : ""}` +
      `${self ? " · RSS " + mb(num(status.memory.rss)) : ""}`;
    const color = stage === undefined ? "#5b6475" : STAGE_COLORS[stage % STAGE_COLORS.length];
    const layers = stage === undefined ? "—"
      : `${stage}: layers ${plan.stages[stage].layer_start}–${plan.stages[stage].layer_end - 1}`;
    body.append(el("tr", { "data-node-id": p.node_id, className: "node-row" },
      el("td", {}, el("span", { className: "dot", style: `background:${color}` }),
        `${p.name || p.node_id}${self ? " (this node)" : ""}`,
        el("div", { className: "muted small mono" }, `${p.node_id} · ${peer.address}`),
        el("div", { className: "muted small" }, stage === undefined ? "no stage" : `stage ${layers}`)),
      el("td", {}, memText, bar),
      el("td", {}, num(p.flops) > 0
        ? `${(num(p.flops) / 1e9).toFixed(0)} GFLOP/s${spread(p.flops_spread)} · ` +
          `${(num(p.mem_bandwidth) / 1e9).toFixed(1)} GB/s${spread(p.mem_bandwidth_spread)}`
        : "measuring",
        num(p.flops) > 0 ? el("div", { className: "muted small" }, p.loaded
          ? `measured under load (${num(p.other_busy_cores).toFixed(1)} cores busy elsewhere)`
          : "measured quietly") : "")));
  }
  const lost = status.nodes.filter((n) => !n.alive).map((n) => n.profile.name || n.profile.node_id);
  $("lost-nodes").textContent = lost.length ? `lost: ${lost.join(", ")}` : "";
  $("node-count").textContent = `${alive.length} node${alive.length === 1 ? "" : "s"} alive`;
  $("node-count").dataset.alive = String(alive.length);
}

// ------------------------------------------------------------------ the plan

function drawPlan(status) {
  const view = status.agreement;
  const plan = status.plan;
  const why = $("plan-why");
  const reason = view.refusal ? `Refused: ${view.refusal}`
    : view.reason ? `${plan ? "Converging on a new plan" : "Not committed yet"}: ${view.reason}`
    : plan && plan.note ? `Note: ${plan.note}` : "";
  why.hidden = !reason && !!plan;
  why.className = view.refusal ? "why bad" : "why";
  why.textContent = reason || (!view.model ? "No model selected: start a node with --model, or run `meshd load MODEL`."
    : "The mesh has not agreed on a plan yet.");
  const pill = $("plan-pill");
  if (plan && view.active_plan_id) {
    pill.textContent = `plan ${view.active_plan_id.slice(0, 12)}`;
    pill.className = view.converged ? "pill good" : "pill warn";
  } else {
    pill.textContent = view.refusal ? "plan refused" : "no plan";
    pill.className = view.refusal ? "pill bad" : "pill warn";
  }
  $("plan-id").textContent = view.active_plan_id ? view.active_plan_id.slice(0, 12) : "";
  $("chat-model").textContent = view.model || "";
  const bars = $("plan-bars");
  bars.replaceChildren();
  $("plan-axis").replaceChildren();
  $("plan-memory").replaceChildren();
  $("plan-prediction").textContent = "";
  $("plan-groups").replaceChildren();
  if (!plan) { $("plan-model").textContent = view.model ? `model ${view.model}` : ""; drawTensorParallel(status); return; }
  $("plan-model").textContent = `${plan.model_name}: ${plan.num_layers} layers over ` +
    `${plan.stages.length} stage${plan.stages.length === 1 ? "" : "s"}` +
    `${plan.layout ? " · " + plan.layout + " layout" : ""} · ${plan.strategy} strategy` +
    (view.draining.length ? ` · draining ${view.draining.map((p) => p.slice(0, 8)).join(", ")}` : "");
  const groups = {};
  for (const g of status.tensor_parallel_groups || []) groups[g.stage] = g;
  plan.stages.forEach((stage, i) => {
    const count = stage.layer_end - stage.layer_start;
    const names = stage.nodes.map((n) => nameOf(status, n)).join(" + ");
    const extra = [stage.has_embedding ? "embed" : "", stage.has_head ? "head" : ""].filter(Boolean);
    const group = groups[i];
    const tp = stage.nodes.length > 1
      ? ` (TP×${stage.nodes.length}${group ? ", " + group.backend : ""})` : "";
    const title = `${names}: layers ${stage.layer_start}–${stage.layer_end - 1}` +
      (group ? `\ntensor-parallel over ${group.link}` : "");
    bars.append(el("div", {
      className: "stage", "data-stage": String(i),
      style: `flex:${count} 1 0; background:${STAGE_COLORS[i % STAGE_COLORS.length]}`, title },
      el("span", {}, names + tp),
      el("small", {}, `${stage.layer_start}–${stage.layer_end - 1}` + (extra.length ? ` · ${extra.join(", ")}` : ""))));
  });
  drawTensorParallel(status);
  const axis = $("plan-axis");
  axis.append(el("span", {}, "layer 0"), el("span", {}, `layer ${plan.num_layers - 1}`));
  for (const m of plan.memory) {
    const budget = num(m.budget_bytes);
    $("plan-memory").append(el("div", { className: "memrow" },
      el("span", {}, nameOf(status, m.node)),
      el("div", { className: "membar" },
        el("span", { className: "used", style: `width:${Math.min(100, 100 * num(m.total_bytes) / Math.max(1, budget))}%;background:${STAGE_COLORS[m.stage % STAGE_COLORS.length]}` })),
      el("span", { className: "muted" }, `${mb(m.total_bytes)} of ${gb(budget)}`)));
  }
  $("plan-prediction").replaceChildren(
    ...predictionLines(status, plan).map((line) => el("div", {}, line)));
}

// Tensor-parallel groups of the plan (ranks, backend, the link and why it may carry them),
// this node's runner processes, and why links were not trusted for tensor parallelism.
function drawTensorParallel(status) {
  const box = $("plan-groups");
  box.replaceChildren();
  for (const g of status.tensor_parallel_groups || []) {
    const ranks = g.members.map((n, rank) =>
      `rank ${rank} ${nameOf(status, n)}${g.addresses && g.addresses[rank] ? " (" + g.addresses[rank] + ")" : ""}`);
    box.append(el("div", { className: "tp-group", "data-stage": String(g.stage) },
      el("b", {}, `stage ${g.stage}: tensor-parallel ×${g.members.length}`),
      ` · ${g.backend} · ${ranks.join(", ")}`,
      el("div", { className: "muted small" }, `link: ${g.link}`)));
  }
  for (const r of status.tensor_parallel_runners || []) {
    box.append(el("div", { className: "tp-runner muted small" },
      `runner here: plan ${r.plan_id.slice(0, 12)} stage ${r.stage}, rank ${r.rank} of ${r.size}, ` +
      `pid ${r.pid || "—"}, ${mb(r.held_bytes)}: ${r.state}${r.error ? " (" + r.error + ")" : ""}`));
  }
  const refused = {};
  for (const link of status.links) {
    if (!link.trusted && link.trust_reason) (refused[link.trust_reason] = refused[link.trust_reason] || []).push(link);
  }
  for (const [reason, links] of Object.entries(refused)) {
    const which = links.map((l) => `${nameOf(status, l.src)}→${nameOf(status, l.dst)}`).join(", ");
    box.append(el("div", { className: "tp-refused muted small" },
      `no tensor parallelism on ${which}: ${reason}`));
  }
}

// ------------------------------------------------------------------ downloads

// One line per node while the mesh downloads a Hub repository: its files summed, where
// they come from (the Hub, or the peer that downloads them), its rate and time left.
function drawDownloads(status) {
  const box = $("plan-downloads");
  const byNode = new Map();
  for (const d of status.downloads || []) {
    const sum = byNode.get(d.node) || { done: 0, total: 0, rate: 0, left: 0, files: 0, sources: new Set() };
    sum.done += num(d.done_bytes); sum.total += num(d.total_bytes); sum.rate += num(d.rate_bytes_per_s);
    sum.left = Math.max(sum.left, num(d.seconds_left)); sum.files += 1; sum.sources.add(d.source);
    byNode.set(d.node, sum);
  }
  const mb = (b) => `${(b / 1e6).toFixed(1)} MB`;
  box.replaceChildren(...[...byNode.entries()].sort().map(([node, s]) => {
    const pct = s.total ? Math.round((100 * s.done) / s.total) : 0;
    const left = s.left ? `, ${Math.round(s.left)} s left` : "";
    const bar = el("progress", { max: 100, value: pct });
    return el("div", {}, bar, ` ${node}: ${pct}% of ${mb(s.total)} (${s.files} files, ` +
      `${mb(s.rate)}/s${left}, from ${[...s.sources].sort().join(", ")})`);
  }));
}

// ------------------------------------------------------------------ events, header

function drawEvents(status) {
  const list = $("events");
  list.replaceChildren();
  for (const line of [...status.events].reverse()) {
    const level = /cannot|failed|error|refus/i.test(line) ? "error" : /lost|gone|withdrawn/i.test(line) ? "warning" : "";
    list.append(el("li", { className: level }, line));
  }
}

function drawHeader(status) {
  $("mesh-name").textContent = `mesh ${status.mesh_name}`;
  $("mesh-meta").textContent = `fingerprint ${status.mesh_fingerprint} · this node ${status.node_id}` +
    (status.blas ? ` · ${status.blas}` : "");
  document.title = `meshd · ${status.mesh_name}`;
}

function render(status) {
  state.status = status;
  drawHeader(status);
  drawGraph(status);
  drawNodeTable(status);
  drawPlan(status);
  drawDownloads(status);
  drawEvents(status);
}

// ------------------------------------------------------------------ activity

function ensureChart() {
  if (state.chart || typeof uPlot === "undefined") return state.chart;
  const box = $("chart");
  state.chart = new uPlot({
    width: box.clientWidth || 400, height: 120, legend: { show: false }, cursor: { show: false },
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(5, max * 1.15)] } },
    axes: [{ stroke: "#8b93a5", grid: { stroke: "#222837" }, ticks: { stroke: "#222837" } },
      { stroke: "#8b93a5", grid: { stroke: "#222837" }, ticks: { stroke: "#222837" }, size: 40 }],
    series: [{}, { stroke: "#4f9cf9", width: 2, fill: "rgba(79,156,249,0.15)" }],
  }, state.rates, box);
  new ResizeObserver(() => state.chart.setSize({ width: box.clientWidth, height: 120 })).observe(box);
  return state.chart;
}

function onActivity(activity) {
  $("tokens-per-s").textContent = num(activity.tokens_per_s).toFixed(1);
  $("requests").textContent = String(activity.requests);
  $("stage-requests").textContent = String(activity.stage_requests);
  $("queued-requests").textContent = String(activity.queued_requests ?? 0);
  const drafted = num(activity.drafted_tokens ?? 0);
  $("drafts-accepted").textContent = drafted
    ? `${Math.round((100 * num(activity.accepted_tokens ?? 0)) / drafted)}%` : "-";
  const lookups = num(activity.prefix_lookups ?? 0);
  $("prefix-hits").textContent = lookups
    ? `${num(activity.prefix_hits ?? 0)} of ${lookups}` : "-";
  $("prefix-reused").textContent = String(num(activity.prefix_reused_tokens ?? 0));
  const now = Date.now() / 1000;
  state.rates[0].push(now);
  state.rates[1].push(num(activity.tokens_per_s));
  while (state.rates[0].length && state.rates[0][0] < now - 120) {
    state.rates[0].shift(); state.rates[1].shift();
  }
  const chart = ensureChart();
  if (chart) chart.setData(state.rates);
}

// ------------------------------------------------------------------ live connection

function setLive(text, kind) {
  const pill = $("live-pill");
  pill.textContent = text;
  pill.className = `pill ${kind}`;
}

function connect() {
  const source = new EventSource("/meshd/stream");
  source.addEventListener("open", () => setLive("live", "good"));
  source.addEventListener("status", (e) => render(JSON.parse(e.data)));
  source.addEventListener("activity", (e) => onActivity(JSON.parse(e.data)));
  source.addEventListener("error", () => setLive("reconnecting", "warn"));
}

async function start() {
  const reply = await fetch("/meshd/status", { credentials: "same-origin" });
  if (reply.status === 401) { $("key-dialog").hidden = false; $("key-input").focus(); return; }
  if (!reply.ok) { setLive(`error ${reply.status}`, "bad"); return; }
  const data = await reply.json();
  render(data.status);
  onActivity(data.activity);
  connect();
  listModels();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const reply = await fetch("/meshd/session", { method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify({ key: $("key-input").value.trim() }) });
  if (!reply.ok) { $("key-error").textContent = "That key is not valid here."; return; }
  $("key-dialog").hidden = true;
  start();
});

// ------------------------------------------------------------------ model picker

async function listModels() {
  const reply = await fetch("/meshd/models", { credentials: "same-origin" });
  if (!reply.ok) return;
  const data = await reply.json();
  const names = [...new Set(data.models.map((m) => m.name))];
  $("load-models").replaceChildren(...names.map((name) => el("option", { value: name })));
}

async function errorText(response) {
  const body = await response.json().catch(() => ({}));
  return (body.error && (body.error.message || body.error)) || `HTTP ${response.status}`;
}

$("load-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const model = $("load-input").value.trim();
  $("load-error").textContent = "";
  $("load-note").textContent = "";
  if (!model) { $("load-error").textContent = "Name a model: ORG/NAME, a store name or a path."; return; }
  $("load-send").disabled = true;
  try {
    const reply = await fetch("/meshd/load", { method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model }) });
    if (!reply.ok) throw new Error(await errorText(reply));
    $("load-note").textContent = (await reply.json()).message;
    listModels();
  } catch (error) {
    $("load-error").textContent = String(error.message || error);
  } finally {
    $("load-send").disabled = false;
  }
});

// ------------------------------------------------------------------ chat

function addMessage(role, text) {
  const node = el("div", { className: `msg ${role}` }, text);
  $("chat-log").append(node);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return node;
}

async function* sseData(body) {
  // The server frames events (sse-starlette); the page only splits them to read `data:`.
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) yield data;
    }
  }
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.busy) return;
  state.busy = true;
  $("chat-send").disabled = true;
  $("chat-input").value = "";
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const answer = addMessage("assistant", "…");
  const started = performance.now();
  let firstAt = 0, reply = "", usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages: state.history, stream: true, max_tokens: 256,
        stream_options: { include_usage: true } }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
    }
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (!firstAt) firstAt = performance.now();
        reply += delta.content;
        answer.textContent = reply;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
    }
    state.history.push({ role: "assistant", content: reply });
    const seconds = (performance.now() - started) / 1000;
    if (usage) $("chat-stats").textContent = `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s · ` +
      `first token ${((firstAt - started) / 1000).toFixed(2)} s · ${usage.prompt_tokens} prompt tokens`;
  } catch (error) {
    answer.className = "msg error";
    answer.textContent = String(error.message || error);
    state.history.pop();
  } finally {
    state.busy = false;
    $("chat-send").disabled = false;
    $("chat-input").focus();
  }
});

start();
