"""Change notification between trio components: one style, a memory channel per subscriber.

A component that others watch (membership, agreement, discovery) owns a `Publisher` and
publishes from its own trio task; a watcher subscribes and reads its own channel in its own
task. Publishing never blocks and never runs the watcher's code, so a slow or failing
watcher cannot stall or break the publisher (callbacks could), and each watcher sees the
items in order.

Two kinds of feeds:
* events (`coalesce=False`): every item matters (a plan was committed, then withdrawn). The
  channel is bounded; a subscriber that falls `buffer` items behind is stuck (a bug): the
  item is dropped for it with an ERROR line naming the feed, and the publisher goes on.
* changes (`coalesce=True`, items are `None`): "the state changed, read it again". A pending
  wake-up already covers any later change, so a full channel simply drops the duplicate.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Generic, TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")


class Publisher(Generic[T]):
    """Hands each subscriber its own memory channel; `publish` never blocks."""

    def __init__(self, name: str, *, buffer: int = 256, coalesce: bool = False) -> None:
        self.name = name
        self._buffer = 1 if coalesce else buffer
        self._coalesce = coalesce
        self._subscribers: list[trio.MemorySendChannel[T]] = []

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[trio.MemoryReceiveChannel[T]]:
        """A channel of the items published from now on, for as long as the block runs."""
        send, receive = trio.open_memory_channel[T](self._buffer)
        self._subscribers.append(send)
        try:
            with receive:
                yield receive
        finally:
            self._subscribers.remove(send)
            send.close()

    def publish(self, item: T) -> None:
        """Hand `item` to every subscriber (trio thread)."""
        for send in list(self._subscribers):
            try:
                send.send_nowait(item)
            except trio.WouldBlock:
                if not self._coalesce:
                    log.error(
                        "a subscriber of %s is %d items behind (stuck?); dropped %r for it",
                        self.name,
                        self._buffer,
                        item,
                    )
            except trio.BrokenResourceError:  # the subscriber closed its end while leaving
                pass

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
