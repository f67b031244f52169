"""`bk bench neighbour` (issue 28): a latency-sensitive writer beside bulk traffic.

ZooKeeper and 3 bookies (1 shard each). The service is a W=1 writer in this process (3/2/2,
100 B, one add in flight, through a write handle); the neighbour is a bulk writer in another
process (its own client, 3/2/2, --bulk-size bytes), the way two services share a cluster.
Phases, --seconds / 4 each:

1. bulk peak: the bulk writer alone in a closed loop (4,000 in flight), for the cluster's peak
   at its entry size; --bulk-rate defaults to 40 % of it;
2. alone: the W=1 writer alone;
3. beside bulk at rate: the W=1 writer while the bulk writer sends `add_entries` of
   rate/100 entries every 10 ms (an open loop);
4. beside closed-loop bulk: the W=1 writer while the bulk writer runs its closed loop.

Per phase: the W=1 writer's p50/p99/p99.9/max, the bulk writer's rate (and, open loop, the
share of its target it kept), CPU per process, and what the shards say of the same seconds
(in a W=1 phase, the writer's measured seconds: not its connect, nor its trace's start and
read) from their own histograms (/metrics deltas, bucket upper bounds): add latency from
arrival to durable response (p99), journal block write + fdatasync (p99), journal block
bytes (p99) and the longest loop lag, with the longest stall of the loop's own making (the
lag less the time its thread waited for a CPU: on this 2-core machine most of a lag) and
of that the longest asleep (the GIL, a blocking call). Where the W=1 writer's time goes
beyond the shard's p99 is the client, the wire, or queueing before the shard's timestamps
(a receive buffer behind the bulk writer's frames). The W=1 writer's own loop is probed
the same way over its measured seconds: the client's part. Figures only; never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import uvloop

from bookkeeper.bench import BenchResult, Latencies, ProcessWatch, histogram, latency_ms
from bookkeeper.bench.cluster import PRODUCTION_JOURNAL, closed_loop, cluster_processes, handle_adds
from bookkeeper.bench.ledgers import Scrape, histogram_quantile, loop_maxima, parse_metrics
from bookkeeper.bookie.admin import ADD_TRACE_PATH
from bookkeeper.bookie.admin_client import admin_request
from bookkeeper.bookie.metrics import Histogram, LoopLag
from bookkeeper.metrics import LATENCY_BUCKETS_S
from bookkeeper.client import BookKeeper
from bookkeeper.testing.cluster import LocalCluster

BULK_WINDOW = 4000  # the closed-loop bulk writer's adds in flight (bk bench cluster's peak depth)
BULK_TICK_S = 0.01  # the open-loop bulk writer sends one batch per tick
BULK_MARGIN_S = 1.0  # the bulk load starts before and ends after the W=1 writer's phase
DEFAULT_RATE_SHARE = 0.4  # --bulk-rate unset: this share of the measured bulk peak
SERVICE_BYTES = 100
# The W=1 writer's first adds open its connections to the bookies (beside bulk traffic that
# took 0.1-0.7 s, the phase's max): sent before the measured ones.
WARM_UP_ADDS = 10
TRACE_MARGIN_S = 10.0  # an add trace outlasts the W=1 phase by this (its adds' answers, the reading)
SEGMENTS = ("to_shard", "queued", "sync", "answer", "to_client")  # add_breakdown's, in order
SHARD_HISTOGRAMS = {"add_p99_ms": "bookkeeper_add_entry_latency_seconds",
                    "journal_sync_p99_ms": "bookkeeper_journal_sync_latency_seconds",
                    "journal_block_p99_bytes": "bookkeeper_journal_batch_bytes"}


def _scrape(cluster: LocalCluster) -> list[Scrape]:
    return [parse_metrics(admin_request(f"{b.address}:{b.http_port}", "GET", "/metrics", timeout_s=30.0))
            for b in cluster.bookies]


def _merged(scrapes: list[Scrape]) -> Scrape:
    """Every bookie's scrape as one (series of different bookies summed)."""
    out: Scrape = {}
    for s in scrapes:
        for k, v in s.items():
            out[k] = out.get(k, 0.0) + v
    return out


def shard_figures(before: list[Scrape], after: list[Scrape]) -> dict[str, float | None]:
    """What the shards measured between two scrapes of every bookie (module doc)."""
    first, last = _merged(before), _merged(after)
    out: dict[str, float | None] = {}
    for name, family in SHARD_HISTOGRAMS.items():
        v = histogram_quantile(first, last, family, 0.99)
        out[name] = None if v is None else (round(v * 1000, 3) if name.endswith("_ms") else v)
    for key, v in loop_maxima(first, last).items():
        out[key.removesuffix("_s") + "_ms"] = None if v is None else round(v * 1000, 3)
    return out


def _max_ms(lat: Latencies) -> float:
    return max(lat.counts, default=0) / 1000.0


class BulkWriter:
    """The bulk writer: `python -m bookkeeper.bench.neighbour` in its own process, started per
    phase; it prints READY once its ledger is made, and one JSON line ({"adds", "seconds",
    "cpu_s", "latency_ms"}) when done."""

    def __init__(self, uri: str, *, rate: float, size: int, seconds: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bookkeeper.bench.neighbour", "--uri", uri,
                                      "--rate", str(rate), "--size", str(size), "--seconds", str(seconds)],
                                     stdout=subprocess.PIPE, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self) -> None:
        """Until the writer has made its ledger and starts its load (it prints READY; a writer
        that fails first exits, and its output ends)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.proc.kill()
            raise RuntimeError(f"the bulk writer did not start: {line!r}")

    def result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=timeout_s)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the bulk writer failed (exit {self.proc.returncode})")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


def neighbour_bench(directory: str, *, seconds: float, bulk_rate: float = 0.0, bulk_size: int = 1024,
                    sync: str = "io_uring", bookie_conf: dict[str, Any] | None = None) -> list[BenchResult]:
    """The four phases of the module doc, one BenchResult each (the W=1 writer's latency,
    or for the bulk peak the bulk writer's). bookie_conf: bookie settings to compare (a
    journal bound, pinning), over the bench's own."""
    phase_s = seconds / 4
    cluster = LocalCluster(tempfile.mkdtemp(prefix="neighbour-", dir=directory), bookies=3, shards=1,
                           journal_sync=sync, bookie_conf={**PRODUCTION_JOURNAL, **(bookie_conf or {})},
                           http_ports=True)
    cluster.start()
    results: list[BenchResult] = []
    try:
        procs = cluster_processes(cluster)
        admins = [f"{b.address}:{b.http_port}" for b in cluster.bookies]

        def measure(name: str, bulk: BulkWriter | None, w1: bool, rate: float) -> dict[str, Any]:
            watch = ProcessWatch(procs)  # the bulk writer reports its own CPU (it has exited by the end)
            before_cpu, before = watch.cpu(), None if w1 else _scrape(cluster)
            t0 = time.perf_counter()
            lat = histogram()
            n = 0
            client: dict[str, Any] = {}
            if w1:  # the shards' figures of its measured seconds only: not its trace's start and read
                n, _dt, client, scrapes = uvloop.run(_service(cluster.metadata_uri, phase_s, lat, admins,
                                                              functools.partial(_scrape, cluster)))
            bulk_out = bulk.result() if bulk else None
            dt = time.perf_counter() - t0
            shards = shard_figures(*scrapes) if before is None else shard_figures(before, _scrape(cluster))
            fig: dict[str, Any] = {"phase": name, "seconds": round(dt, 3), "shards": shards,
                                   **client,
                                   "cpu_percent": {k: v["cpu_percent"] for k, v in watch.per_op(before_cpu, 1, dt).items()}}
            if bulk_out is not None:
                fig["bulk_adds_per_s"] = round(bulk_out["adds"] / bulk_out["seconds"], 1)
                fig["bulk_latency_ms"] = bulk_out["latency_ms"]
                fig["bulk_cpu_percent"] = round(bulk_out["cpu_s"] / bulk_out["seconds"] * 100, 1)
                if rate:
                    fig["bulk_rate_target"] = rate
                    fig["bulk_rate_kept"] = round(fig["bulk_adds_per_s"] / rate, 3)
            fig["_lat"], fig["_n"], fig["_dt"] = lat, n, dt
            return fig

        def with_bulk(name: str, rate: float, w1: bool) -> dict[str, Any]:
            # Beside the W=1 writer, the bulk load outlasts it (its connect and create included).
            bulk = BulkWriter(cluster.metadata_uri, rate=rate, size=bulk_size,
                              seconds=phase_s + (BULK_MARGIN_S if w1 else 0.0))
            try:
                bulk.ready()
                return measure(name, bulk, w1, rate)
            finally:
                bulk.proc.kill()  # gone already unless the phase failed: never left running
                bulk.proc.wait()

        peak = with_bulk("bulk peak", 0.0, False)
        rate = bulk_rate or round(DEFAULT_RATE_SHARE * peak["bulk_adds_per_s"])
        phases = [peak, measure("alone", None, True, 0.0), with_bulk("beside bulk at rate", rate, True),
                  with_bulk("beside closed-loop bulk", 0.0, True)]
        for fig in phases:
            lat, n, dt = fig.pop("_lat"), fig.pop("_n"), fig.pop("_dt")
            if fig["phase"] == "bulk peak":
                results.append(BenchResult(f"neighbour: bulk {bulk_size} B closed loop alone", fig["bulk_adds_per_s"],
                                           fig["bulk_adds_per_s"] * bulk_size / 1e6, fig["bulk_latency_ms"],
                                           {**fig, "bulk_bytes": bulk_size}))
                continue
            results.append(BenchResult(f"neighbour: W=1 {SERVICE_BYTES} B, {fig['phase']}", n / dt,
                                       n * SERVICE_BYTES / dt / 1e6, latency_ms(lat),
                                       {**fig, "max_ms": _max_ms(lat), "bulk_bytes": bulk_size}))
    finally:
        cluster.stop()
    return results


class _Max(Histogram):
    """A histogram that also keeps its largest observation (the client's loop probe)."""

    def __init__(self) -> None:
        super().__init__(LATENCY_BUCKETS_S)
        self.max = 0.0

    def observe(self, value: float) -> None:
        super().observe(value)
        self.max = max(self.max, value)


async def _service(uri: str, seconds: float, lat: Latencies, admins: list[str],
                   scrape: Callable[[], list[Scrape]]
                   ) -> tuple[int, float, dict[str, Any], tuple[list[Scrape], list[Scrape]]]:
    """The W=1 writer: one ledger, one add in flight, for `seconds`, its adds traced by the
    bookies (admins: their admin addresses) and laid beside its own send and answer times
    (add_breakdown). Also how late its own loop ran (the shards' probe, LoopLag, every
    10 ms): the longest lag, of it the longest not spent waiting for a CPU, and of that the
    longest asleep (the GIL, a blocking call), in ms: the client's part of a slow add."""
    lag, stall, blocked = _Max(), _Max(), _Max()
    probe = LoopLag(asyncio.get_running_loop(), lag, time.monotonic_ns, stall=stall, blocked=blocked)  # always active
    probe.start()
    mono = time.monotonic  # the clock the shards stamp with (CLOCK_MONOTONIC: one per host)
    counts = lat.counts
    times: list[tuple[float, float]] = []
    try:
        async with await BookKeeper.connect(uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            payload = os.urandom(SERVICE_BYTES)
            try:
                for _ in range(WARM_UP_ADDS):  # connections to the bookies made, not measured
                    await lh.add_entry(payload)
                trace = {"peers": bk.pool.local_addresses(), "seconds": seconds + TRACE_MARGIN_S}
                for admin in admins:  # blocking HTTP: off the loop, whose probe is measuring
                    await asyncio.to_thread(admin_request, admin, "POST", ADD_TRACE_PATH, body=trace, timeout_s=30.0)
                before = await asyncio.to_thread(scrape)
                for h in (lag, stall, blocked):  # the client's loop over the measured seconds only
                    h.max = 0.0
                start = mono()
                while (t0 := mono()) - start < seconds:
                    await lh.add_entry(payload)
                    t1 = mono()
                    counts[int((t1 - t0) * 1e6)] += 1
                    times.append((t0, t1))
                dt = mono() - start
                loop_ms = {f"client_loop_{k}_max_ms": round(h.max * 1000, 3)
                           for k, h in (("lag", lag), ("stall", stall), ("blocked", blocked))}
                after = await asyncio.to_thread(scrape)
            finally:
                await lh.close()
    finally:
        probe.stop()
    shards = [shard for admin in admins for shard in admin_request(admin, "GET", ADD_TRACE_PATH, timeout_s=30.0)["shards"]]
    breakdown = add_breakdown(times, [r for shard in shards for r in shard["records"]], ack_quorum=2)
    breakdown["dropped"] = sum(shard["dropped"] for shard in shards)  # records a shard had no room for
    return len(times), dt, {**loop_ms, "slow_adds": breakdown}, (before, after)


def add_breakdown(adds: list[tuple[float, float]], records: list[list[Any]], *, ack_quorum: int,
                  quantile: float = 0.99) -> dict[str, Any]:
    """Where the W=1 writer's slowest adds spent their time: each add (its send and answer
    times, one add in flight) joined with the bookies' trace records of its connections whose
    arrival falls within it (bookkeeper/bookie/add_trace.py FIELDS order), the one that completed its quorum
    (the ack_quorum-th answered) standing for it. For the adds at or past `quantile` of
    latency and for all adds: the mean ms of each segment (the means add up to the mean
    latency, so their shares compare), the slowest joined add's segments, the largest
    journal block a slow add rode in, and the joined count.

    Segments: to_shard (the client before the send, the wire, the shard's loop reading it),
    queued (in the journal's filling batch: a sync in flight ahead of it, a group wait), sync
    (the block's write + fdatasync and the loop learning of it), answer (the block's responses
    written before this one's), to_client (the wire back and the client's loop)."""
    if not adds:
        return {"adds": 0, "joined": 0}
    by_arrival = sorted(records, key=lambda r: r[1])
    arrivals = [r[1] for r in by_arrival]
    joined: list[tuple[float, tuple[float, ...], int]] = []
    for t0, t1 in adds:
        lo, hi = bisect.bisect_left(arrivals, t0), bisect.bisect_right(arrivals, t1)
        mine = sorted(by_arrival[lo:hi], key=lambda r: r[4])
        if len(mine) < ack_quorum:
            continue
        _peer, arrival, sealed, synced, answered, _n, _records, block_bytes = mine[ack_quorum - 1]
        joined.append((t1 - t0, (arrival - t0, sealed - arrival, synced - sealed, answered - synced, t1 - answered),
                       block_bytes))
    latencies = sorted(t1 - t0 for t0, t1 in adds)
    threshold = latencies[min(len(latencies) - 1, int(quantile * len(latencies)))]
    slow = [j for j in joined if j[0] >= threshold]

    def means(rows: list[tuple[float, tuple[float, ...], int]]) -> dict[str, float] | None:
        if not rows:
            return None
        return {name: round(sum(r[1][k] for r in rows) / len(rows) * 1000, 3) for k, name in enumerate(SEGMENTS)}
    return {"adds": len(adds), "joined": len(joined), "threshold_ms": round(threshold * 1000, 3),
            "slow": len(slow), "slow_mean_ms": means(slow), "all_mean_ms": means(joined),
            "slowest_ms": means([max(joined)]) if joined else None,
            "slow_block_bytes_max": max((j[2] for j in slow), default=0)}


async def _bulk(uri: str, rate: float, size: int, seconds: float) -> dict[str, Any]:
    """The bulk writer's load: open loop at `rate` (add_entries_async of rate * BULK_TICK_S
    entries every tick, latency from each batch's intended send time) or, rate 0, a closed
    loop of BULK_WINDOW adds."""
    lat = histogram()
    async with await BookKeeper.connect(uri, max_outstanding_adds=1 << 20) as bk:
        lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
        payload = os.urandom(size)
        print("READY", flush=True)
        cpu0 = _cpu_s()
        if rate <= 0:
            n, dt = await closed_loop([handle_adds(lh, "client")], payload, seconds, BULK_WINDOW, lat)
        else:
            n, dt = await _open_loop_batches(lh, payload, rate, seconds, lat)
        cpu = _cpu_s() - cpu0
        await lh.close()
    return {"adds": n, "seconds": dt, "cpu_s": cpu, "latency_ms": latency_ms(lat)}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _open_loop_batches(lh: Any, payload: bytes, rate: float, seconds: float, lat: Latencies) -> tuple[int, float]:
    perf = time.perf_counter
    counts = lat.counts
    pending: set[asyncio.Future[Any]] = set()
    acked = 0
    sent = 0
    t0 = perf()

    def done(t: float, k: int, f: asyncio.Future[Any]) -> None:
        nonlocal acked
        pending.discard(f)
        if f.exception() is None:
            counts[int((perf() - t) * 1e6)] += k
            acked += k
    tick = 0
    while perf() - t0 < seconds:
        due = int((tick + 1) * BULK_TICK_S * rate) - sent
        if due > 0:
            fut = lh.add_entries_async([payload] * due)
            fut.add_done_callback(lambda f, t=t0 + tick * BULK_TICK_S, k=due: done(t, k, f))
            pending.add(fut)
            sent += due
        tick += 1
        await asyncio.sleep(max(0.0, t0 + tick * BULK_TICK_S - perf()))
    if pending:
        await asyncio.wait(list(pending), timeout=60)
    return acked, perf() - t0


def main(argv: list[str] | None = None) -> int:
    """The bulk writer's process (BulkWriter starts it)."""
    p = argparse.ArgumentParser(prog="bookkeeper.bench.neighbour", description="the bulk writer of bk bench neighbour")
    p.add_argument("--uri", required=True)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--seconds", type=float, required=True)
    args = p.parse_args(argv)
    out = uvloop.run(_bulk(args.uri, args.rate, args.size, args.seconds))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
