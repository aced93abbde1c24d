"""Thread names the OS sees: set for the calling thread only, cut to the kernel's limit, and
given back after a temporary name."""

from __future__ import annotations

import sys
import threading

import pytest

from meshd.runtime.thread_names import (
    name_this_thread,
    named_while,
    os_thread_name,
    this_thread_name,
)

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not (sys.platform.startswith("linux") or sys.platform == "darwin"),
        reason="only Linux and macOS name threads for the OS",
    ),
]


def in_a_new_thread(job):
    """``job()``'s result, run on a fresh thread (so the test runner's own name is safe)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(job()))
    thread.start()
    thread.join(10)
    assert result, "the thread did not finish"
    return result[0]


def test_a_thread_names_itself_and_no_other() -> None:
    before = this_thread_name()

    def job() -> tuple[bool, str | None]:
        return name_this_thread("meshd-test"), this_thread_name()

    assert in_a_new_thread(job) == (True, "meshd-test")
    assert this_thread_name() == before


def test_a_long_name_is_cut_to_what_the_kernel_keeps() -> None:
    long = "meshd-a-name-far-longer-than-any-kernel-keeps-for-a-thread-of-its-own"
    kept = os_thread_name(long).decode()
    assert long.startswith(kept) and len(kept) == (15 if sys.platform.startswith("linux") else 63)
    assert in_a_new_thread(lambda: (name_this_thread(long), this_thread_name())) == (True, kept)


def test_named_while_names_the_threads_started_inside_and_gives_the_name_back() -> None:
    def job() -> tuple[str | None, str | None, str | None]:
        name_this_thread("meshd-outer")
        with named_while("meshd-inner"):
            inside = this_thread_name()
            started: list[str | None] = []
            child = threading.Thread(target=lambda: started.append(this_thread_name()))
            child.start()
            child.join(10)
        return (
            inside,
            started[0] if sys.platform.startswith("linux") else "meshd-inner",
            (this_thread_name()),
        )

    # Linux threads inherit their starter's name (OpenBLAS's workers, at load); macOS's do not.
    assert in_a_new_thread(job) == ("meshd-inner", "meshd-inner", "meshd-outer")
