"""Shared fixtures: daemon processes with pre-measured profiles, cleaned up on failure too."""

from __future__ import annotations

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before any test module imports mlx.core: float32 matmuls on OpenBLAS

# isort: split
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelEntry, ModelStore
from meshd.runtime.scratch import remove_orphaned_scratch

pytest_plugins = ["tests.netns"]  # the netns_mesh fixture

PROFILE_FILE = "profile.json"

# Tests simulate small machines with budgets (90-150 MB) below what a daemon's process holds
# beside a model: their daemons plan the whole budget for the model, as the planner's tests
# expect. Tests of the process overhead itself give their daemons MESHD_PROCESS_OVERHEAD="".
os.environ.setdefault("MESHD_PROCESS_OVERHEAD", "0")
# Many meshes share this machine's few cores at once, so a node's decode steps say more about
# its neighbours than about itself: a speed correction from them would re-plan a test's mesh
# at a moment the test does not choose. Tests of the correction pass --speed-correction.
os.environ.setdefault("MESHD_SPEED_CORRECTION", "0")


@pytest.fixture(scope="session", autouse=True)
def no_orphaned_scratch() -> Iterator[None]:
    """After the session, remove the stage-load scratch directories of daemons the tests
    killed mid-load (kill -9 leaves them, by design; a daemon sweeps them when it starts, but
    no daemon starts after the last test). A live process's directory is never touched."""
    yield
    remove_orphaned_scratch()


@pytest.fixture(scope="session")
def profile_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Measure this machine once per test session; daemons start from the cached profile.

    The suite keeps the machine busy, so the measurement is usually marked loaded; it is
    stored as quiet, or every daemon would measure again in the background mid-test (and
    re-plan when a quieter measurement lands)."""
    from meshd.mesh.profiling import load_or_measure_profile

    state = tmp_path_factory.mktemp("profile-template")
    load_or_measure_profile(state, memory_budget_override=None)
    document = json.loads((state / PROFILE_FILE).read_text())
    document["profile"]["loaded"] = False
    (state / PROFILE_FILE).write_text(json.dumps(document))
    return state / PROFILE_FILE


@pytest.fixture(scope="session", autouse=True)
def daemons_start_from_one_profile(profile_template: Path) -> Iterator[None]:
    """Every daemon a test starts without a profile of its own starts from the session's
    (MESHD_PROFILE_SEED), as `meshd demo`'s nodes do: the suite's few cores are not spent
    measuring one machine again for each of its daemons. Tests of the measurement itself
    measure in their own state directories."""
    from meshd.mesh.profiling import PROFILE_SEED_ENV

    os.environ[PROFILE_SEED_ENV] = str(profile_template)
    yield
    os.environ.pop(PROFILE_SEED_ENV, None)


@pytest.fixture(scope="session")
def default_model_entry(model_store: Path) -> ModelEntry:
    """The embedded default model (SmolLM2-135M), imported once per session into the daemons'
    shared store: the GGUF import takes 5-10 s, too long to repeat in every module that needs
    the real model (test_model_store tests the import itself, in stores of its own)."""
    return ModelStore(model_store).ensure_default()


DaemonFactory = Callable[..., DaemonProcess]


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test daemons' model store (never the user's own, see Config.model_store)."""
    return tmp_path_factory.mktemp("model-store")


@pytest.fixture
def daemons(tmp_path: Path, profile_template: Path, model_store: Path) -> Iterator[DaemonFactory]:
    """Factory for daemon processes; every daemon it made is stopped at teardown. They share
    one model store, as a user's daemons do."""
    made: list[DaemonProcess] = []
    counter = iter(range(1000))

    def make(
        args: list[str] | None = None,
        *,
        netns: str | None = None,
        state_dir: Path | None = None,
        start: bool = True,
    ) -> DaemonProcess:
        state = state_dir or tmp_path / f"d{next(counter)}"
        state.mkdir(parents=True, exist_ok=True)
        if not (state / PROFILE_FILE).exists():
            shutil.copyfile(profile_template, state / PROFILE_FILE)
        env = {"MESHD_MODEL_STORE": str(model_store)}
        daemon = DaemonProcess(state, args or [], netns=netns, env=env)
        made.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in made:
        daemon.kill()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight llama of 94 MB: three 120 MB budgets are needed to hold it."""
    from tests.support.random_model import make_three_host_llama

    return make_three_host_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def architecture_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(name)``: the tiny random model ``TINY_CONFIGS[name]``, written once per session.

    Several safetensors files each, so that stages open only the files of their layers.
    """
    from tests.support.random_model import make_architecture_dir

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp("arch") / name
            made[name] = make_architecture_dir(folder, name, seed=7, max_shard_bytes=200_000)
        return made[name]

    return get


@pytest.fixture
def mesh_name() -> str:
    """A mesh name of this test alone. The suite runs in two processes (pytest-xdist), whose
    loopback daemons share 127.0.0.1's mDNS: with one name for all, a test's daemons would
    meet another test's mesh (and name it a stranger) instead of only their own."""
    return f"test-{secrets.token_hex(4)}"


@pytest.fixture
def mesh_token(mesh_name: str) -> str:
    return security.encode_join_token(security.create_mesh_secret(mesh_name))


# ---------------------------------------------------------------- kinds of test

TEST_KINDS = ("unit", "integration", "netns")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test module says what kind it is, once (`pytestmark = pytest.mark.unit`, ...), so
    `pytest -m unit` runs the pure cores in seconds and `-m "not netns"` runs without root."""
    unclear = sorted(
        {
            item.nodeid.split("::")[0]
            for item in items
            if sum(item.get_closest_marker(kind) is not None for kind in TEST_KINDS) != 1
        }
    )
    if unclear:
        raise pytest.UsageError(
            "each test module needs exactly one of the markers "
            f"{', '.join(TEST_KINDS)} (pytestmark = pytest.mark.unit): {', '.join(unclear)}"
        )
