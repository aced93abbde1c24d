"""A stand-in for a daemon that owns one rank of a tensor-parallel stage, in its own process.

``python -m tests.support.tp_member_process NODE_ID SPEC.json``: starts this node's runner with a
:class:`RunnerSupervisor`, prints ``{"runner_pid": PID}`` (or ``{"error": ...}``) as one JSON
line once the group is ready, and stops the runner when stdin closes. Tests ``kill -9`` it to
check that a member's runner dies with its daemon.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

import asyncio
import json
import sys
from pathlib import Path

from meshd.inference.tensor_parallel import RunnerSupervisor, TensorParallelSpec


async def _main(node_id: str, spec_path: Path) -> int:
    spec = TensorParallelSpec.from_json(spec_path.read_text())
    supervisor = RunnerSupervisor(node_id)
    try:
        member = await supervisor.start(spec)
    except Exception as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return 1
    print(json.dumps({"runner_pid": member.pid}), flush=True)
    try:
        await asyncio.to_thread(sys.stdin.read)
    finally:
        await supervisor.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1], Path(sys.argv[2]))))
