"""What one crossing of the trio/asyncio seam costs, as the daemon uses it.

Measures, on this machine, the median round trip of:
* trio -> asyncio: `await bridge.run(noop)` (every outgoing RPC, channel open/close);
* asyncio -> trio: `await bridge.call_in_trio(noop)` (Hello, Propose, Status handlers);
* asyncio -> trio -> asyncio cancelled: a `run_in_trio` whose caller goes away;
* for scale, a grpc.aio unary call on loopback, which every crossing wraps.

    .venv/bin/python benchmarks/bench_bridge.py [--rounds 2000]

Bounded: the rounds run back to back on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc
import trio

from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb, rpc


async def _noop() -> None:
    return None


class _Echo(rpc.PeerServicer):
    async def Ping(self, request, context):
        return pb.PingReply(payload=request.payload)


def _median_us(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:7.1f} us (p90 {_p90(samples) * 1e6:.1f})"


def _p90(samples: list[float]) -> float:
    return sorted(samples)[int(0.9 * len(samples))]


async def main(rounds: int) -> None:
    async with AsyncioThread() as bridge:
        to_asyncio = []
        for _ in range(rounds):
            started = time.perf_counter()
            await bridge.run(_noop)
            to_asyncio.append(time.perf_counter() - started)

        async def from_asyncio() -> tuple[list[float], list[float]]:
            plain, cancelled = [], []
            for _ in range(rounds):
                started = time.perf_counter()
                await bridge.call_in_trio(lambda: None)
                plain.append(time.perf_counter() - started)
            for _ in range(rounds // 10):
                call = asyncio.ensure_future(bridge.run_in_trio(trio.sleep_forever))
                await asyncio.sleep(0)
                started = time.perf_counter()
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
                cancelled.append(time.perf_counter() - started)
            return plain, cancelled

        to_trio, cancelled = await bridge.run(from_asyncio)

        async def grpc_unary() -> list[float]:
            server = grpc.aio.server()
            rpc.add_PeerServicer_to_server(_Echo(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            samples = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.PeerStub(channel)
                for _ in range(rounds):
                    started = time.perf_counter()
                    await stub.Ping(pb.PingRequest(payload=b"x" * 64), timeout=5)
                    samples.append(time.perf_counter() - started)
            await server.stop(None)
            return samples

        unary = await bridge.run(grpc_unary)
        print(f"trio -> asyncio (bridge.run):            {_median_us(to_asyncio)}")
        print(f"asyncio -> trio (bridge.call_in_trio):   {_median_us(to_trio)}")
        print(f"asyncio caller cancels its trio task:    {_median_us(cancelled)}")
        print(f"grpc.aio unary Ping on loopback:         {_median_us(unary)}")
        print(f"trio tasks left from asyncio callers:    {bridge.trio_calls_in_flight}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    trio.run(main, parser.parse_args().rounds)
