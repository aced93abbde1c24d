"""Hop tracing: marks written off the hot path, and hops paired across processes.

The product's own trace is checked end to end on real daemons in
tests/test_inference_e2e.py::test_a_hop_trace_shows_where_each_hop_goes; here the reading side
is pinned down on a trace whose every time is known.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from meshd.runtime import hoptrace

pytestmark = pytest.mark.unit

MS = 1_000_000


def _write(directory: Path, process: str, rows: list[tuple[str, int]]) -> None:
    lines = "".join(f"{name} {when}\n" for name, when in rows)
    (directory / f"hops-{process}.txt").write_text(lines)


def test_hops_are_paired_across_processes_and_cut_into_segments(tmp_path: Path) -> None:
    # a: computes, sends over a lane; b: reads, computes, answers over gRPC (no lane marks).
    _write(tmp_path, "a", [
        ("step_done", 10 * MS), ("result_on_loop", 10 * MS + 100_000),
        ("frame_send", 10 * MS + 150_000), ("frame_sent", 10 * MS + 300_000),
        ("step_start", 31 * MS),  # b's answer arrived without lane marks
        ("step_done", 60 * MS),  # nobody computes within the window after this one
    ])  # fmt: skip
    _write(tmp_path, "b", [
        ("lane_readable", 10 * MS + 380_000), ("frame_parsed", 10 * MS + 500_000),
        ("step_submitted", 10 * MS + 700_000), ("step_start", 10 * MS + 800_000),
        ("step_done", 30 * MS), ("step_start", 200 * MS),
    ])  # fmt: skip
    # c (an origin that holds no stage) reads a frame meanwhile: not part of a's hop to b;
    # its unreadable line is skipped
    (tmp_path / "hops-c.txt").write_text(f"garbage\nlane_readable {10 * MS + 350_000}\n")

    hops = hoptrace.pair_hops(hoptrace.read_marks(tmp_path))

    assert [(hop.sender, hop.receiver, hop.total_ns) for hop in hops] == [
        ("hops-a", "hops-b", 800_000),
        ("hops-b", "hops-a", 1 * MS),
    ]
    assert hops[0].segments == (100_000, 50_000, 150_000, 80_000, 120_000, 200_000, 100_000)
    assert sum(hops[0].segments) == hops[0].total_ns
    assert hops[1].segments is None  # no lane marks on b's way back
    table = hoptrace.summary(hops)
    assert hops[0].path == "sent by the loop"
    assert "hops-a -> hops-b: 1 hops, median 0.800 ms (1 over a lane, 1 cut)" in table
    rows = [line.split() for line in table.splitlines()]
    assert ["S:frame_send", "->", "S:frame_sent", "0.150", "ms"] in rows
    assert "hops-b -> hops-a: 1 hops, median 1.000 ms (0 over a lane, 0 cut)" in table


def test_a_hop_sent_by_the_compute_thread_is_cut_without_the_senders_loop(
    tmp_path: Path,
) -> None:
    # a's compute thread sends the frame itself; its loop takes the result after it left
    _write(tmp_path, "a", [("step_done", 0), ("frame_send", 20_000), ("frame_sent", 150_000),
                           ("result_on_loop", 400_000)])  # fmt: skip
    _write(tmp_path, "b", [("lane_readable", 200_000), ("frame_parsed", 300_000),
                           ("step_submitted", 450_000), ("step_start", 480_000)])  # fmt: skip
    (hop,) = hoptrace.pair_hops(hoptrace.read_marks(tmp_path))
    assert hop.path == "sent by the compute thread"
    assert hop.segments == (20_000, 130_000, 50_000, 100_000, 150_000, 30_000)
    table = hoptrace.summary([hop])
    assert "1 sent by the compute thread, median 0.480 ms:" in table
    assert "result_on_loop" not in table


def test_marks_out_of_order_give_no_segments_but_the_path(tmp_path: Path) -> None:
    _write(tmp_path, "a", [("step_done", 0), ("result_on_loop", 100), ("frame_send", 300),
                           ("frame_sent", 500)])  # fmt: skip
    _write(tmp_path, "b", [("frame_parsed", 600), ("lane_readable", 700),
                           ("step_submitted", 800), ("step_start", 900)])  # fmt: skip
    (hop,) = hoptrace.pair_hops(hoptrace.read_marks(tmp_path))
    assert hop.total_ns == 900 and hop.segments is None
    assert hop.path == "sent by the loop"  # a's own marks say so, whatever b's order


def test_a_sender_that_marks_its_write_late_is_still_known_by_its_thread(tmp_path: Path) -> None:
    # a's compute thread lost its core between the write and the frame_sent mark: b read and
    # started before it, as on a busy host. The hop is not cut, its path is still known.
    _write(tmp_path, "a", [("step_done", 0), ("frame_send", 20_000), ("frame_sent", 700_000),
                           ("result_on_loop", 800_000)])  # fmt: skip
    _write(tmp_path, "b", [("lane_readable", 200_000), ("frame_parsed", 300_000),
                           ("step_submitted", 450_000), ("step_start", 480_000)])  # fmt: skip
    (hop,) = hoptrace.pair_hops(hoptrace.read_marks(tmp_path))
    assert (hop.path, hop.segments, hop.total_ns) == ("sent by the compute thread", None, 480_000)
    assert "(1 over a lane, 0 cut)" in hoptrace.summary([hop])


def test_a_lane_frame_to_a_third_process_is_not_the_hops(tmp_path: Path) -> None:
    # a, a last stage, sends its token to b (the first stage) over gRPC and to c (the origin)
    # over a lane: the hop a -> b has a's lane marks in it, and no lane marks of b's.
    _write(tmp_path, "a", [("step_done", 0), ("result_on_loop", 100_000),
                           ("frame_send", 150_000), ("frame_sent", 300_000)])  # fmt: skip
    _write(tmp_path, "b", [("step_submitted", 900_000), ("step_start", 1 * MS)])
    _write(tmp_path, "c", [("lane_readable", 400_000), ("frame_parsed", 500_000)])
    (hop,) = hoptrace.pair_hops(hoptrace.read_marks(tmp_path))
    assert (hop.sender, hop.receiver, hop.path, hop.segments) == ("hops-a", "hops-b", None, None)


def test_marks_are_read_from_a_moment_on(tmp_path: Path) -> None:
    _write(tmp_path, "a", [("step_done", 0), ("frame_send", 20_000), ("step_done", 5 * MS)])
    _write(tmp_path, "b", [("step_start", 480_000), ("step_start", 5 * MS + 300_000)])
    assert len(hoptrace.pair_hops(hoptrace.read_marks(tmp_path))) == 2
    (hop,) = hoptrace.pair_hops(hoptrace.read_marks(tmp_path, since_ns=1 * MS))
    assert (hop.total_ns, hop.path) == (300_000, None)


def test_tracing_writes_marks_from_any_thread_and_stops(tmp_path: Path) -> None:
    assert not hoptrace.enabled
    path = hoptrace.start(tmp_path / "trace")
    try:
        with pytest.raises(RuntimeError, match="already on"):
            hoptrace.start(tmp_path / "again")
        assert hoptrace.enabled
        worker = threading.Thread(target=lambda: [hoptrace.mark("step_start") for _ in range(500)])
        worker.start()
        for _ in range(500):
            hoptrace.mark("frame_send")
        worker.join()
        deadline = time.monotonic() + 5
        while (not path.exists() or not path.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the flusher writes once a second
        assert path.read_text()  # written while tracing, not only at stop
    finally:
        hoptrace.stop()
    assert not hoptrace.enabled
    names = [line.split()[0] for line in path.read_text().splitlines()]
    assert sorted(set(names)) == ["frame_send", "step_start"] and len(names) == 1000
    hoptrace.stop()  # twice is fine


def test_a_directory_that_cannot_be_written_leaves_tracing_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(hoptrace.ENV, str(blocked / "hops"))
    assert hoptrace.start_from_env() is False
    assert not hoptrace.enabled
    assert any("hop tracing stays off" in record.getMessage() for record in caplog.records)
    monkeypatch.setenv(hoptrace.ENV, "  ")
    assert hoptrace.start_from_env() is False
