"""`meshd demo`: a small mesh of local daemons on loopback that answers a question together.

It starts N daemons, lets them discover each other and agree on a plan that splits the
embedded default model (SmolLM2-135M-Instruct, imported once into the user's cache)
across all of them, streams an answer to a question from one node, prints the plan and
the speed, and shuts everything down.

Everything stays on 127.0.0.1: the daemons announce and browse mDNS only on the
loopback interface and listen for peers on it, so the demo never touches the
machine's real network. The daemons share one join token, exactly as `meshd token` /
`meshd join` would hand it around.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshd.api import client, render
from meshd.api.launcher import DaemonProcess, fully_meshed
from meshd.config import load_config
from meshd.mesh import security
from meshd.mesh.profiling import PROFILE_SEED_ENV, seed_profile
from meshd.models.store import ModelStore, console_progress
from meshd.wire import pb

LOOPBACK = "127.0.0.1"


QUESTION = "What is the capital of France?"


def loopback_args(token: str, name: str, model: Path | None) -> list[str]:
    args = ["--name", name, "--interface", LOOPBACK, "--peer-host", LOOPBACK]
    args += ["--peer-port", "0", "--join", token, "--log-level", "WARNING"]
    if model is not None:
        # The memory strategy splits the layers over every node (the speed strategy would
        # rightly keep a 135M model on one node: on one machine a hop only costs time).
        args += ["--model", str(model), "--strategy", "memory"]
    return args


def start_local_mesh(
    root: Path,
    nodes: int,
    model: Path | None = None,
    mesh_name: str = "demo",
    profile_seed: Path | None = None,
) -> list[DaemonProcess]:
    """N daemons on loopback; with ``profile_seed`` (a measured profile.json) they all start
    from that one measurement of this machine instead of measuring it at once N times."""
    token = security.encode_join_token(security.create_mesh_secret(mesh_name))
    env = {PROFILE_SEED_ENV: str(profile_seed)} if profile_seed else None
    daemons = [
        DaemonProcess(root / f"node{i}", loopback_args(token, f"demo-{i}", model), env=env)
        for i in range(nodes)
    ]
    for daemon in daemons:
        daemon.start()
    return daemons


def default_model_dir() -> Path:
    """Import the embedded default once into the user's model store (the one the user's
    daemons share) and return its directory."""
    store = ModelStore(load_config().model_store)
    return store.ensure_default(progress=console_progress()).path


def plan_committed(nodes: int):
    def check(status: pb.MeshStatus) -> bool:
        agreement = status.agreement
        return bool(agreement.active_plan_id) and len(agreement.members) == nodes

    return check


def ask(daemon: DaemonProcess, question: str) -> pb.GenerationDone | None:
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content=question)],
        sampling=pb.Sampling(max_tokens=64),
    )
    done = None
    print(f"\nQ: {question}\nA: ", end="", flush=True)
    for event in client.stream_generation(daemon.api, request, timeout_s=300):
        if event.HasField("done"):
            done = event.done
        else:
            print(event.text, end="", flush=True)
    print()
    return done


def run_demo(nodes: int = 3, keep_state: Path | None = None, timeout_s: float = 60.0) -> int:
    if nodes < 1:
        print("meshd demo: --nodes must be at least 1", file=sys.stderr)
        return 2
    root = keep_state or Path(tempfile.mkdtemp(prefix="meshd-demo-"))
    print("preparing the embedded default model (SmolLM2-135M-Instruct) ...", flush=True)
    model = default_model_dir()
    print("measuring this machine once for every node ...", flush=True)
    seed = seed_profile(root / "machine")
    print(f"starting {nodes} daemons on loopback (state in {root}) ...", flush=True)
    started = time.monotonic()
    daemons = start_local_mesh(root, nodes, model, profile_seed=seed)
    try:
        for daemon in daemons:
            daemon.wait_ready(timeout_s)
        daemons[0].wait_for(
            lambda s: fully_meshed(s, nodes), timeout_s, f"all {nodes} nodes and links measured"
        )
        print(f"mesh formed in {time.monotonic() - started:.1f} s", flush=True)
        # Every node, not only the first: each commits a moment after the other.
        for daemon in reversed(daemons):
            status = daemon.wait_for(plan_committed(nodes), timeout_s, "a committed plan")
        print(f"plan committed {time.monotonic() - started:.1f} s after start\n", flush=True)
        print(render.status_text(status), flush=True)
        asker = daemons[-1]
        done = ask(asker, QUESTION)
        if done is not None:
            print(
                f"\n{done.completion_tokens} tokens from node {asker.status().node_id}: first "
                f"token after {done.ttft_s * 1e3:.0f} ms, {done.decode_tokens_per_s:.1f} "
                f"tokens/s over {nodes} stage(s) of plan {done.plan_id[:12]}"
            )
        return 0
    except client.GenerationFailed as exc:
        print(f"meshd demo: the mesh could not answer: {exc}", file=sys.stderr)
        return 1
    except (TimeoutError, RuntimeError) as exc:
        print(f"meshd demo: {exc}", file=sys.stderr)
        return 1
    finally:
        print("\nshutting the daemons down ...", flush=True)
        for daemon in daemons:
            daemon.terminate()
        if keep_state is None:
            shutil.rmtree(root, ignore_errors=True)
