"""Requests through a lost or leaving stage, and plan churn, on real `meshd run` daemons.

Three daemons in network namespaces (run as root) split the embedded SmolLM2-135M (memory
strategy: a third of the layers each). Reports:

  * kill -9: a greedy answer of up to 200 tokens streams from the first stage's node; after
    20 pieces the middle stage is killed. The pause (kill -> next piece on the client), the
    resumes and whether the text equals the undisturbed run's (goal: no error, pause < 3 s).
  * SIGTERM: the same with a SIGTERM (the node leaves gracefully; goal: pause < 1 s). A
    request that moves in the background never stops: ``max_gap_after_s``, the longest gap
    between pieces after the disturbance, is its pause (``next_piece_s`` only the first).
  * churn: committed plans on a static mesh of --static-nodes (4) with link probes every 5 s
    over --static-s seconds, after the first plan (goal: none; at most 1 per 10
    minutes), while a child process keeps a core busy and a short request goes to the next
    node every 2 s (goal: no failed request).

    .venv/bin/python benchmarks/bench_resume.py [--static-s 300] [--json out.json]

To measure an older commit, put its tree (with a ``meshd`` link to its ``daemon/``) first on
PYTHONPATH: the daemons then run that code (``--label`` names it in the output). Everything
runs inside namespaces this script creates and removes.
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from meshd.models.store import ModelStore
from meshd.wire import pb
from tests.netns import Mesh, cleanup_stale, require_root_and_netns
from tests.support.cpu_load import busy_core
from tests.support.settled_mesh import namespaced_daemons

STORY = "Write a long story about a lighthouse keeper and a storm."
MAX_TOKENS = 200
DISTURB_AFTER = 20
COMMITTED = re.compile(r"committed plan ([0-9a-f]{12})")
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) (\S+) (\S+) (.*)$")
# The steps of a recovery, as the daemons' logs say them (first line after the disturbance).
MILESTONES = [
    ("loss seen (membership)", re.compile(r"peer \S+ lost")),
    (
        "stage failure seen (data plane)",
        re.compile(r"data-plane link to \S+ \(\S+\) broke"),
    ),
    ("old plan withdrawn", re.compile(r"plan [0-9a-f]{12} withdrawn")),
    ("new plan committed", re.compile(r"committed plan")),
    ("new plan loaded", re.compile(r"plan [0-9a-f]{12} ready here")),
    ("origin moves the request", re.compile(r"request \S+ moves to plan")),
]


def committed_over(n: int):
    def check(status: pb.MeshStatus) -> bool:
        view = status.agreement
        return bool(view.active_plan_id and view.plan_json) and len(view.members) == n

    return check


def stage_order(daemons: list[DaemonProcess]) -> list[DaemonProcess]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        statuses = [d.status() for d in daemons]
        ids = {s.agreement.active_plan_id for s in statuses}
        if len(ids) == 1 and all(committed_over(len(daemons))(s) for s in statuses):
            stages = json.loads(statuses[0].agreement.plan_json)["stages"]
            by_id = {s.node_id: d for s, d in zip(statuses, daemons, strict=True)}
            return [by_id[stage["nodes"][0]] for stage in stages]
        time.sleep(0.2)
    raise TimeoutError("the daemons did not agree on one plan over all of them")


def story(daemon: DaemonProcess, disturb=None) -> dict:
    """Stream the story; ``disturb()`` runs (in a thread) after DISTURB_AFTER pieces."""
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content=STORY)],
        sampling=pb.Sampling(max_tokens=MAX_TOKENS, temperature=0.0),
    )
    pieces: list[str] = []
    arrivals: list[float] = []
    disturbed_at: list[float] = []
    outcome: dict = {}
    try:
        for event in client.stream_generation(daemon.api, request, timeout_s=600):
            if event.HasField("done"):
                # (an older daemon's GenerationDone has neither field)
                outcome["resumes"] = getattr(event.done, "resumes", None)
                outcome["paused_s"] = round(getattr(event.done, "paused_s", 0.0), 3)
                outcome["tokens"] = event.done.completion_tokens
                continue
            pieces.append(event.text)
            arrivals.append(time.monotonic())
            if disturb is not None and len(pieces) == DISTURB_AFTER:
                disturbed_at.append(time.monotonic())
                threading.Thread(target=disturb, daemon=True).start()
    except client.GenerationFailed as error:
        outcome["error"] = str(error)[:300]
    if disturbed_at:
        outcome["disturbed_after_pieces"] = DISTURB_AFTER
        after = [t for t in arrivals if t > disturbed_at[0]]
        outcome["next_piece_s"] = round(after[0] - disturbed_at[0], 3) if after else None
        # A move in the background keeps streaming: its pause is the longest gap after the
        # disturbance (the switch-over), not the wait for the first piece after it.
        gaps = [b - a for a, b in zip([disturbed_at[0], *after], after, strict=False)]
        outcome["max_gap_after_s"] = round(max(gaps), 3) if gaps else None
        outcome["error_after_s"] = (
            round(time.monotonic() - disturbed_at[0], 3) if "error" in outcome else None
        )
    outcome["text"] = "".join(pieces)
    return outcome


def seconds_of_day(wall: float) -> float:
    local = time.localtime(wall)
    return local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + wall % 1


def timeline(daemons: list[DaemonProcess], since_wall: float) -> list[dict]:
    """The recovery's steps on each daemon: seconds from the disturbance to the first log
    line of each milestone (daemon logs stamp milliseconds, local time)."""
    start = seconds_of_day(since_wall)
    rows = []
    for index, daemon in enumerate(daemons):
        seen: dict[str, float] = {}
        for line in daemon.log_path.read_text(errors="replace").splitlines():
            match = LOG_LINE.match(line)
            if match is None:
                continue
            hh, mm, ss, ms, _name, _level, message = match.groups()
            at = int(hh) * 3600 + int(mm) * 60 + int(ss) + int(ms) / 1000
            if at < start - 0.0005:
                continue
            for label, pattern in MILESTONES:
                if label not in seen and pattern.search(message):
                    seen[label] = round(at - start, 3)
        rows.append({"host": index, **seen})
    return rows


def print_timeline(rows: list[dict], next_piece_s: float | None) -> None:
    labels = [label for label, _ in MILESTONES]
    print(f"{'step (s after the disturbance)':34s}" + "".join(f"host{r['host']:>5d}" for r in rows))
    for label in labels:
        cells = "".join(f"{r[label]:9.3f}" if label in r else f"{'-':>9s}" for r in rows)
        print(f"{label:34s}{cells}")
    if next_piece_s is not None:
        print(f"{'next piece on the client':34s}{next_piece_s:9.3f}")


def start(mesh: Mesh, root: Path, token: str, profile: Path, model: Path, probe_s: float):
    args = ["--interface", "eth0", "--join", token, "--model", str(model)]
    args += ["--strategy", "memory", "--link-probe-interval", str(probe_s)]
    daemons = [daemon.start() for daemon in namespaced_daemons(mesh, root, profile, args)]
    for daemon in daemons:
        daemon.wait_for(committed_over(len(daemons)), 120, "a committed plan over all nodes")
    return daemons


def commits_in(daemon: DaemonProcess) -> list[str]:
    return COMMITTED.findall(daemon.log_path.read_text(errors="replace"))


def disturbance_round(kind: str, root: Path, token: str, profile: Path, model: Path) -> dict:
    with Mesh(3) as mesh:
        daemons = start(mesh, root / kind, token, profile, model, 30)
        try:
            order = stage_order(daemons)
            reference = story(order[0])
            for _ in range(10):  # an older tree may still be switching plans right after start
                if "error" not in reference:
                    break
                time.sleep(3)
                order = stage_order(daemons)
                reference = story(order[0])
            victim = order[1]
            sig = signal.SIGKILL if kind == "kill" else signal.SIGTERM

            disturbed_wall: list[float] = []

            def disturb() -> None:
                disturbed_wall.append(time.time())
                if sig == signal.SIGKILL:
                    victim.kill()
                else:
                    assert victim.proc is not None
                    victim.proc.send_signal(sig)

            disturbed = story(order[0], disturb)
            disturbed["same_text"] = disturbed.pop("text") == reference["text"]
            disturbed["reference_error"] = reference.get("error")
            disturbed["reference_tokens"] = reference.get("tokens")
            disturbed["disturbed"] = "disturbed_after_pieces" in disturbed
            if sig == signal.SIGTERM and victim.proc is not None and disturbed["disturbed"]:
                disturbed["exit_code"] = victim.proc.wait(30)
            if disturbed_wall:
                disturbed["timeline"] = timeline(daemons, disturbed_wall[0])
                disturbed["victim_host"] = daemons.index(victim)
                disturbed["origin_host"] = daemons.index(order[0])
                print(
                    f"{kind}: host{daemons.index(victim)} disturbed, origin host"
                    f"{daemons.index(order[0])}; load average {os.getloadavg()}"
                )
                print_timeline(disturbed["timeline"], disturbed.get("next_piece_s"))
            return disturbed
        finally:
            for daemon in daemons:
                daemon.kill()


def short_request(daemon: DaemonProcess) -> str:
    """A 4-token request; why it failed, or "" when it ended with its final event."""
    request = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=4))
    try:
        events = list(client.stream_generation(daemon.api, request, 60))
    except client.GenerationFailed as error:
        return str(error)[:200]
    if events and events[-1].HasField("done"):
        return ""
    return "the stream ended without a final event"


def churn_round(
    seconds: float, nodes: int, root: Path, token: str, profile: Path, model: Path
) -> dict:
    """``nodes`` daemons with 5 s link probes, a core kept busy by a child process (a loaded
    host's probes vary most) and a steady stream of short requests, round robin over the
    nodes, for ``seconds``: the plans committed after the first, and the failed requests."""
    with Mesh(nodes) as mesh:
        daemons = start(mesh, root / "static", token, profile, model, 5)
        try:
            before = [len(commits_in(d)) for d in daemons]
            answered, failures = 0, []
            with busy_core(seconds):
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    failure = short_request(daemons[answered % nodes])
                    if failure:
                        failures.append(failure)
                    answered += 1
                    time.sleep(2.0)
            after = [commits_in(d) for d in daemons]
            extra = [len(a) - b for a, b in zip(after, before, strict=True)]
            return {
                "seconds": seconds,
                "nodes": nodes,
                "commits_after_first_plan": extra,
                "per_10_min": [round(e * 600 / seconds, 1) for e in extra],
                "plan_ids": sorted({p for a in after for p in a}),
                "requests": answered,
                "failed_requests": len(failures),
                "failures": failures[:5],
            }
        finally:
            for daemon in daemons:
                daemon.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--static-s", type=float, default=300.0)
    parser.add_argument("--static-nodes", type=int, default=4)
    parser.add_argument("--skip", nargs="*", default=[], choices=["kill", "term", "churn"])
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    require_root_and_netns()
    cleanup_stale()
    root = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    token = security.encode_join_token(security.create_mesh_secret("bench-resume"))
    load_or_measure_profile(root / "profile", memory_budget_override=None)
    profile = root / "profile" / "profile.json"
    model = ModelStore(root / "store").ensure_default().path
    results: dict = {"label": args.label, "pythonpath": os.environ.get("PYTHONPATH", "")}
    try:
        if "kill" not in args.skip:
            results["kill9_middle_stage"] = disturbance_round("kill", root, token, profile, model)
            print("kill -9:", results["kill9_middle_stage"], flush=True)
        if "term" not in args.skip:
            results["sigterm_middle_stage"] = disturbance_round("term", root, token, profile, model)
            print("SIGTERM:", results["sigterm_middle_stage"], flush=True)
        if "churn" not in args.skip:
            results["static_mesh"] = churn_round(
                args.static_s, args.static_nodes, root, token, profile, model
            )
            print("static mesh, 5 s probes:", results["static_mesh"], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
