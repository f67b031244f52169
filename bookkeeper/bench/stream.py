"""`bk bench stream`: records through a stream writer against entries through a ledger.

Why both in one run: the figure that says what streams cost is the ratio of stream
records/s to `bk bench cluster`'s entries/s at the same record/entry size and the same
E/Qw/Qa (3/2/2), on the same three bookie processes, minutes apart at most. Record sets
are what make it greater than one: many 100 B records ride in one entry.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time

import uvloop

from bookkeeper.bench import BenchResult, Latencies, ProcessWatch, histogram, latency_ms
from bookkeeper.bench.cluster import PRODUCTION_JOURNAL, HandleAdds, closed_loop, cluster_processes, cluster_rss
from bookkeeper.client import BookKeeper
from bookkeeper.stream import Namespace
from bookkeeper.testing.cluster import LocalCluster

DEPTH = 8  # write_batch calls in flight: the writer pipelines their record sets


async def _stream_loop(ns: Namespace, size: int, batch: int, seconds: float, lat: Latencies) -> tuple[int, float]:
    """DEPTH callers, each write_batch of `batch` records and await, until time is up; latency per batch."""
    await ns.create_stream("bench")
    records = [os.urandom(size) for _ in range(batch)]
    n = 0
    perf = time.perf_counter
    async with await ns.open_writer("bench", segment_max_bytes=None, segment_max_age_s=None) as w:
        t0 = perf()
        t_end = t0 + seconds

        async def caller() -> None:
            nonlocal n
            while perf() < t_end:
                t = perf()
                await w.write_batch(records)
                lat.counts[int((perf() - t) * 1e6)] += 1
                n += batch

        await asyncio.gather(*(caller() for _ in range(DEPTH)))
        dt = perf() - t0
    return n, dt


def stream_bench(directory: str, *, size: int, seconds: float, batch: int = 1000,
                 sync: str = "io_uring") -> list[BenchResult]:
    """3 bookies; first a 3/2/2 ledger at W=4000 (`bk bench cluster`'s peak phase), then a
    3/2/2 stream through write_batch, seconds / 2 each. The stream row carries the ratio."""
    cluster = LocalCluster(tempfile.mkdtemp(prefix="stream-", dir=directory), bookies=3, shards=1,
                           journal_sync=sync, bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    watch = ProcessWatch(cluster_processes(cluster))
    rows: list[tuple[str, int, float, Latencies, dict]] = []
    try:
        async def main() -> None:
            async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=1 << 20) as bk:
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                lat, before = histogram(), watch.cpu()
                n, dt = await closed_loop([HandleAdds(lh)], os.urandom(size), seconds / 2, 4000, lat)
                rows.append((f"ledger 3/2/2 {size} B entries W=4000", n, dt, lat, watch.per_op(before, n, dt)))
                await lh.close()
            async with await Namespace.connect(cluster.metadata_uri, "bench") as ns:
                lat, before = histogram(), watch.cpu()
                n, dt = await _stream_loop(ns, size, batch, seconds / 2, lat)
                rows.append((f"stream 3/2/2 {size} B records, write_batch {batch} x{DEPTH}", n, dt, lat,
                             watch.per_op(before, n, dt)))
        uvloop.run(main())
        rss = cluster_rss(cluster)
    finally:
        cluster.stop()
    ledger_rate = rows[0][1] / rows[0][2]
    out = []
    for i, (name, n, dt, lat, cpu) in enumerate(rows):
        extra = {"record_bytes": size, "sync": sync, "cpu": cpu, "peak_rss_mb": rss}
        if i == 1:
            extra.update(batch=batch, depth=DEPTH, latency_is="per write_batch call",
                         ratio_to_cluster=round(n / dt / ledger_rate, 2))
        out.append(BenchResult(name, n / dt, n * size / dt / 1e6, latency_ms(lat), extra))
    return [out[1], out[0]]
