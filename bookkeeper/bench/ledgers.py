"""`bk bench ledgers`: what one ledger costs, with 10 to 10^4 of them open at once (issue 26).

Design note
-----------
A log store at scale holds many ledgers, most of them idle. What limits it then is not one
ledger's adds/s but what each ledger costs everywhere: its create, close, open and delete
(ZooKeeper round trips, the client's password hashing), the memory it holds in the client (a
handle) and in the bookies (index state), the znodes and bytes it keeps in ZooKeeper, the CPU
it costs while nobody writes (timers, garbage collection), and whether many handles slow the
write path. So for each N of `--ledgers` one cluster runs seven phases, and every phase
reports its rate and the CPU each process spent per operation:

  1 create   N ledgers, OPS_IN_FLIGHT at once                    creates/s; znodes, bytes and
                                                                  client RSS per ledger
  2 add      one add to each                                      bookie RSS per stored ledger
  3 idle     idle_s of nothing, then one GC pass forced through   CPU % of every process while
             POST /api/v1/bookie/gc (the default gc_interval_s,   idle; the pass's duration,
             60 s, is too long to wait for at each N)             ZooKeeper reads and CPU
  4 write    round-robin over the N handles, ADD_WINDOW in flight adds/s, CPU and Python GC per add
  5 write + creates: phase 4 while CREATES_PER_S ledgers/s are    adds/s and its ratio to phase 4
             created
  6 close the N; recovery-open a separate set of min(N, RECOVERY_SET_MAX) ledgers whose writer
             is gone (its client closed without closing them: what recovery is for); open the N
             closed ones without recovery                         ops/s each
  7 delete   the recovered set and phase 5's ledgers, alone      deletes/s
    delete under load: the N (and the phase 2 primer) while      deletes/s; add p99 during the
             LOAD_LEDGERS other ledgers are written at            deletes and GC against the
             ADD_WINDOW; then GC forced until the bookies hold    same load just before; the
             none of them                                         shards' largest loop lag
Phase 7 ends with every shard empty (the load ledgers deleted and collected too), so the next
N starts on clean bookies; a warm-up before the first N runs every path once.

How: the client runs in this process (uvloop) against a LocalCluster (the harness's ZooKeeper
JVM, 3 bookies of 1 shard with admin HTTP), ledgers 3/2/2. CPU is /proc/PID/stat of each
bookie's supervisor and shards and of ZooKeeper's JVM, and time.process_time() here (the client
with its kazoo and executor threads). ZooKeeper requests are `mntr`'s zk_packets_received (every
session's requests, pings included); znodes and bytes its zk_znode_count and
zk_approximate_data_size. Memory per ledger is the growth of RssAnon (allocated memory, not
the file pages a shard maps) over phase 1 (client) and phase 2 (shards, less their write
caches' growth). Python's cyclic GC is timed through gc.callbacks. A GC pass's
ZooKeeper reads, buckets and ledgers are what the shards' answers to the forced pass report.
A figure not measured is None ("n/a"): what the bookies do not report (an older bookie's
GC reads; a loop histogram it does not export) and memory per ledger below
RSS_MIN_LEDGERS.

`--metadata N` then writes N ledgers' metadata znodes straight into ZooKeeper (the store's
ledger_path and LedgerMetadata serialization, in pipelined multi-ops), while the bookies
hold HELD_FOR_METADATA real ledgers just below those ids, and times a forced GC pass (before
and after the N appear) and a `bk ledgers list` over them (first line, total, peak RSS).
Only public APIs: BookKeeper's, the bookies' admin HTTP and /metrics, ZooKeeper's four-letter words.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper.bench import (BenchResult, Latencies, cpu_seconds, histogram, latency_ms, peak_rss_mb, rss_anon_kb,
                             self_rss)
from bookkeeper.bench.cluster import PRODUCTION_JOURNAL
from bookkeeper.bookie.admin_client import admin_request
from bookkeeper.cli.common import UsageError, cli_table, err, out
from bookkeeper.client import BookKeeper, WriteHandle
from bookkeeper.config import BookieConfig
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState, password_digest
from bookkeeper.meta.zk import ledger_path, parse_metadata_uri
from bookkeeper.procs import module_command
from bookkeeper.testing.cluster import LocalBookie, LocalCluster
from bookkeeper.testing.zookeeper import four_letter_word

T = TypeVar("T")
R = TypeVar("R")

# Creates (and closes, opens, deletes) in flight: enough to keep ZooKeeper and the client's
# executor busy (a create is a few ZooKeeper round trips plus a scrypt hash), few enough that
# one op's latency is its own and not a queue's. An application creating ledgers in bulk (a
# stream per tenant) has a few dozen in flight, not thousands.
OPS_IN_FLIGHT = 64
ADD_WINDOW = 1000  # adds in flight in the write phases (round-robin over the handles)
CREATES_PER_S = 20.0  # phase 5: the background create rate whose cost to the writes is measured
CREATE_PAIRS = 4  # phase 5: slices without and with creates, in ABBA order
RECOVERY_SET_MAX = 1000  # phase 6: ledgers left open by a gone writer, recovered (a separate set)
LOAD_LEDGERS = 10  # phase 7: the ledgers written while the others are deleted
IDLE_MIN_S, IDLE_MAX_S = 1.0, 10.0  # phase 3 lasts --seconds / 4 within these
GC_DRAIN_TIMEOUT_S = 300.0  # phase 7: forced passes until the bookies hold none of the deleted
HELD_FOR_METADATA = 100  # --metadata: real ledgers the bookies hold while the pass runs
METADATA_BATCH = 200  # --metadata: znode creates per multi-op (~100 KB, far below jute.maxbuffer)
METADATA_IN_FLIGHT = 8  # --metadata: multi-ops in flight on one kazoo session
# Allocated memory (RssAnon) moves by allocator arenas and by what freed memory gets reused:
# below this many ledgers that noise exceeds what they hold, and per-ledger memory is None.
RSS_MIN_LEDGERS = 1000
WARM_UP_LEDGERS = 16  # created, written, closed, opened and deleted before the first N
PASSWORD = b"bench-ledgers"
# The shards' loop probe (bookkeeper/bookie/metrics.py LoopLag): a phase's row gets each one's
# largest value as `<key>_s`: the lag, the part of it not spent waiting for a CPU, and the part
# of that asleep (the GIL, a blocking call).
LOOP_FIGURES = {"loop_lag_max": "bookkeeper_shard_loop_lag_seconds",
                "loop_stall_max": "bookkeeper_shard_loop_stall_seconds",
                "loop_blocked_max": "bookkeeper_shard_loop_blocked_seconds"}
WRITE_CACHE = "bookkeeper_write_cache_bytes"
GC_PATH = "/api/v1/bookie/gc"

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def new_ledger(bk: BookKeeper) -> Awaitable[WriteHandle]:
    """One ledger as every phase makes them: 3/2/2, CRC32C, a password (hashed, as in production)."""
    return bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=PASSWORD)


class PyGcClock:
    """Seconds spent in Python's cyclic garbage collector (gc.callbacks), in every thread.

    Why: a handle is a cluster of objects (futures, callbacks, timers); with 10^4 of them the
    collector's generation-2 passes walk them all, and that time lands on the write path."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._t0


def parse_mntr(text: str) -> dict[str, float]:
    """The numeric fields of ZooKeeper's `mntr` answer (`key<TAB>value` lines)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.partition("\t")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            continue
    return out


def parse_metrics(text: str) -> Scrape:
    """Prometheus text as {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def histogram_quantile(first: Scrape, last: Scrape, family: str, q: float) -> float | None:
    """The q-quantile of a histogram over the observations made between two scrapes, summed
    over every series (shard): the smallest bucket bound holding that share of them (an upper
    bound, as Prometheus buckets allow). None when nothing was observed."""
    grew: dict[float, float] = {}
    for key, v in last.items():
        if key[0] == family + "_bucket":
            le = float(dict(key[1])["le"])
            grew[le] = grew.get(le, 0.0) + v - first.get(key, 0.0)
    total = grew.get(float("inf"), 0.0)
    if total <= 0:
        return None
    return min(le for le, n in grew.items() if n >= q * total)


def loop_maxima(first: Scrape, last: Scrape) -> dict[str, float | None]:
    """The shards' largest loop lag, stall and blocked time (seconds) between two scrapes, as
    `loop_lag_max_s`, `loop_stall_max_s`, `loop_blocked_max_s`: the smallest histogram bucket
    bound holding every observation (an upper bound of the maximum); None for a histogram the
    bookies do not export."""
    return {f"{key}_s": histogram_quantile(first, last, family, 1.0) for key, family in LOOP_FIGURES.items()}


def shard_sum(answers: Sequence[dict[str, Any]], key: str) -> float | None:
    """A key of forced passes' per-shard answers summed over every bookie's shards; None when
    no shard reports it (a bookie older than the figure)."""
    found = [shard[key] for a in answers for shard in a.get("shards", []) if isinstance(shard.get(key), (int, float))]
    return float(sum(found)) if found else None


def bookie_default_s(name: str) -> float:
    """An interval of the bookie's config, as the bench's bookies run it (not set: the default)."""
    return cast(float, next(f.default for f in dataclasses.fields(BookieConfig) if f.name == name))


def _summed(acc: dict[str, Any], fig: dict[str, Any], ops: int) -> dict[str, Any]:
    """Probe.figures of several slices as one: seconds and per-op figures weighted by each
    slice's ops (acc holds the running result, with its ops under "_ops"; {} to start)."""
    if not acc:
        return {**fig, "_ops": ops}
    total = acc["_ops"] + ops

    def mix(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        return round((a * acc["_ops"] + b * ops) / total, 3) if total else None
    out = dict(acc)
    out["_ops"] = total
    out["seconds"] = round(acc["seconds"] + fig["seconds"], 3)
    out["cpu_us_per_op"] = {k: mix(v, fig["cpu_us_per_op"].get(k)) for k, v in acc["cpu_us_per_op"].items()}
    out["cpu_percent"] = {k: round((v * acc["seconds"] + fig["cpu_percent"].get(k, 0.0) * fig["seconds"])
                                   / out["seconds"], 1) for k, v in acc["cpu_percent"].items()}
    out["zk_requests_per_op"] = mix(acc["zk_requests_per_op"], fig["zk_requests_per_op"])
    out["zk_requests_per_s"] = round((acc["zk_requests_per_s"] * acc["seconds"]
                                      + fig["zk_requests_per_s"] * fig["seconds"]) / out["seconds"], 1)
    out["py_gc_us_per_op"] = mix(acc["py_gc_us_per_op"], fig["py_gc_us_per_op"])
    return out


def per_op(value: float, ops: int) -> float | None:
    """value / ops, rounded; None for a phase of no ops (idle), whose figures are rates."""
    return round(value / ops, 3) if ops else None


class Probe:
    """Reads the cluster's processes (CPU, RSS), ZooKeeper's counters and the bookies' admin
    HTTP. Lives in the bench's process; blocking reads go to its own small thread pool, so
    they never take the client's executor threads (its ZooKeeper calls and hashes)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.bookies: list[LocalBookie] = cluster.bookies
        self.pool = ThreadPoolExecutor(max_workers=len(self.bookies) + 1, thread_name_prefix="bench-probe")
        self.py_gc = PyGcClock()

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: this process, each bookie (supervisor + shards), ZooKeeper."""
        out = {"client": time.process_time()}
        for i, b in enumerate(self.bookies):
            out[f"bookie{i}"] = sum(cpu_seconds(p) or 0.0 for p in [b.pid or 0, *b.shard_pids()] if p)
        out["zookeeper"] = cpu_seconds(self.cluster.zk.pid or 0) or 0.0
        return out

    def shard_rss_anon_bytes(self) -> int:
        """The shards' allocated memory (RssAnon), summed."""
        return sum(rss_anon_kb(p) or 0 for b in self.bookies for p in b.shard_pids()) * 1024

    def mntr(self) -> dict[str, float]:
        """ZooKeeper's counters now (`mntr`: the harness whitelists every four-letter word)."""
        zk = self.cluster.zk
        return parse_mntr(four_letter_word(zk.address, zk.port, "mntr"))

    def snapshot(self) -> dict[str, Any]:
        """What `figures` takes differences of: time, CPU, ZooKeeper's counters, Python GC time."""
        return {"t": time.perf_counter(), "cpu": self.cpu(), "zk": self.mntr(), "py_gc": self.py_gc.total_s}

    def figures(self, before: dict[str, Any], ops: int) -> dict[str, Any]:
        """Since `before`: each process's CPU per op (us) and CPU use (% of one core), ZooKeeper
        requests per op, Python GC per op (us); per-op figures are None when ops is 0."""
        after = self.snapshot()
        dt = after["t"] - before["t"]
        used = {k: after["cpu"][k] - before["cpu"].get(k, 0.0) for k in after["cpu"]}
        zk_in = after["zk"].get("zk_packets_received", 0.0) - before["zk"].get("zk_packets_received", 0.0)
        return {"seconds": round(dt, 3),
                "cpu_us_per_op": {k: per_op(v * 1e6, ops) for k, v in used.items()},
                "cpu_percent": {k: round(v / dt * 100, 1) for k, v in used.items()},
                "zk_requests_per_op": per_op(zk_in, ops), "zk_requests_per_s": round(zk_in / dt, 1),
                "py_gc_us_per_op": per_op((after["py_gc"] - before["py_gc"]) * 1e6, ops)}

    def _admin(self, b: LocalBookie, method: str, path: str, timeout_s: float = 30.0) -> Any:
        return admin_request(f"{b.address}:{b.http_port}", method, path, timeout_s=timeout_s)

    async def _each(self, fn: Callable[[LocalBookie], R]) -> list[R]:
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.run_in_executor(self.pool, fn, b) for b in self.bookies)))

    async def scrape(self) -> list[Scrape]:
        """Every bookie's /metrics."""
        return await self._each(lambda b: parse_metrics(self._admin(b, "GET", "/metrics")))

    async def write_cache_bytes(self) -> float:
        """Bytes in every shard's write cache (entries added, not yet checkpointed)."""
        return sum(v for s in await self.scrape() for (name, _), v in s.items() if name == WRITE_CACHE)

    async def empty_write_caches(self) -> float:
        """Waits (at most two checkpoint intervals) for the write caches to be flushed; their bytes then."""
        deadline = time.perf_counter() + 2 * bookie_default_s("checkpoint_interval_s")
        while (cached := await self.write_cache_bytes()) > 0 and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
        return cached

    async def held(self) -> list[int]:
        """The ledgers each bookie holds (GET /api/v1/bookie/info)."""
        return await self._each(lambda b: int(self._admin(b, "GET", "/api/v1/bookie/info")["ledgers"]))

    async def gc_pass(self) -> dict[str, Any]:
        """One forced GC pass on every bookie at once: its duration (the slowest shard's, as the
        bookies answer it, and of that the part that finds and drops deleted ledgers), wall time,
        the ZooKeeper reads, buckets and ledgers the shards report (None: not reported), the
        requests ZooKeeper received meanwhile (pings included) and the bookies' CPU (ms)."""
        before = self.snapshot()
        answers = await self._each(lambda b: self._admin(b, "POST", GC_PATH, timeout_s=3600.0))
        fig = self.figures(before, 1)
        drop = [s["drop_duration_s"] for a in answers for s in a.get("shards", []) if "drop_duration_s" in s]
        return {"duration_s": max(float(a.get("duration_s", 0.0)) for a in answers),
                "drop_duration_s": max(drop) if drop else None, "wall_s": fig["seconds"],
                "zk_reads": shard_sum(answers, "zk_reads"), "buckets_checked": shard_sum(answers, "buckets_checked"),
                "ledgers_touched": shard_sum(answers, "ledgers_touched"), "zk_requests": fig["zk_requests_per_op"],
                "ledgers_deleted": sum(int(a.get("ledgers_deleted", 0)) for a in answers),
                "bookie_cpu_ms": {k: round(v / 1000, 2) for k, v in fig["cpu_us_per_op"].items()
                                  if k.startswith("bookie") and v is not None}}

    async def collect_until(self, held_at_most: int, timeout_s: float) -> tuple[int, float]:
        """Forced GC passes until every bookie holds at most `held_at_most` ledgers: (passes, s)."""
        t0 = time.perf_counter()
        passes = 0
        while True:
            await self.gc_pass()
            passes += 1
            held = await self.held()
            if max(held) <= held_at_most:
                return passes, time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"bookies still hold {held} ledgers (want <= {held_at_most}) after "
                                   f"{passes} forced GC passes in {timeout_s:.0f} s")


class LoopLag:
    """The shards' loop figures over a phase (loop_maxima): every bookie scraped at its start
    and at its end (histograms: the two scrapes hold every observation between them)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.first: Scrape = {}

    async def start(self) -> None:
        self.first = self._merged(await self.probe.scrape())

    async def stop(self) -> dict[str, float | None]:
        return loop_maxima(self.first, self._merged(await self.probe.scrape()))

    @staticmethod
    def _merged(scrapes: list[Scrape]) -> Scrape:
        """One scrape of every bookie, each sample labelled with its bookie."""
        return {(name, (*labels, ("bookie", str(i)))): v
                for i, s in enumerate(scrapes) for (name, labels), v in s.items()}


async def in_flight(items: Iterable[T], op: Callable[[T], Awaitable[R]],
                    window: int) -> tuple[list[R], Latencies, float]:
    """op over every item, `window` at once: (results in item order, latencies, seconds)."""
    todo = list(enumerate(items))
    results: list[Any] = [None] * len(todo)
    lat = histogram()
    it = iter(todo)
    perf = time.perf_counter

    async def worker() -> None:
        for i, item in it:
            t = perf()
            results[i] = await op(item)
            lat.counts[int((perf() - t) * 1e6)] += 1

    t0 = perf()
    await asyncio.gather(*(worker() for _ in range(min(window, len(todo)))))
    return results, lat, perf() - t0


async def add_load(handles: Sequence[WriteHandle], payload: bytes, window: int, lat: Latencies,
                   running: Callable[[float], bool]) -> tuple[int, float]:
    """`window` adds in flight, round-robin over the handles, while running(now): each ack
    records its latency and sends the next add. Returns (adds acknowledged, seconds)."""
    finished = asyncio.get_running_loop().create_future()
    counts = lat.counts
    perf = time.perf_counter
    sent = acked = 0
    inflight = 0
    error: BaseException | None = None

    def send() -> None:
        nonlocal sent, inflight
        fut = handles[sent % len(handles)].add_entry_async(payload)
        sent += 1
        inflight += 1
        fut.add_done_callback(partial(done, perf()))

    def done(t: float, fut: asyncio.Future[int]) -> None:
        nonlocal acked, inflight, error
        now = perf()
        inflight -= 1
        if fut.exception() is not None:
            error = error or fut.exception()
        else:
            counts[int((now - t) * 1e6)] += 1
            acked += 1
        if error is None and running(now):
            try:
                send()
                return
            except Exception as e:  # noqa: BLE001 - a refused add ends the load; add_load raises it
                error = e
        if inflight == 0 and not finished.done():
            finished.set_result(None)

    t0 = perf()
    for _ in range(window):
        send()
    await finished
    if error is not None:
        raise error
    return acked, perf() - t0


async def create_at_rate(bk: BookKeeper, rate: float, until: float) -> tuple[list[WriteHandle], Latencies, float]:
    """Creates started at `rate` per second until `until` (perf_counter), each on its own
    (a slow create does not delay the next): (handles, create latencies, seconds to the last)."""
    lat = histogram()
    made: list[WriteHandle] = []
    perf = time.perf_counter

    async def one() -> None:
        t = perf()
        made.append(await new_ledger(bk))
        lat.counts[int((perf() - t) * 1e6)] += 1

    tasks: list[asyncio.Task[None]] = []
    t0 = perf()
    while (due := t0 + len(tasks) / rate) < until:
        await asyncio.sleep(max(0.0, due - perf()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return made, lat, perf() - t0


class Phases:
    """The seven phases at one N (module docstring), in order. `rows`: one rate each (ops/s,
    latency, CPU and ZooKeeper requests per op); `summary`: the figures that are no rate
    (memory, znodes and bytes per ledger, idle CPU, the idle GC pass)."""

    def __init__(self, probe: Probe, bk: BookKeeper, n: int, *, seconds: float, size: int) -> None:
        self.probe = probe
        self.bk = bk
        self.n = n
        self.seconds = seconds
        self.size = size
        self.payload = os.urandom(size)
        self.idle_s = min(IDLE_MAX_S, max(IDLE_MIN_S, seconds / 4))
        self.rows: list[BenchResult] = []
        self.summary: dict[str, Any] = {}
        self.lag = LoopLag(probe)

    async def run(self) -> None:
        handles = await self.create()
        primer = await self.first_add(handles)
        await self.idle()
        write_lat, write_rate = await self.write(handles)
        made = await self.write_while_creating(handles, write_rate)
        orphans = await self.close_and_open(handles)
        await self.timed("delete", orphans + [lh.ledger_id for lh in made], self.bk.delete_ledger)
        await self.delete_under_load([lh.ledger_id for lh in handles] + [primer], write_lat)

    def _row(self, phase: str, ops: int, seconds: float, lat: Latencies, fig: dict[str, Any], adds: int = 0,
             **extra: Any) -> None:
        self.rows.append(BenchResult(f"{self.n} ledgers: {phase}", ops / seconds, adds * self.size / 1e6 / seconds,
                                     latency_ms(lat), {"ledgers": self.n, "phase": phase, "ops": ops, **fig, **extra}))

    async def timed(self, phase: str, items: Iterable[T], op: Callable[[T], Awaitable[R]],
                    window: int = OPS_IN_FLIGHT, adds: int = 0) -> list[R]:
        """op over the items as one measured phase (a row); their results."""
        before = self.probe.snapshot()
        got, lat, dt = await in_flight(items, op, window)
        self._row(phase, len(got), dt, lat, self.probe.figures(before, len(got)), adds)
        return got

    async def load_for(self, handles: Sequence[WriteHandle], lat: Latencies,
                       seconds: float) -> tuple[int, float, dict[str, Any]]:
        """add_load for `seconds`: (adds, seconds, figures per add)."""
        before = self.probe.snapshot()
        end = time.perf_counter() + seconds
        adds, dt = await add_load(handles, self.payload, ADD_WINDOW, lat, lambda now: now < end)
        return adds, dt, self.probe.figures(before, adds)

    def per_ledger_bytes(self, grown_bytes: float, ledgers: int) -> int | None:
        """A memory growth over the ledgers that made it, from RSS_MIN_LEDGERS on (None below)."""
        return round(grown_bytes / ledgers) if self.n >= RSS_MIN_LEDGERS and ledgers else None

    async def create(self) -> list[WriteHandle]:
        """1: N creates; what each ledger adds to the client's RSS and to ZooKeeper."""
        rss0, zk0 = rss_anon_kb(os.getpid()) or 0, self.probe.mntr()
        handles = await self.timed("create", range(self.n), lambda _: new_ledger(self.bk))
        zk1 = self.probe.mntr()
        self.summary.update(
            client_rss_bytes_per_handle=self.per_ledger_bytes(((rss_anon_kb(os.getpid()) or 0) - rss0) * 1024, self.n),
            zk_znodes_per_ledger=round((zk1["zk_znode_count"] - zk0["zk_znode_count"]) / self.n, 3),
            zk_bytes_per_ledger=round((zk1["zk_approximate_data_size"] - zk0["zk_approximate_data_size"]) / self.n, 1))
        return handles

    async def first_add(self, handles: list[WriteHandle]) -> int:
        """2: one add to each; what a stored ledger adds to the shards' allocated memory. A
        ledger is stored on each bookie its entry went to (Qw = 2 of them). The entries wait
        in the write cache until a checkpoint: its growth is not the ledgers' and is taken off.
        The baseline is taken with the caches flushed and then adds made to a primer ledger on
        every bookie (a shard frees its flushed cache's memory at the first add after a
        checkpoint: inside the measurement that drop outweighs what 10^3 ledgers hold).
        Returns the primer's id."""
        await self.probe.empty_write_caches()
        primer = await new_ledger(self.bk)
        for _ in range(3):  # entries rotate over the ensemble (E = 3): every bookie gets one
            await primer.add_entry(self.payload)
        await primer.close()
        cache0 = await self.probe.write_cache_bytes()
        shards0, held0 = self.probe.shard_rss_anon_bytes(), sum(await self.probe.held())
        await self.timed("first add", handles, lambda lh: lh.add_entry(self.payload), ADD_WINDOW, adds=self.n)
        stored = sum(await self.probe.held()) - held0
        grown = self.probe.shard_rss_anon_bytes() - shards0 - (await self.probe.write_cache_bytes() - cache0)
        self.summary.update(ledgers_stored=stored,
                            bookie_rss_bytes_per_stored_ledger=self.per_ledger_bytes(grown, stored))
        return primer.ledger_id

    async def idle(self) -> None:
        """3: idle_s of nothing, then one forced GC pass, its CPU spread over the default interval."""
        before = self.probe.snapshot()
        await asyncio.sleep(self.idle_s)
        idle = self.probe.figures(before, 0)
        gc_pass = await self.probe.gc_pass()
        interval_s = bookie_default_s("gc_interval_s")
        gc_pass["cpu_percent_at_default_interval"] = {k: round(ms / 1000 / interval_s * 100, 3)
                                                      for k, ms in gc_pass["bookie_cpu_ms"].items()}
        self.summary["idle"] = {
            "seconds": idle["seconds"], "cpu_percent": idle["cpu_percent"],
            "zk_requests_per_s": idle["zk_requests_per_s"],
            "gc": {"trigger": f"forced (POST {GC_PATH}); default gc_interval_s {interval_s:g} s", **gc_pass}}

    async def write(self, handles: list[WriteHandle]) -> tuple[Latencies, float]:
        """4: round-robin adds over the N handles; (latencies, adds/s) for phases 5 and 7."""
        await self.lag.start()
        lat = histogram()
        adds, dt, fig = await self.load_for(handles, lat, self.seconds)
        self._row("write", adds, dt, lat, fig, adds, window=ADD_WINDOW, **await self.lag.stop())
        return lat, adds / dt

    async def write_while_creating(self, handles: list[WriteHandle], write_rate: float) -> list[WriteHandle]:
        """5: phase 4's load in CREATE_PAIRS pairs of slices, one without creates and one while
        CREATES_PER_S ledgers/s are created, in the order quiet, busy, busy, quiet, ... so that
        drift (a checkpoint, a burst of another process, this machine's +-15 % between runs of
        one phase), linear drift exactly, falls on both kinds alike; the ratio of their adds/s, each kind's slices summed, is the acceptance figure
        (`ratio_to_write`). The row's rate, latency and per-add figures are those of the
        slices with creates. Returns the ledgers made (closed). write_rate (phase 4's) is
        reported beside it: a ratio across phases, minutes apart, is what this design avoids."""
        slice_s = self.seconds / (2 * CREATE_PAIRS)
        quiet, busy = histogram(), histogram()
        made: list[WriteHandle] = []
        create_lat = histogram()
        totals = {"quiet": [0, 0.0], "busy": [0, 0.0]}
        create_s = 0.0
        fig: dict[str, Any] = {}
        for kind in itertools.islice(itertools.cycle(("quiet", "busy", "busy", "quiet")), 2 * CREATE_PAIRS):
            if kind == "quiet":
                adds, dt, _fig = await self.load_for(handles, quiet, slice_s)
                totals["quiet"][0] += adds
                totals["quiet"][1] += dt
                continue
            before = self.probe.snapshot()
            creating = asyncio.create_task(create_at_rate(self.bk, CREATES_PER_S, time.perf_counter() + slice_s))
            end = time.perf_counter() + slice_s
            adds, dt = await add_load(handles, self.payload, ADD_WINDOW, busy, lambda now: now < end)
            slice_fig = self.probe.figures(before, adds)
            got, lat, dt_create = await creating
            made += got
            create_s += dt_create
            for us, n in lat.counts.items():
                create_lat.counts[us] += n
            totals["busy"][0] += adds
            totals["busy"][1] += dt
            fig = _summed(fig, slice_fig, adds)
        busy_adds, busy_s = totals["busy"]
        quiet_adds, quiet_s = totals["quiet"]
        fig.pop("_ops", None)
        self._row("write + creates", int(busy_adds), busy_s, busy, fig, int(busy_adds), window=ADD_WINDOW,
                  creates_per_s_asked=CREATES_PER_S, creates_per_s=round(len(made) / create_s, 1),
                  create_latency_ms=latency_ms(create_lat), slices=2 * CREATE_PAIRS,
                  adds_per_s_without=round(quiet_adds / quiet_s, 1), write_phase_adds_per_s=round(write_rate, 1),
                  ratio_to_write=round(busy_adds / busy_s / (quiet_adds / quiet_s), 3))
        await in_flight(made, lambda lh: lh.close(), OPS_IN_FLIGHT)
        return made

    async def close_and_open(self, handles: list[WriteHandle]) -> list[int]:
        """6: close the N; recovery-open min(N, RECOVERY_SET_MAX) ledgers of a writer that is
        gone (another client, closed with its ledgers open, one entry each); open the N closed
        ones without recovery. Returns the recovered ledgers' ids."""
        async with await BookKeeper.connect(self.probe.cluster.metadata_uri) as gone:
            orphans, _, _ = await in_flight(range(min(self.n, RECOVERY_SET_MAX)),
                                            lambda _: new_ledger(gone), OPS_IN_FLIGHT)
            await in_flight(orphans, lambda lh: lh.add_entry(self.payload), ADD_WINDOW)
        ids = [lh.ledger_id for lh in orphans]
        await self.timed("close", handles, lambda lh: lh.close())
        recovered = await self.timed("recovery open", ids, lambda lid: self.bk.open_ledger(lid, password=PASSWORD))
        if any(rh.last_add_confirmed != 0 for rh in recovered):
            raise RuntimeError("a recovered ledger lost its one entry")
        await self.timed("open", [lh.ledger_id for lh in handles],
                         lambda lid: self.bk.open_ledger(lid, password=PASSWORD, recovery=False))
        return ids

    async def delete_under_load(self, doomed: list[int], write_lat: Latencies) -> None:
        """7: LOAD_LEDGERS ledgers written for idle_s (the baseline), then written on while every
        other ledger of this N is deleted and forced GC passes run until the bookies hold only
        the load ledgers (each spans the three bookies, E = 3 of 3, so each bookie holds all of
        them); then those go too, and every shard is empty for the next N."""
        probe = self.probe
        loaders, _, _ = await in_flight(range(LOAD_LEDGERS), lambda _: new_ledger(self.bk), OPS_IN_FLIGHT)
        baseline, during = histogram(), histogram()
        end = time.perf_counter() + self.idle_s
        await add_load(loaders, self.payload, ADD_WINDOW, baseline, lambda now: now < end)
        stop = asyncio.Event()
        load = asyncio.create_task(add_load(loaders, self.payload, ADD_WINDOW, during, lambda now: not stop.is_set()))
        await self.lag.start()
        before = probe.snapshot()
        _, lat, dt = await in_flight(doomed, self.bk.delete_ledger, OPS_IN_FLIGHT)
        fig = probe.figures(before, len(doomed))
        passes, drain_s = await probe.collect_until(LOAD_LEDGERS, GC_DRAIN_TIMEOUT_S)
        stop.set()
        await load
        self._row("delete under load", len(doomed), dt, lat, fig, gc_passes=passes, gc_drain_s=round(drain_s, 3),
                  **await self.lag.stop(),
                  add_p99_ms={"baseline": latency_ms(baseline)["p99"], "during": latency_ms(during)["p99"],
                              "write_phase": latency_ms(write_lat)["p99"]})
        await in_flight(loaders, lambda lh: lh.close(), OPS_IN_FLIGHT)
        await in_flight([lh.ledger_id for lh in loaders], self.bk.delete_ledger, OPS_IN_FLIGHT)
        await probe.collect_until(0, GC_DRAIN_TIMEOUT_S)


async def warm_up(probe: Probe, bk: BookKeeper) -> None:
    """Every path once before the first N (connections, executor threads, the bookies' first
    journal and entry-log writes), so the first N's memory and CPU figures are its own."""
    handles, _, _ = await in_flight(range(WARM_UP_LEDGERS), lambda _: new_ledger(bk), OPS_IN_FLIGHT)
    await in_flight(handles, lambda lh: lh.add_entry(b"warm-up"), OPS_IN_FLIGHT)
    await in_flight(handles, lambda lh: lh.close(), OPS_IN_FLIGHT)
    ids = [lh.ledger_id for lh in handles]
    await in_flight(ids, lambda lid: bk.open_ledger(lid, password=PASSWORD), OPS_IN_FLIGHT)
    await in_flight(ids, bk.delete_ledger, OPS_IN_FLIGHT)
    await probe.collect_until(0, GC_DRAIN_TIMEOUT_S)


def populate_metadata(connect: str, root: str, first_id: int, count: int, bookies: list[str]) -> None:
    """`count` closed, empty 3/2/2 ledgers' metadata znodes from first_id up, as the metadata
    store lays them out: parents first, then multi-ops of METADATA_BATCH creates,
    METADATA_IN_FLIGHT of them pipelined on one session. Why multi-ops: kazoo wakes its
    connection thread once per request (~100 us of this process), ZooKeeper is not the limit.
    One password digest for all: scrypt per znode would take hours at 10^6."""
    from kazoo.client import KazooClient

    md = LedgerMetadata(ledger_id=first_id, ensemble_size=3, write_quorum=2, ack_quorum=2, digest=DigestType.CRC32C,
                        password_digest=password_digest(PASSWORD), ensembles={0: bookies[:3]},
                        state=LedgerState.CLOSED, password=PASSWORD)
    end = first_id + count
    zk = KazooClient(hosts=connect, timeout=30.0)
    zk.start(timeout=30.0)
    try:
        for bucket in sorted({ledger_path(root, lid).rsplit("/", 1)[0]
                              for lid in [first_id, *range(first_id - first_id % 10_000 + 10_000, end, 10_000)]}):
            zk.ensure_path(bucket)
        pending: deque[Any] = deque()
        for start in range(first_id, end, METADATA_BATCH):
            tx = zk.transaction()
            for lid in range(start, min(end, start + METADATA_BATCH)):
                tx.create(ledger_path(root, lid), dataclasses.replace(md, ledger_id=lid).serialize())
            pending.append(tx.commit_async())
            if len(pending) >= METADATA_IN_FLIGHT:
                _committed(pending.popleft().get())
        while pending:
            _committed(pending.popleft().get())
    finally:
        zk.stop()
        zk.close()


def _committed(results: list[Any]) -> None:
    """A multi-op's results hold the exception of the op that failed it (the others: rolled back)."""
    for r in results:
        if isinstance(r, Exception):
            raise r


def time_listing(uri: str) -> dict[str, Any]:
    """`bk ledgers list` as a user runs it: seconds to its first line and to its end, lines,
    peak RSS. The peak is the child's VmHWM, read while it runs (it only grows): wait4's
    ru_maxrss would count this process's RSS, which the child had before its exec."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        p = subprocess.Popen(module_command("bookkeeper.cli.main", "ledgers", "list", "--metadata-uri", uri),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        assert p.stdout is not None
        lines = 1 if p.stdout.readline() else 0
        t_first = time.perf_counter() - t0
        peak = peak_rss_mb(p.pid) or 0.0
        for _ in p.stdout:
            lines += 1
            if lines % 1000 == 0:
                peak = max(peak, peak_rss_mb(p.pid) or 0.0)
        peak = max(peak, peak_rss_mb(p.pid) or 0.0)  # at its end, if it has not exited yet
        returncode = p.wait()
        total = time.perf_counter() - t0
        if returncode != 0:
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-500:]
            raise RuntimeError(f"bk ledgers list exited {returncode}: {tail}")
    return {"first_line_s": round(t_first, 3), "total_s": round(total, 3), "lines": lines, "peak_rss_mb": peak}


def zk_heap(cluster: LocalCluster) -> str | None:
    """ZooKeeper's -Xmx, from its command line (None: not set, or not running)."""
    try:
        args = Path(f"/proc/{cluster.zk.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((a[4:].decode() for a in args if a.startswith(b"-Xmx")), None)


def zk_death(cluster: LocalCluster, heap: str | None) -> str:
    """Why ZooKeeper ended, for the report: its log's OutOfMemoryError line, if any, and its heap."""
    try:
        oom = [line for line in cluster.zk.log_path.read_text(errors="replace").splitlines() if "OutOfMemory" in line]
    except OSError:
        oom = []
    return f"ZooKeeper died ({oom[-1].strip() if oom else 'see its log'}); its heap: -Xmx{heap or '?'}"


async def metadata_scale(probe: Probe, bk: BookKeeper, count: int, zk_heap_max: str | None) -> dict[str, Any]:
    """--metadata: GC passes before and after `count` ledgers' metadata appear, a listing over
    them. ZooKeeper dying on the way (its heap) is a figure too: {"ledgers", "error"}."""
    held, _, _ = await in_flight(range(HELD_FOR_METADATA), lambda _: new_ledger(bk), OPS_IN_FLIGHT)
    await in_flight(held, lambda lh: lh.add_entry(b"x"), OPS_IN_FLIGHT)
    await in_flight(held, lambda lh: lh.close(), OPS_IN_FLIGHT)
    gc_before = await probe.gc_pass()
    cluster = probe.cluster
    _, root = parse_metadata_uri(cluster.metadata_uri)
    first = max(lh.ledger_id for lh in held) + 1  # nothing is created after: no id can collide
    zk0 = probe.mntr()
    t0 = time.perf_counter()
    try:
        await asyncio.get_running_loop().run_in_executor(
            probe.pool, populate_metadata, cluster.zk.connect_string, root, first, count,
            [b.bookie_id for b in probe.bookies])
    except Exception:
        if cluster.zk.is_running():
            raise
        return {"ledgers": count, "error": zk_death(cluster, zk_heap_max)}
    populate_s = time.perf_counter() - t0
    zk1 = probe.mntr()
    loop = asyncio.get_running_loop()
    return {"ledgers": count, "populate_s": round(populate_s, 3), "populate_per_s": round(count / populate_s, 1),
            "zk_znodes": zk1.get("zk_znode_count"), "zk_bytes": zk1.get("zk_approximate_data_size"),
            "zk_bytes_per_ledger": round((zk1["zk_approximate_data_size"] - zk0["zk_approximate_data_size"])
                                         / count, 1),
            "held_by_bookies": HELD_FOR_METADATA, "gc_before": gc_before, "gc_after": await probe.gc_pass(),
            "list": await loop.run_in_executor(probe.pool, time_listing, cluster.metadata_uri)}


def ledgers_bench(directory: str, *, counts: Sequence[int], seconds: float, size: int, sync: str,
                  metadata: int = 0, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The whole run (module docstring): result rows, per-N summaries, the --metadata figures."""
    cluster = LocalCluster(tempfile.mkdtemp(prefix="ledgers-", dir=directory), bookies=3, shards=1, http_ports=True,
                           journal_sync=sync, bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    probe = Probe(cluster)
    gc.callbacks.append(probe.py_gc)
    out: dict[str, Any] = {"rows": [], "per_ledgers": {}, "metadata": None}
    try:
        async def main() -> None:
            async with await BookKeeper.connect(cluster.metadata_uri) as bk:
                progress("warming up ...")
                await warm_up(probe, bk)
                for n in counts:
                    progress(f"{n:,} ledgers ...")
                    phases = Phases(probe, bk, n, seconds=seconds, size=size)
                    await phases.run()
                    out["rows"] += phases.rows
                    out["per_ledgers"][str(n)] = phases.summary
                if metadata:
                    progress(f"{metadata:,} ledgers' metadata ...")
                    out["metadata"] = await metadata_scale(probe, bk, metadata, out["setup"]["zookeeper_heap_max"])
        out["setup"] = {"bookies": len(cluster.bookies), "shards_per_bookie": 1, "ensemble": "3/2/2",
                        "entry_bytes": size, "sync": sync, "ops_in_flight": OPS_IN_FLIGHT, "add_window": ADD_WINDOW,
                        "zookeeper_heap_max": zk_heap(cluster)}
        uvloop.run(main())
        out["peak_rss_mb"] = {"client": peak_rss_mb(os.getpid()), "zookeeper": peak_rss_mb(cluster.zk.pid or 0),
                              **{f"bookie{i}-shards": sum(peak_rss_mb(p) or 0.0 for p in b.shard_pids())
                                 for i, b in enumerate(cluster.bookies)}}
    finally:
        gc.callbacks.remove(probe.py_gc)
        probe.pool.shutdown(wait=False)
        cluster.stop()
    return out


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ledgers wants counts like 10,100,1000, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"--ledgers wants counts >= 1, got {text!r}")
    return counts


def _na(v: Any, fmt: str = "{:,.1f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _gc_text(gcp: dict[str, Any]) -> str:
    return (f"GC pass {gcp['duration_s']} s (finding and dropping: {_na(gcp['drop_duration_s'], '{}')} s), "
            f"ZooKeeper reads {_na(gcp['zk_reads'], '{:,.0f}')} over {_na(gcp['buckets_checked'], '{:,.0f}')} "
            f"buckets, ZooKeeper requests meanwhile {_na(gcp['zk_requests'], '{:,.0f}')}")


def _print_rows(results: list[dict[str, Any]]) -> None:
    table = cli_table("N", "phase", "ops/s", "p99 ms", "client", "bookies", "ZK", "ZK req", "py GC",
                      caption="CPU us per op (client, each bookie, ZooKeeper), ZooKeeper requests per op, "
                              "Python GC us per op")
    for r in results:
        cpu = r["cpu_us_per_op"]
        bookies = "/".join(_na(v, "{:,.0f}") for k, v in cpu.items() if k.startswith("bookie"))
        table.add_row(f"{r['ledgers']:,}", r["phase"], f"{r['ops_per_s']:,.0f}", str(r["latency_ms"]["p99"]),
                      _na(cpu["client"], "{:,.0f}"), bookies, _na(cpu["zookeeper"], "{:,.0f}"),
                      _na(r["zk_requests_per_op"], "{:.2f}"), _na(r["py_gc_us_per_op"], "{:.1f}"))
    out.print(table)
    for r in results:
        notes = {k: r[k] for k in ("ratio_to_write", "creates_per_s", "add_p99_ms", "gc_passes", "gc_drain_s",
                                   "loop_lag_max_s", "loop_stall_max_s", "loop_blocked_max_s") if k in r}
        if notes:
            out.print(f"{r['name']}: " + ", ".join(f"{k}={'n/a' if v is None else v}" for k, v in notes.items()),
                      soft_wrap=True)


def _print_per_ledgers(per_ledgers: dict[str, dict[str, Any]]) -> None:
    for n, s in per_ledgers.items():
        idle, gcp = s["idle"], s["idle"]["gc"]
        out.print(f"{n} ledgers: client RSS {_na(s['client_rss_bytes_per_handle'], '{:,}')} B/handle, bookie shard "
                  f"RSS {_na(s['bookie_rss_bytes_per_stored_ledger'], '{:,}')} B/stored ledger "
                  f"({s['ledgers_stored']:,} stored), "
                  f"ZooKeeper {s['zk_znodes_per_ledger']} znodes and {s['zk_bytes_per_ledger']:,} B/ledger",
                  soft_wrap=True)
        out.print(f"{n} ledgers idle {idle['seconds']} s: CPU % " + ", ".join(
                  f"{k} {v}" for k, v in idle["cpu_percent"].items()) + f"; ZooKeeper {idle['zk_requests_per_s']} "
                  f"req/s; {_gc_text(gcp)}; bookie CPU % at the default interval "
                  f"{gcp['cpu_percent_at_default_interval']}", soft_wrap=True)


def _print_metadata(md: dict[str, Any]) -> None:
    if "error" in md:
        out.print(f"metadata {md['ledgers']:,} ledgers: {md['error']}", soft_wrap=True)
        return
    lst = md["list"]
    out.print(f"metadata {md['ledgers']:,} ledgers: written at {md['populate_per_s']:,.0f}/s, "
              f"{md['zk_bytes_per_ledger']:,} B each; bookies holding {md['held_by_bookies']} ledgers, before: "
              f"{_gc_text(md['gc_before'])}; after: {_gc_text(md['gc_after'])}; `bk ledgers list`: first line "
              f"{lst['first_line_s']} s, all {lst['lines']:,} in {lst['total_s']} s, peak RSS {lst['peak_rss_mb']} MiB",
              soft_wrap=True)


def run_ledgers_cli(args: argparse.Namespace) -> int:
    """`bk bench ledgers`: a table for people, one JSON object with --json (module docstring)."""
    counts = _counts(args.ledgers)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bk-bench-", dir=directory)
    size = (args.size or [100])[0]
    try:
        if args.json:
            run = ledgers_bench(work, counts=counts, seconds=args.seconds, size=size, sync=args.sync,
                                metadata=args.metadata)
        else:
            with err.status("bk bench ledgers ...", spinner="dots") as status:
                run = ledgers_bench(work, counts=counts, seconds=args.seconds, size=size, sync=args.sync,
                                    metadata=args.metadata,
                                    progress=lambda text: status.update(f"bk bench ledgers: {text}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = [r.to_json() for r in run["rows"]]
    doc = {**results[0], "bench": "ledgers", "results": results, "per_ledgers": run["per_ledgers"],
           "metadata": run["metadata"], "setup": run["setup"], "peak_rss_mb": run["peak_rss_mb"],
           "client_peak_rss_mb": self_rss()}
    if args.json:
        print(json.dumps(doc))
    else:
        _print_rows(results)
        _print_per_ledgers(run["per_ledgers"])
        if run["metadata"]:
            _print_metadata(run["metadata"])
        out.print("peak RSS (MiB) " + ", ".join(f"{k}={v}" for k, v in run["peak_rss_mb"].items()))
    return 1 if doc["metadata"] and "error" in doc["metadata"] else 0
