"""Generate the Python wire modules from `proto/meshd.proto`.

The generated modules are committed (so installing meshd needs no protoc), and
`tests/test_wire.py` regenerates them into a temporary folder and fails when the
committed copies are stale. Run `python -m daemon.wire.gen` after editing the proto.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
WIRE_DIR = Path(__file__).resolve().parent
GENERATED = ("meshd_pb2.py", "meshd_pb2.pyi", "meshd_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) on proto/meshd.proto into `out_dir`."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "meshd.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / 'meshd.proto'}")
    grpc_module = out_dir / "meshd_pb2_grpc.py"
    # protoc emits an absolute import; the modules live in a package.
    text = grpc_module.read_text().replace(
        "import meshd_pb2 as meshd__pb2", "from . import meshd_pb2 as meshd__pb2"
    )
    grpc_module.write_text(text)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in GENERATED:
            shutil.copyfile(Path(tmp) / name, WIRE_DIR / name)
    print(f"regenerated {', '.join(GENERATED)} in {WIRE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
