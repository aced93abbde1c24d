"""The Node.js client of the local API in docs/clients.md, run against a real daemon: a
client in another language written from proto/meshd.proto alone (keepCase, uint64 seeds as
strings).

Node.js comes from `packaging/install.sh --dev` (Debian's nodejs), its two npm packages
(examples/node-client/package.json, pinned in package-lock.json) from the npm registry: the
installer puts them in examples/node-client/node_modules, and this test does when they are
missing. Without Node.js the test is skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from meshd.api import client
from meshd.wire import pb

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "node-client"
LOOPBACK = ["--no-mdns", "--peer-host", "127.0.0.1", "--peer-port", "0"]


@pytest.fixture(scope="module")
def node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed (bash packaging/install.sh --dev installs it)")
    if not (EXAMPLE / "node_modules" / "@grpc" / "proto-loader").is_dir():
        npm = shutil.which("npm")
        assert npm, "npm is missing: run bash packaging/install.sh --dev"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE, check=True, timeout=300)
    return node


def test_the_clients_guide_shows_the_example_that_runs() -> None:
    assert (EXAMPLE / "client.js").read_text() in (ROOT / "docs" / "clients.md").read_text()


def test_the_node_client_streams_text_and_reads_the_seed_exactly(
    node, daemons, mesh_token, architecture_dir
) -> None:
    model = architecture_dir("mistral")
    daemon = daemons([*LOOPBACK, "--join", mesh_token, "--model", str(model)])
    daemon.wait_for(lambda s: bool(s.agreement.active_plan_id), 60, "a committed plan")

    def run_node(prompt: str) -> subprocess.CompletedProcess[str]:
        command = [node, str(EXAMPLE / "client.js"), daemon.api, prompt]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)

    done = run_node("hello mesh")
    assert done.returncode == 0, done.stderr
    text, _, summary = done.stdout.rpartition("\n[")
    reason, _, seed = summary.strip().removesuffix("]").partition(", seed ")
    assert reason in ("length", "eos") and seed.isdigit(), done.stdout
    # The same seed through the Python client gives the same text: Node read the uint64
    # exactly (a JavaScript number would have rounded a seed above 2^53).
    sampling = pb.Sampling(temperature=0.7, max_tokens=24, seed=int(seed))
    request = pb.GenerateRequest(prompt="hello mesh", sampling=sampling)
    events = list(client.stream_generation(daemon.api, request, timeout_s=60))
    assert "".join(e.text for e in events) == text
    assert events[-1].done.seed == int(seed)

    refused = run_node("   ")
    assert refused.returncode == 1
    assert refused.stderr.startswith("INVALID_ARGUMENT: the prompt is empty"), refused.stderr
