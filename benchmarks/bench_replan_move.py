"""What a re-plan that moves stage boundaries costs on real `meshd run` daemons, next to
reloading everything (a fresh start of the same layout), side by side in one run.

Three network namespaces (run as root), the embedded SmolLM2-135M (30 layers, float32),
`--strategy memory`, every node with its own copy of the model:

  1. fresh 2-node load: two daemons start; they read their halves (15/15 layers);
  2. join 2 -> 3: a third daemon starts; every boundary moves (10/10/10): the two running
     nodes keep the layers they share with their old stage and read only the rest;
  3. leave 3 -> 2: the third daemon gets SIGTERM (graceful leave); the survivors take its
     layers back;
  4. fresh 3-node load: all three restart (same state, same node ids) and read their stages
     from nothing: what the join would cost if a re-plan reloaded everything;
  5. fresh 2-node load after the leave is row 1.

Per transition: weight bytes read from disk and layers read/kept (the daemons' own counters,
`meshd status` "stages loaded since start"), bytes fetched from peers (event log), and the
seconds from the new plan's commit to the last node's "ready here" (daemon log stamps), and
to the last "ready here" of the nodes that held a stage before ("holders": what the re-plan
costs them; a joining node loads its stage from nothing either way).

    .venv/bin/python benchmarks/bench_replan_move.py [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from meshd.models.store import ModelStore
from meshd.wire import pb
from tests.netns import Mesh, cleanup_stale, require_root_and_netns
from tests.support.settled_mesh import namespaced_daemons, wait_settled

MB = 1e6
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \S+ \S+ (.*)$")
FETCHED = re.compile(r"fetched .* ([0-9.]+) MB in")
COUNTERS = ("stage_loads", "layers_loaded", "layers_kept", "bytes_loaded")


def counters(daemons: list[DaemonProcess]) -> dict[str, dict[str, int]]:
    out = {}
    for daemon in daemons:
        status = daemon.status()
        out[status.node_id] = {name: getattr(status.transitions, name) for name in COUNTERS}
    return out


def log_lines(daemon: DaemonProcess) -> list[tuple[float, str]]:
    lines = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        match = LOG_LINE.match(line)
        if match:
            hh, mm, ss, ms, message = match.groups()
            lines.append((int(hh) * 3600 + int(mm) * 60 + int(ss) + int(ms) / 1000, message))
    return lines


def install_seconds(daemons: list[DaemonProcess], plan_id: str, since: float) -> dict[int, float]:
    """Per daemon (index): from the first 'committed plan <id>' line of any daemon to its own
    '<id> ready here' line, both after ``since`` (a plan id is its layout: a layout served
    before has the same id)."""
    short = plan_id[:12]
    committed, ready = [], {}
    for index, daemon in enumerate(daemons):
        for at, message in log_lines(daemon):
            if at < since:
                continue
            if f"committed plan {short}" in message:
                committed.append(at)
            if f"plan {short} ready here" in message:
                ready[index] = at
    if not committed:
        return {}
    return {index: at - min(committed) for index, at in ready.items()}


def fetched_mb(daemons: list[DaemonProcess], since: float) -> float:
    total = 0.0
    for daemon in daemons:
        for at, message in log_lines(daemon):
            match = FETCHED.search(message)
            if match and at >= since:
                total += float(match.group(1))
    return total


def layout(status: pb.MeshStatus) -> str:
    plan = json.loads(status.agreement.plan_json)
    return "/".join(str(s["layer_end"] - s["layer_start"]) for s in plan["stages"])


def seconds_of_day() -> float:
    now = time.time()
    local = time.localtime(now)
    return local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + now % 1


def measure(
    name: str,
    daemons: list[DaemonProcess],
    n: int,
    before: dict[str, dict[str, int]],
    since: float,
    previous_layout: str,
) -> dict:
    status = wait_settled(daemons, n, timeout_s=180)
    after = counters(daemons)
    seconds = install_seconds(daemons, status.agreement.active_plan_id, since)
    # Nodes that served a plan before: what a re-plan costs them (a joining node has nothing
    # to keep, whatever the mesh does); on a fresh load, every node.
    holders = [i for i, d in enumerate(daemons) if not before or d.status().node_id in before]
    delta = {
        name: sum(after[node][name] - before.get(node, {}).get(name, 0) for node in after)
        for name in COUNTERS
    }
    return {
        "transition": name,
        "layout": f"{previous_layout} -> {layout(status)}",
        "plan": status.agreement.active_plan_id[:12],
        "mb_read": round(delta["bytes_loaded"] / MB, 1),
        "layers_read": delta["layers_loaded"],
        "layers_kept": delta["layers_kept"],
        "stages_built": delta["stage_loads"],
        "mb_fetched": round(fetched_mb(daemons, since), 1),
        "commit_to_ready_s": round(max(seconds.values(), default=float("nan")), 3),
        "holders_ready_s": round(
            max((seconds[i] for i in holders if i in seconds), default=float("nan")), 3
        ),
        "load_average": os.getloadavg()[0],
        "_layout": layout(status),
    }


def run(root: Path, token: str, profile: Path, model: Path) -> list[dict]:
    rows = []
    with Mesh(3) as mesh:
        args = ["--interface", "eth0", "--join", token, "--model", str(model)]
        daemons = namespaced_daemons(mesh, root, profile, [*args, "--strategy", "memory"])
        try:
            since = seconds_of_day()
            for daemon in daemons[:2]:
                daemon.start()
            rows.append(measure("fresh load, 2 nodes", daemons[:2], 2, {}, since, "-"))
            before, since = counters(daemons[:2]), seconds_of_day()
            daemons[2].start()
            rows.append(
                measure("join 2->3 (incremental)", daemons, 3, before, since, rows[-1]["_layout"])
            )
            three = rows[-1]["_layout"]
            before, since = counters(daemons[:2]), seconds_of_day()
            assert daemons[2].proc is not None
            daemons[2].proc.send_signal(signal.SIGTERM)
            daemons[2].proc.wait(60)
            rows.append(measure("leave 3->2 (incremental)", daemons[:2], 2, before, since, three))
            for daemon in daemons:
                daemon.kill()
            since = seconds_of_day()
            for daemon in daemons:
                daemon.start()
            rows.append(measure("fresh load, 3 nodes (restart)", daemons, 3, {}, since, "-"))
        finally:
            for daemon in daemons:
                daemon.kill()
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'transition':32s}{'layout':>16s}{'MB read':>9s}{'layers read':>12s}"
        f"{'kept':>6s}{'stages built':>13s}{'MB fetched':>11s}{'all ready s':>12s}"
        f"{'holders ready s':>16s}{'load':>6s}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['transition']:32s}{r['layout']:>16s}{r['mb_read']:9.1f}{r['layers_read']:12d}"
            f"{r['layers_kept']:6d}{r['stages_built']:13d}{r['mb_fetched']:11.1f}"
            f"{r['commit_to_ready_s']:12.3f}{r['holders_ready_s']:16.3f}{r['load_average']:6.1f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    require_root_and_netns()
    cleanup_stale()
    root = Path(tempfile.mkdtemp(prefix="bench-replan-move-"))
    token = security.encode_join_token(security.create_mesh_secret("bench-replan-move"))
    try:
        load_or_measure_profile(root / "profile", memory_budget_override=None)
        profile = root / "profile" / "profile.json"
        model = ModelStore(root / "store").ensure_default().path
        rows = run(root / "hosts", token, profile, model)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"command: {' '.join(sys.argv)}; uptime load {os.getloadavg()}")
    print_table(rows)
    if args.json:
        args.json.write_text(
            json.dumps([{k: v for k, v in r.items() if k[0] != "_"} for r in rows], indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
