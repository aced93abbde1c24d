"""mDNS that follows the network: interfaces that come, go or change address while meshd runs.

A `Discovery` binds zeroconf to a fixed list of addresses, and python-zeroconf cannot change
them in place. So `FollowingDiscovery` reads the interfaces every `poll_interval_s` (psutil,
in `trio.to_thread`: never on the trio loop, which carries the node's heartbeat bookkeeping)
and, when the chosen addresses change, stops the running Discovery and starts one on the new
addresses. A service started before the network is up is announced once an address appears;
a laptop that moves is announced on its new address.

How the old Discovery leaves, so that peers follow without dropping the node needlessly:

* none of its addresses is kept, and one still exists: the service goodbye (peers see the
  node gone at once and find it on the new address);
* some are kept: no service goodbye (the peers would drop the node and find it again a moment
  later); a withdrawn address that still exists gets a goodbye of its address record;
* none of its addresses exists any more: nothing can be sent from them; the peers lose the
  node by its heartbeats, and the new announcement flushes the old address from their caches.

An interface the user named (`--interface eth0`) is followed by name as its addresses change;
a named interface or address that is missing is a warning in the node's events, and read
again at every poll. Each change is said in the node's events, in words.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from meshd.mesh.announcement import Announcement
from meshd.mesh.discovery import Discovery, DiscoveryEvent
from meshd.mesh.interfaces import InterfaceChoice, read_interface_choice

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
WITHDRAW_TIMEOUT_S = 2.0

Report = Callable[[str, int], None]  # a line for the node's events, and its logging level
ReadChoice = Callable[[Sequence[str] | None, Sequence[str]], InterfaceChoice]


@dataclass
class _Announcing:
    """One Discovery on one set of addresses, and what stops it."""

    discovery: Discovery
    choice: InterfaceChoice
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


class _StartedOnce:
    """A task status that may be started by the Discovery or, if it failed first, by us."""

    def __init__(self, status: trio.TaskStatus[None]) -> None:
        self._status = status
        self._started = False

    def started(self, value: None = None) -> None:
        if not self._started:
            self._started = True
            self._status.started()


class FollowingDiscovery:
    """Announce and browse on the interfaces chosen now, and follow them as they change.

    `spec` and `skip` are the user's `--interface` and `--skip-interface` (None: choose
    automatically, see `meshd.mesh.interfaces`). The announcement's addresses are always the
    interfaces' addresses. Peers are reported on `events` by whichever Discovery runs.
    """

    def __init__(
        self,
        announcement: Announcement,
        spec: Sequence[str] | None,
        skip: Sequence[str],
        events: trio.MemorySendChannel[DiscoveryEvent],
        report: Report,
        *,
        poll_interval_s: float = POLL_INTERVAL_S,
        read: ReadChoice = read_interface_choice,
    ) -> None:
        self._announcement = announcement
        self._spec = list(spec) if spec is not None else None
        self._skip = list(skip)
        self._events = events
        self._report = report
        self._poll_interval_s = poll_interval_s
        self._read = read
        self._current: _Announcing | None = None
        self._unavailable: tuple[str, ...] = ()
        self._last_problem = ""
        self._revision = 0

    @property
    def addresses(self) -> tuple[str, ...]:
        """The IPv4 addresses mDNS announces and browses on now (empty: none usable)."""
        return self._current.discovery.interfaces if self._current is not None else ()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the interfaces until cancelled. Started once the first announcement went
        out, or at once when no interface is usable yet (it is waited for meanwhile)."""
        async with trio.open_nursery() as nursery:
            try:
                await self._follow(nursery, await self._read_choice() or InterfaceChoice())
                if not self.addresses:
                    self._say_waiting()
                task_status.started()
                while True:
                    await trio.sleep(self._poll_interval_s)
                    choice = await self._read_choice()
                    if choice is not None:
                        await self._follow(nursery, choice)
            finally:
                if self._current is not None:  # its own shutdown says goodbye (shielded)
                    self._current.scope.cancel()

    async def _read_choice(self) -> InterfaceChoice | None:
        try:
            return await trio.to_thread.run_sync(self._read, self._spec, self._skip)
        except Exception as error:  # psutil could not read them: the next poll tries again
            self._problem(f"mDNS cannot read this machine's interfaces ({error})")
            return None

    async def _follow(self, nursery: trio.Nursery, choice: InterfaceChoice) -> None:
        self._say_unavailable(choice)
        if choice.addresses == self.addresses:
            return
        old = self._current
        withdrawn = tuple(ip for ip in self.addresses if ip not in choice.addresses)
        if old is not None:
            self._revision = old.discovery.revision + 1
            await self._stop(old, withdrawn, choice)
        if choice.addresses:
            await nursery.start(self._announce, _Announcing(self._new_discovery(choice), choice))
        self._say_moved(choice, withdrawn)

    def _new_discovery(self, choice: InterfaceChoice) -> Discovery:
        return Discovery(
            self._announcement, choice.addresses, self._events, first_revision=self._revision
        )

    async def _stop(
        self, old: _Announcing, withdrawn: tuple[str, ...], choice: InterfaceChoice
    ) -> None:
        """Stop `old` the way the module's docstring says, and wait until it has closed."""
        still_here = tuple(ip for ip in withdrawn if ip in choice.present)
        keeps_some = len(withdrawn) < len(old.discovery.interfaces)
        if keeps_some or not still_here:
            with trio.move_on_after(WITHDRAW_TIMEOUT_S):
                try:
                    await old.discovery.withdraw_quietly(still_here)
                except Exception as error:  # it is stopped all the same
                    log.warning("mDNS: could not withdraw from %s: %s", ", ".join(withdrawn), error)
        old.scope.cancel()
        await old.done.wait()  # bounded: the Discovery's shutdown has its own timeout
        if self._current is old:
            self._current = None

    async def _announce(self, running: _Announcing, *, task_status: trio.TaskStatus[None]) -> None:
        """Own one Discovery: a failure (an address gone between reading and binding) is
        said, and the next poll starts another."""
        status = _StartedOnce(task_status)
        self._current = running
        try:
            with running.scope:
                await running.discovery.run(task_status=status)
        except Exception as error:
            self._problem(f"mDNS on {running.choice.describe()} stopped: {error}")
        finally:
            if self._current is running:
                self._current = None
            running.done.set()
            status.started()

    # -- what the node's events say -------------------------------------------------------

    def _say_moved(self, choice: InterfaceChoice, withdrawn: tuple[str, ...]) -> None:
        gone = f"withdrew from {', '.join(withdrawn)}" if withdrawn else ""
        if self.addresses:
            self._last_problem = ""
            self._report(
                f"mDNS now on {choice.describe()}" + (f"; {gone}" if gone else ""), logging.INFO
            )
        elif gone:
            self._report(f"mDNS paused: {gone}; no usable interface now", logging.WARNING)
            self._say_waiting()

    def _say_waiting(self) -> None:
        if self._spec is None:
            self._report(
                "mDNS waits for a usable interface (up, with an IPv4 address, not loopback or a "
                f"container bridge); checked every {self._poll_interval_s:g} s",
                logging.WARNING,
            )

    def _say_unavailable(self, choice: InterfaceChoice) -> None:
        for reason in choice.unavailable:
            if reason not in self._unavailable:
                self._report(
                    f"mDNS waits: {reason}; checked again every {self._poll_interval_s:g} s",
                    logging.WARNING,
                )
        self._unavailable = choice.unavailable

    def _problem(self, text: str) -> None:
        """A failure, said once until something else happens (the poll retries it)."""
        if text != self._last_problem:
            self._last_problem = text
            self._report(f"{text}; trying again in {self._poll_interval_s:g} s", logging.WARNING)
