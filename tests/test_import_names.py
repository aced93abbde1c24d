"""meshd lives beside PyPI's python-daemon: the folder `daemon/` is imported as `meshd`.

python-daemon (import name `daemon`) is installed by the dev extra, so this checks the real
thing with nothing installed at test time: in a fresh interpreter whose working directory is
not the repository (so the repository's own `daemon/` folder is not on sys.path, as for any
installed user), `import daemon` is python-daemon, `import meshd` is this project, both in
either order, and the `meshd` command runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import sys
first, second = sys.argv[1:]
__import__(first)
__import__(second)
import daemon, meshd
assert hasattr(daemon, "DaemonContext"), f"`daemon` is not python-daemon: {daemon.__file__}"
assert "site-packages" in daemon.__file__, daemon.__file__
assert "site-packages" not in meshd.__file__, meshd.__file__
import meshd.node, meshd.api.cli  # the whole daemon imports with python-daemon present
print(daemon.__file__, meshd.__file__)
"""


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_python_daemon_and_meshd_import_side_by_side(tmp_path: Path) -> None:
    for order in (("daemon", "meshd"), ("meshd", "daemon")):
        done = run(sys.executable, "-c", CHECK, *order, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        python_daemon, ours = done.stdout.split()
        assert Path(ours) == ROOT / "daemon" / "__init__.py"
        assert Path(python_daemon).parent.name == "daemon" != Path(ours).parents[1].name


def test_the_meshd_command_runs_beside_python_daemon(tmp_path: Path) -> None:
    meshd = Path(sys.executable).parent / "meshd"
    done = run(str(meshd), "--help", cwd=tmp_path)
    assert done.returncode == 0 and "run the daemon in the foreground" in done.stdout, done.stderr
