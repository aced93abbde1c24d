"""Where a hop's time goes, from the marks of daemons run with ``MESHD_HOP_TRACE=DIR``.

Any daemons of one machine (one clock) can be traced, ``meshd demo`` too::

    MESHD_HOP_TRACE=/tmp/hops .venv/bin/meshd demo
    .venv/bin/python benchmarks/hop_trace.py /tmp/hops

It prints, per direction (process to process), how many hops it paired, their median, how
many went over a lane (and which thread sent them) and how many of those were cut into
segments (all marks in order: a sender that lost its core between its write and its mark is
not), and the median of each segment over the cut ones (see :mod:`meshd.runtime.hoptrace`;
meaningful while one request runs at a time). ``bench_batching.py --scaling --hop-trace``
prints the same table for pinned daemons in network namespaces.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime import hoptrace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="the MESHD_HOP_TRACE directory")
    args = parser.parse_args()
    hops = hoptrace.pair_hops(hoptrace.read_marks(args.directory))
    if not hops:
        print(f"no hops in {args.directory}: were the daemons started with MESHD_HOP_TRACE?")
        return 1
    print(hoptrace.summary(hops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
