"""Generate the Python wire modules from `proto/meshd.proto`.

The generated modules are committed (so installing meshd needs no protoc), and
`tests/test_wire.py` regenerates them into a temporary folder and fails when the
committed copies are stale. Run `python -m meshd.wire.gen` after editing the proto.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
WIRE_DIR = Path(__file__).resolve().parent
PROTOS = tuple(sorted(p.name for p in PROTO_DIR.glob("*.proto")))
GENERATED = tuple(
    f"{Path(proto).stem}{suffix}"
    for proto in PROTOS
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) on every proto/*.proto into `out_dir`."""
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
        *(str(PROTO_DIR / proto) for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTOS)} in {PROTO_DIR}")
    # protoc emits absolute imports between generated modules; they live in a package.
    for module in out_dir.glob("*_pb2*.py"):
        text = module.read_text()
        for proto in PROTOS:
            stem = Path(proto).stem
            alias = stem.replace("_", "__") + "__pb2"
            text = text.replace(
                f"import {stem}_pb2 as {alias}", f"from . import {stem}_pb2 as {alias}"
            )
        module.write_text(text)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in GENERATED:
            shutil.copyfile(Path(tmp) / name, WIRE_DIR / name)
    print(f"regenerated {', '.join(GENERATED)} in {WIRE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
