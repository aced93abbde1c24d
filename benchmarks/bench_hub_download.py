"""How a mesh downloads a Hugging Face repository: once per mesh, spread over its nodes.

Three daemons in network namespaces on 1 Gbit/s links (tbf) and a Hub-compatible server
(olah, offline, serving a random multi-file llama from a local git+LFS repository) behind a
slower "internet" link (tbf, 200 Mbit/s by default), in a namespace of its own on the same
bridge. Measured:

* bytes the server sent (its interface's tx counter: HTTP and TCP overhead included) once
  the plan is made, against the model's size: the goal is 1.0x. What the selecting node read
  to plan (config, tokenizer, each weight file's header by range request) is counted apart:
  olah answers a range request with the whole file (200), so here it costs a model's worth,
  where the Hub answers 206 with the header's bytes;
* wall time from `meshd load ORG/NAME` until every node serves its stage, against one node
  alone downloading the whole repository on the same links;
* bytes each node stores (its HF cache's blobs) against its share (its stage's files).

Run (root, Linux): ``.venv/bin/python benchmarks/bench_hub_download.py --size-mb 400``.

Measured on a 2-core x86_64 VM, 427 MB in 19 files, 1 Gbit/s links, 200 Mbit/s to the server:
the server sent 1.006x the model's bytes once the plan was made (each node downloading its own
stage's files would have been 1.145x; one node alone 1.018x); each node stored its share
(155, 168, 166 MB, plus 28 KB of config and tokenizer); the downloads took 22.8 s on the mesh
and 23.9 s for one node alone (both bound by the 200 Mbit/s link: 17 s at least), 60.0 s and
53.8 s from `meshd load` with planning (olah's whole-file answers to the header reads: 434 MB
before the plan, and three daemons sharing two cores).
Nothing leaves the namespaces; everything it writes is under one temporary folder, deleted
at the end (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from meshd.models import hub as h
from meshd.wire import pb
from tests.netns import Mesh, cleanup_stale, require_root_and_netns
from tests.support.local_hub import LocalHub, make_repo
from tests.support.random_model import make_random_model_dir

REPO = "bench-org/random-llama"
HUB_PORT = 8090
LAYER_MB = 46.6  # hidden 1024, intermediate 2816, 8 heads (4 kv), float32
MIN_SHARD_BYTES = 8 * 1024 * 1024
FILES_WANTED = 16  # weight files: stages share few of them, as in real multi-file repositories


def make_model(path: Path, size_mb: float) -> Path:
    layers = max(3, round(size_mb / LAYER_MB))
    return make_random_model_dir(
        path,
        "llama",
        layers=layers,
        hidden=1024,
        heads=8,
        kv_heads=4,
        intermediate=2816,
        max_shard_bytes=max(MIN_SHARD_BYTES, int(size_mb * 1e6 / FILES_WANTED)),
    )


def tx_bytes(mesh: Mesh, index: int) -> int:
    node = mesh.nodes[index]
    result = node.run(
        ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], capture_output=True, text=True
    )
    return int(result.stdout.strip())


def serving(status: pb.MeshStatus, members: int) -> bool:
    return (
        status.agreement.model == REPO
        and bool(status.agreement.active_plan_id)
        and len(status.agreement.members) == members
        and status.transitions.active_plan_loaded
        and not status.downloads
    )


def start_daemons(mesh: Mesh, root: Path, hub: LocalHub, profile: Path, count: int, tag: str):
    token = security.encode_join_token(security.create_mesh_secret(f"bench-{tag}"))
    daemons = []
    for i in range(count):
        state = root / f"{tag}{i}"
        state.mkdir(parents=True)
        shutil.copyfile(profile, state / "profile.json")
        env = {
            "MESHD_MODEL_STORE": str(state / "store"),
            "HF_HUB_CACHE": str(state / "hf"),
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "",
        }
        args = ["--interface", "eth0", "--join", token, "--name", f"{tag}{i}"]
        args += ["--strategy", "memory", "--context-length", "256"]
        daemons.append(DaemonProcess(state, args, netns=mesh.nodes[i].ns, env=env).start())
    return daemons


def load_and_time(daemons: list[DaemonProcess], mesh: Mesh, timeout_s: float) -> dict:
    for daemon in daemons:
        daemon.wait_for(lambda s: len(s.nodes) >= len(daemons), 60, "every node")
    sent_before = tx_bytes(mesh, 3)
    started = time.monotonic()
    client.load_model(daemons[0].api, pb.LoadModelRequest(model=REPO), timeout_s=600)
    planned_s = time.monotonic() - started
    sent_planning = tx_bytes(mesh, 3) - sent_before
    peak_lines: list[str] = []
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        statuses = [daemon.status() for daemon in daemons]
        if statuses[0].downloads:
            peak_lines = [
                f"{d.node} {d.file} {d.done_bytes}/{d.total_bytes} {d.source}"
                for d in statuses[0].downloads
            ]
        if all(serving(status, len(daemons)) for status in statuses):
            break
        time.sleep(0.25)
    else:
        raise TimeoutError("the mesh did not serve in time:\n" + daemons[0].log_tail(30))
    wall = time.monotonic() - started
    return {
        "wall_s": round(wall, 1),
        "planning_s": round(planned_s, 1),
        "server_bytes": tx_bytes(mesh, 3) - sent_before,
        "server_bytes_planning": sent_planning,
        "server_bytes_downloads": tx_bytes(mesh, 3) - sent_before - sent_planning,
        "plan": json.loads(daemons[0].status().agreement.plan_json),
        "sample_downloads": peak_lines[:6],
    }


def stored(daemon: DaemonProcess) -> int:
    blobs = daemon.state_dir / "hf" / f"models--{REPO.replace('/', '--')}" / "blobs"
    return sum(item.stat().st_size for item in blobs.iterdir() if item.name.count(".") == 0)


def shares(model: Path, plan: dict, node_of: dict[str, int]) -> dict[int, int]:
    index = json.loads((model / h.INDEX_FILE).read_text())["weight_map"]
    layers = max(stage["layer_end"] for stage in plan["stages"])
    out = {}
    for stage in plan["stages"]:
        files = h.files_for_stage(
            index,
            [],
            stage["layer_start"],
            stage["layer_end"],
            has_embedding=stage["layer_start"] == 0,
            has_head=stage["layer_end"] == layers,
            tied=True,
        )
        for node in stage["nodes"]:
            out[node_of[node]] = sum((model / name).stat().st_size for name in files)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=150.0, help="model size (default 150)")
    parser.add_argument("--link", default="1gbit", help="each node's link (tbf rate)")
    parser.add_argument("--internet", default="200mbit", help="the server's link (tbf rate)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    require_root_and_netns()
    cleanup_stale()
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-hub-"))
    try:
        model = make_model(root / "model", args.size_mb)
        weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        make_repo(root / "mirrors", REPO, model)
        profile = root / "profile" / "profile.json"
        load_or_measure_profile(profile.parent, memory_budget_override=None)
        report: dict = {"model_bytes": weights, "files": len(list(model.glob("*.safetensors")))}
        with Mesh(4) as mesh:
            for i in range(3):
                mesh.limit_rate(i, args.link)
            mesh.limit_rate(3, args.internet)
            prefix = ["ip", "netns", "exec", mesh.nodes[3].ns]
            with LocalHub(
                root / "mirrors", root / "olah", mesh.nodes[3].ip, HUB_PORT, prefix
            ) as hub:
                daemons = start_daemons(mesh, root, hub, profile, 3, "mesh")
                try:
                    result = load_and_time(daemons, mesh, args.timeout)
                    ids = {daemon.status().node_id: i for i, daemon in enumerate(daemons)}
                    share = shares(model, result.pop("plan"), ids)
                    result["stored_bytes"] = {i: stored(d) for i, d in enumerate(daemons)}
                    result["share_bytes"] = share
                finally:
                    for daemon in daemons:
                        daemon.kill()
                for i in range(3):
                    shutil.rmtree(root / f"mesh{i}", ignore_errors=True)
                report["mesh"] = result
                alone = start_daemons(mesh, root, hub, profile, 1, "alone")
                try:
                    solo = load_and_time(alone, mesh, args.timeout)
                    solo.pop("plan")
                    solo["stored_bytes"] = stored(alone[0])
                finally:
                    alone[0].kill()
                report["alone"] = solo
        mesh_result = report["mesh"]
        downloads = mesh_result["server_bytes_downloads"]
        report["downloads_over_model"] = round(downloads / weights, 3)
        report["alone_downloads_over_model"] = round(solo["server_bytes_downloads"] / weights, 3)
        # What each node downloading its own stage's files would have fetched.
        report["own_files_each_over_model"] = round(sum(share.values()) / weights, 3)
        report["speedup_vs_alone"] = round(solo["wall_s"] / mesh_result["wall_s"], 2)
        print(json.dumps(report, indent=2))
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
