"""Diagnostic mDNS runner: `python -m tests.support.mdns_probe --interface IP ...` prints
discovery events as JSON lines. The multi-node tests run it inside network namespaces."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import trio

from meshd.mesh.announcement import Announcement
from meshd.mesh.discovery import Discovery, DiscoveryEvent, PeerAppeared, PeerGone
from meshd.mesh.interfaces import resolve_interfaces


def _event_record(event: DiscoveryEvent) -> dict[str, Any]:
    if isinstance(event, PeerGone):
        return {"event": "gone", "node_id": event.node_id, "reason": event.reason}
    kind = "appeared" if isinstance(event, PeerAppeared) else "updated"
    a = event.announcement
    return {
        "event": kind,
        "node_id": a.node_id,
        "mesh_name": a.mesh_name,
        "grpc_port": a.grpc_port,
        "addresses": list(a.addresses),
    }


def _print_record(record: dict[str, Any]) -> None:
    print(json.dumps({"t": time.monotonic(), **record}), flush=True)


async def _run_for(
    discovery: Discovery, seconds: float, receive: trio.MemoryReceiveChannel
) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            _print_record({"event": "starting"})
            await nursery.start(discovery.run)
            _print_record({"event": "registered", "announced_at": discovery.announced_at})
            with trio.move_on_after(seconds):
                async for event in receive:
                    _print_record(_event_record(event))
            nursery.cancel_scope.cancel()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.mdns_probe",
        description="Announce a meshd node and print discovered peers as JSON lines.",
    )
    parser.add_argument(
        "--interface",
        action="append",
        required=True,
        help="interface name or IPv4 address to announce on (repeatable)",
    )
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--mesh", default="default")
    parser.add_argument("--fingerprint", default="")
    parser.add_argument("--protocol-version", type=int, default=1)
    parser.add_argument("--grpc-port", type=int, default=50051)
    parser.add_argument("--seconds", type=float, default=60.0, help="stop after this long")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the diagnostic runner; returns the process exit status."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    announcement = Announcement(
        node_id=args.node_id,
        mesh_name=args.mesh,
        protocol_version=args.protocol_version,
        grpc_port=args.grpc_port,
        fingerprint=args.fingerprint,
    )
    send, receive = trio.open_memory_channel[DiscoveryEvent](100)
    discovery = Discovery(announcement, resolve_interfaces(args.interface), send)
    trio.run(_run_for, discovery, args.seconds, receive)
    _print_record({"event": "stopped"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
