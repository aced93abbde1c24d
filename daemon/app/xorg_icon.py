"""pystray's xorg icon, safe to update from other threads.

pystray's xorg backend hands a setter called off its loop thread over to the loop: it sends
the loop's own window a client message through the loop's X connection and flushes it. That
connection is then used by two threads at once, and python-xlib's request/reply hand-over
between threads can lose a wake-up: the loop waits forever for a reply (an expose event's
get_geometry) while the setter waits forever for the loop. The tray then hangs at its first
redraw on a busy machine. This icon sends those messages through a second X connection that
only the other threads use, one call at a time and with a deadline, so the loop's connection
is only ever used by the loop.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import Xlib.display
import Xlib.X
from pystray import _xorg

HANDOVER_TIMEOUT_S = 10.0
LOOP_START_TIMEOUT_S = 10.0


class TrayLoopGone(RuntimeError):
    """The tray's loop did not run a handed-over update in time (it has ended or hangs)."""


class ThreadSafeXorgIcon(_xorg.Icon):
    """pystray's xorg Icon whose setters may be called from any thread."""

    def _rewrite_implementation(self, *methods: Callable[[], None]) -> None:
        """Route each of ``methods`` (show, hide, icon, title, stop) to the loop thread."""
        self._sender = Xlib.display.Display()  # the other threads' own connection
        self._sender_window = self._sender.create_resource_object("window", self._window.id)
        self._handover_lock = threading.Lock()
        self._serials = itertools.count(1)
        # (serial, the update's error or None), put by the loop
        self._results: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()
        handlers: dict[int, Callable[[], None]] = {}
        for method in methods:
            atom = self._display.intern_atom(f"_PYSTRAY_{method.__name__.upper()}")
            handlers[atom] = method
            setattr(self, method.__name__, types.MethodType(self._dispatcher(method, atom), self))

        def on_client_message(event: Any) -> None:
            method = handlers.get(event.client_type)
            if method is not None:
                self._run_for_another_thread(method, serial=event.data[1][1])

        self._message_handlers[Xlib.X.ClientMessage] = on_client_message

    def _dispatcher(self, method: Callable[[], None], atom: int) -> Callable[[Any], None]:
        def dispatch(icon: ThreadSafeXorgIcon) -> None:
            loop = icon._loop_thread()
            if loop is None or loop is threading.current_thread() or not loop.is_alive():
                method()  # on the loop, or no loop (never started, or ended) to hand it to
            else:
                icon._hand_over(method.__name__, atom)

        return dispatch

    def _loop_thread(self) -> threading.Thread | None:
        """The loop's thread. pystray marks the icon ready (which starts the setup thread)
        before it records that thread, so a setter may come first: wait for it, bounded."""
        deadline = time.monotonic() + LOOP_START_TIMEOUT_S
        while getattr(self, "_thread", None) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return getattr(self, "_thread", None)

    def _hand_over(self, name: str, atom: int) -> None:
        """Have the loop run the update named ``name``; wait for it and re-raise its error."""
        with self._handover_lock:
            serial = next(self._serials) & 0xFFFFFFFF
            self._sender.send_event(
                self._sender_window,
                Xlib.display.event.ClientMessage(
                    type=Xlib.X.ClientMessage,
                    client_type=atom,
                    window=self._window.id,
                    data=(32, (Xlib.X.CurrentTime, serial, 0, 0, 0)),
                ),
                event_mask=Xlib.X.NoEventMask,
            )
            self._sender.flush()
            error = self._result_of(serial, name)
        if error is not None:
            raise error

    def _result_of(self, serial: int, name: str) -> BaseException | None:
        """The outcome of the update sent as ``serial``; a late outcome of an earlier update
        (one that timed out) is dropped."""
        deadline = time.monotonic() + HANDOVER_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                done, error = self._results.get(timeout=left)
            except queue.Empty:
                break
            if done == serial:
                return error
        raise TrayLoopGone(f"the tray's loop did not run {name} within {HANDOVER_TIMEOUT_S:g} s")

    def _run_for_another_thread(self, method: Callable[[], None], serial: int) -> None:
        """On the loop: run ``method`` and hand its outcome to the thread waiting for it."""
        try:
            method()
        except Exception as error:  # the waiting thread re-raises it
            self._results.put((serial, error))
        else:
            self._results.put((serial, None))

    def __del__(self) -> None:
        try:
            super().__del__()
        finally:
            sender = getattr(self, "_sender", None)
            if sender is not None:
                sender.close()
