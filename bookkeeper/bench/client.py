"""`bk bench client`: what the client itself costs per add, with every bookie replaced by an
in-process echo (no network, no bookie, no fsync), so the figure is the client's own ceiling,
as `limits` gives the device's and the loopback's.

The echo parses each written buffer with the bookie's codec and answers every add OK in one
buffer on the next loop turn; its cost (~0.5 us per add) is included in the figure.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import uvloop

from bookkeeper.bench import BenchResult, histogram, latency_ms
from bookkeeper.bench.cluster import closed_loop, handle_adds
from bookkeeper.client.bookie_client import _ShardProtocol
from bookkeeper.client.client import BookKeeper
from bookkeeper.client.ledger import WriteHandle
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, password_digest
from bookkeeper.proto import Status, encode_responses, parse_requests

CONFIGS = ((1, 1, 1), (3, 2, 2))


class _EchoTransport(asyncio.Transport):
    """A bookie shard that answers every request OK on the next loop turn, in one buffer."""

    def __init__(self, protocol: _ShardProtocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.loop = asyncio.get_running_loop()

    def write(self, data: Any) -> None:
        frames, _ = parse_requests(data, 1 << 30)
        self.loop.call_soon(self.protocol.feed,
                            encode_responses([(f[0], Status.OK, f[2], f[3], f[4], -1, b"") for f in frames]))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def _run(ensemble: int, write_quorum: int, ack_quorum: int, size: int, seconds: float,
               window: int, driver: str) -> BenchResult:
    bk = BookKeeper(store=None)  # type: ignore[arg-type]  # no metadata calls: the handle is built here
    ids = [f"echo-{i}:3181" for i in range(ensemble)]
    bk._bookies = {b: {"shards": [{"host": b, "port": 3181}]} for b in ids}
    for b in ids:
        conn = bk.pool.connection_to(b, 3181)
        protocol = _ShardProtocol(conn)
        transport = _EchoTransport(protocol)
        protocol.connection_made(transport)
        conn.attach(transport)
    md = LedgerMetadata(ledger_id=1, ensemble_size=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
                        digest=DigestType.CRC32C, password_digest=password_digest(b""), ensembles={0: ids})
    lat = histogram()
    cpu0 = time.process_time()
    n, dt = await closed_loop([handle_adds(WriteHandle(bk, md, b""), driver)], os.urandom(size), seconds, window,
                              lat)
    cpu = time.process_time() - cpu0
    bk.pool.close()
    return BenchResult(f"client {ensemble}/{write_quorum}/{ack_quorum} {size} B W={window}, {driver} driver (echo bookies)",
                       n / dt, n * size / dt / 1e6, latency_ms(lat),
                       {"entry_bytes": size, "driver": driver, "cpu_us_per_add": round(cpu / max(1, n) * 1e6, 2),
                        "cpu_percent": round(cpu / dt * 100, 1)})


def client_bench(*, size: int, seconds: float, window: int, driver: str = "client") -> list[BenchResult]:
    """The write handle's cost per add at E/Qw/Qa 1/1/1 and 3/2/2, seconds / 2 each, driven
    by a future per add ("client"), a callback per add ("callback") or batches ("batch")."""
    return [uvloop.run(_run(*cfg, size, seconds / len(CONFIGS), window, driver)) for cfg in CONFIGS]
