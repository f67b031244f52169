"""Benchmarks over real bookie processes: one bookie, a 3/2/2 cluster with a tailing reader,
and cold catch-up reads. The client runs in this process (uvloop); bookies are the real
`bk bookie` processes of a LocalCluster under the bench directory.
"""
from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import time
from collections import deque
from typing import Any

import uvloop

from bookkeeper.bench import BenchResult, Latencies, histogram, latency_ms, peak_rss_mb
from bookkeeper.client import BookKeeper
from bookkeeper.proto import shard_for_ledger
from bookkeeper.testing.cluster import LocalCluster

PRODUCTION_JOURNAL = {"journal_preallocate_bytes": 64 << 20}  # the bookie default, not the test harness's


def _rss(cluster: LocalCluster) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"client[{os.getpid()}]": peak_rss_mb(os.getpid())}
    for i, b in enumerate(cluster.bookies):
        if b.pid:
            out[f"bookie{i}-supervisor[{b.pid}]"] = peak_rss_mb(b.pid)
            for pid in b.shard_pids():
                out[f"bookie{i}-shard[{pid}]"] = peak_rss_mb(pid)
    return out


async def _ledgers_over_shards(bk: BookKeeper, shards: int, **kw: Any) -> list:
    """One ledger per shard of the (single) bookie, so every shard does work."""
    chosen: dict[int, Any] = {}
    while len(chosen) < shards:
        lh = await bk.create_ledger(**kw)
        chosen.setdefault(shard_for_ledger(lh.ledger_id, shards), lh)
    return list(chosen.values())


async def _closed_loop(handles: list, payload: bytes, seconds: float, window: int, lat: Latencies,
                       acked_at: dict[int, float] | None = None) -> tuple[int, float]:
    """W adds in flight; the loop wakes once per completed run (acks come in order), not per add."""
    pending: deque = deque()
    counts = lat.counts
    perf = time.perf_counter
    n = i = 0
    t0 = perf()
    t_end = t0 + seconds
    while True:
        if perf() < t_end:
            while len(pending) < window:
                pending.append((handles[i % len(handles)].add_entry_async(payload), perf()))
                i += 1
        elif not pending:
            break
        if not pending[0][0].done():
            await pending[0][0]
        now = perf()
        while pending and pending[0][0].done():
            fut, sent = pending.popleft()
            eid = fut.result()
            counts[int((now - sent) * 1e6)] += 1
            if acked_at is not None:
                acked_at[eid] = now
            n += 1
    return n, perf() - t0


async def _open_loop(handles: list, payload: bytes, seconds: float, rate: float, lat: Latencies) -> tuple[int, float]:
    """Send at a fixed rate; latency counts from each add's intended send time (coordinated
    omission corrected), taken when its future completes."""
    counts = lat.counts
    perf = time.perf_counter
    outstanding: set[asyncio.Future] = set()

    def record(f: asyncio.Future, intended: float) -> None:
        outstanding.discard(f)
        if not f.exception():
            counts[int((perf() - intended) * 1e6)] += 1

    t0 = perf()
    sent = 0
    while (now := perf()) - t0 < seconds:
        due = int((now - t0) * rate)
        while sent < due:
            f = handles[sent % len(handles)].add_entry_async(payload)
            f.add_done_callback(functools.partial(record, intended=t0 + sent / rate))
            outstanding.add(f)
            sent += 1
        await asyncio.sleep(0.0005)
    await asyncio.gather(*outstanding)
    return sent, perf() - t0


def bookie_bench(directory: str, *, shards: int, size: int, seconds: float, window: int,
                 open_loop_rate: float = 0.0, sync: str = "io_uring") -> BenchResult:
    """One bookie (supervisor + shards), E=Qw=Qa=1, durable adds over loopback."""
    cluster = LocalCluster(tempfile.mkdtemp(prefix="bookie-", dir=directory), bookies=1, shards=shards,
                           journal_sync=sync, bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    h = histogram()
    try:
        async def main() -> tuple[int, float]:
            async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=1 << 20) as bk:
                handles = await _ledgers_over_shards(bk, shards, ensemble=1, write_quorum=1, ack_quorum=1)
                payload = os.urandom(size)
                if open_loop_rate:
                    return await _open_loop(handles, payload, seconds, open_loop_rate, h)
                return await _closed_loop(handles, payload, seconds, window, h)
        n, dt = uvloop.run(main())
        rss = _rss(cluster)
    finally:
        cluster.stop()
    mode = f"open loop {open_loop_rate:,.0f}/s" if open_loop_rate else f"closed loop W={window}"
    return BenchResult(f"bookie {shards} shard(s) {size} B {mode}", n / dt, n * size / dt / 1e6, latency_ms(h),
                       {"shards": shards, "entry_bytes": size, "mode": mode, "sync": sync, "peak_rss_mb": rss})


def cluster_bench(directory: str, *, size: int, seconds: float, window: int, sync: str = "io_uring") -> BenchResult:
    """3 bookies, a 3/2/2 ledger: add throughput and latency, and a tailing reader's delay after each ack."""
    cluster = LocalCluster(tempfile.mkdtemp(prefix="cluster-", dir=directory), bookies=3, shards=1, journal_sync=sync,
                           bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    h = histogram()
    tail_h = histogram()
    try:
        async def main() -> tuple[int, float]:
            async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=1 << 20) as bk, \
                    await BookKeeper.connect(cluster.metadata_uri) as reader:
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                rh = await reader.open_ledger(lh.ledger_id, recovery=False)
                acked_at: dict[int, float] = {}

                async def tail() -> None:
                    async for e in rh.tail(0):
                        t = acked_at.pop(e.entry_id, None)
                        if t is not None:
                            tail_h.record_value(max(1, int((time.perf_counter() - t) * 1e6)))

                tailer = asyncio.create_task(tail())
                n, dt = await _closed_loop([lh], os.urandom(size), seconds, window, h, acked_at)
                await lh.close()
                await asyncio.wait_for(tailer, 30)
                return n, dt
        n, dt = uvloop.run(main())
        rss = _rss(cluster)
    finally:
        cluster.stop()
    return BenchResult(f"cluster 3/2/2 {size} B W={window}", n / dt, n * size / dt / 1e6, latency_ms(h),
                       {"entry_bytes": size, "tail_latency_ms": latency_ms(tail_h), "sync": sync,
                        "peak_rss_mb": rss})


def read_bench(directory: str, *, size: int, entries: int, sync: str = "io_uring") -> BenchResult:
    """Catch-up reads of a cold ledger: written, bookie restarted (write cache flushed to the
    entry log by the checkpoint on stop), then read whole."""
    cluster = LocalCluster(tempfile.mkdtemp(prefix="read-", dir=directory), bookies=1, shards=1, journal_sync=sync,
                           bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    h = histogram()
    try:
        async def write() -> int:
            async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=1 << 20) as bk:
                lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1)
                payload = os.urandom(size)
                for start in range(0, entries, 5000):
                    await asyncio.gather(*(lh.add_entry_async(payload) for _ in range(min(5000, entries - start))))
                await lh.close()
                return lh.ledger_id
        lid = uvloop.run(write())
        cluster.restart_bookie(cluster.bookies[0])

        async def read() -> tuple[int, float]:
            async with await BookKeeper.connect(cluster.metadata_uri, read_window=2048) as bk:
                rh = await bk.open_ledger(lid)
                t0 = time.perf_counter()
                n = 0
                for start in range(0, entries, 8192):
                    s = time.perf_counter()
                    got = await rh.read(start, min(entries - 1, start + 8191))
                    h.record_value(max(1, int((time.perf_counter() - s) * 1e6 / max(1, len(got)))))
                    n += len(got)
                return n, time.perf_counter() - t0
        n, dt = uvloop.run(read())
        rss = _rss(cluster)
    finally:
        cluster.stop()
    return BenchResult(f"cold read {size} B x {entries}", n / dt, n * size / dt / 1e6, latency_ms(h),
                       {"entry_bytes": size, "entries": n, "latency_note": "per entry, averaged per 8192-entry batch",
                        "peak_rss_mb": rss})
