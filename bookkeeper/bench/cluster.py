"""Benchmarks over real bookie processes: one bookie, a 3/2/2 cluster with a tailing reader,
and cold catch-up reads. The client runs in this process (uvloop); bookies are the real
`bk bookie` processes of a LocalCluster under the bench directory.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import uvloop

from bookkeeper.bench import BenchResult, Latencies, ProcessWatch, histogram, latency_ms, peak_rss_mb
from bookkeeper._ext.client import DIGEST_CRC32C, encode_entry
from bookkeeper.client import BookKeeper
from bookkeeper.proto import NO_KEY, Op, shard_for_ledger
from bookkeeper.testing.cluster import LocalBookie, LocalCluster

PRODUCTION_JOURNAL = {"journal_preallocate_bytes": 64 << 20}  # the bookie default, not the test harness's


def cluster_processes(cluster: LocalCluster) -> dict[str, int]:
    """The processes a run involves: this client, and every bookie's supervisor and shards."""
    out = {f"client[{os.getpid()}]": os.getpid()}
    for i, b in enumerate(cluster.bookies):
        if b.pid:
            out[f"bookie{i}-supervisor[{b.pid}]"] = b.pid
            for pid in b.shard_pids():
                out[f"bookie{i}-shard[{pid}]"] = pid
    return out


def cluster_rss(cluster: LocalCluster) -> dict[str, float | None]:
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


Done = Callable[[float, int, "BaseException | None"], None]  # (sent or intended time, entry id, error)


class HandleAdds:
    """The client driver: adds through a write handle; completion through its future."""

    def __init__(self, lh: Any) -> None:
        self.lh = lh
        self.on_done: Done | None = None

    def start(self, on_done: Done) -> None:
        self.on_done = on_done

    def send(self, data: bytes, t: float) -> None:
        on_done = self.on_done
        assert on_done is not None

        def settled(f: asyncio.Future) -> None:
            err = f.exception()
            on_done(t, -1 if err else f.result(), err)
        self.lh.add_entry_async(data).add_done_callback(settled)


class CallbackAdds(HandleAdds):
    """The callback driver: add_entry_callback, no future per add."""

    def send(self, data: bytes, t: float) -> None:
        on_done = self.on_done
        assert on_done is not None
        self.lh.add_entry_callback(data, lambda eid, err: on_done(t, eid, err))


class BatchAdds(HandleAdds):
    """The batch driver: what is sent in one loop turn (at most `batch` entries) goes as one
    add_entries_async call, one future for the batch."""

    def __init__(self, lh: Any, batch: int = 256) -> None:
        super().__init__(lh)
        self.batch = batch
        self.pending: list[bytes] = []
        self.times: list[float] = []
        self.scheduled = False

    def send(self, data: bytes, t: float) -> None:
        self.pending.append(data)
        self.times.append(t)
        if len(self.pending) >= self.batch:
            self.flush()
        elif not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if not self.pending:
            return
        on_done, times = self.on_done, self.times
        assert on_done is not None
        fut = self.lh.add_entries_async(self.pending)
        self.pending, self.times = [], []

        def settled(f: asyncio.Future) -> None:
            err = f.exception()
            ids = f.result() if err is None else [-1] * len(times)
            for t, eid in zip(times, ids):
                on_done(t, eid, err)
        fut.add_done_callback(settled)


def handle_adds(lh: Any, driver: str) -> HandleAdds:
    """A sender through a write handle: "client" (a future per add), "callback" or "batch"."""
    return {"client": HandleAdds, "callback": CallbackAdds, "batch": BatchAdds}[driver](lh)


class _RawAdds:
    """The raw driver: adds to one ledger over the wire protocol straight from the client's
    Cython pipe, with no write handle, no quorum tracking and no future, so that the bookie,
    not the load generator, is what the figures measure (the CPU each process spends per add
    is printed beside the figures; docs/performance.md)."""

    def __init__(self, bk: BookKeeper, lh: Any) -> None:
        self.ledger_id = lh.ledger_id
        self.key = lh._key
        self.conn = bk.pool.connection(lh.metadata.last_ensemble[0], lh.ledger_id)
        self.next = 0
        self.length = 0
        self.on_done: Done | None = None

    def start(self, on_done: Done) -> None:
        self.on_done = on_done

    def _complete(self, t: float, resp: tuple | None, err: BaseException | None) -> None:
        self.on_done(t, -1 if resp is None else resp[4], err)  # type: ignore[misc]

    def send(self, data: bytes, t: float) -> None:
        eid = self.next
        self.next += 1
        self.length += len(data)
        payload = encode_entry(DIGEST_CRC32C, b"", self.ledger_id, eid, eid - 1, self.length, data)
        if self.conn.pipe.send(Op.ADD_ENTRY, 0, self.ledger_id, eid, self.key, 0, payload, self._complete, t, 30.0):
            self.conn.ensure_connecting()


async def closed_loop(senders: list, payload: bytes, seconds: float, window: int, lat: Latencies,
                       acked_at: dict[int, float] | None = None) -> tuple[int, float]:
    """W adds in flight: each completion records its latency and sends the next add, so the
    generator costs one callback per add (no task wakeup, no polling)."""
    finished = asyncio.get_running_loop().create_future()
    counts = lat.counts
    perf = time.perf_counter
    n = i = 0
    inflight = window
    error: BaseException | None = None
    t0 = perf()
    t_end = t0 + seconds

    def send(t: float) -> bool:
        """Send the next add; a sender that raises ends the run (its error is the result)."""
        nonlocal i, error
        try:
            senders[i % len(senders)].send(payload, t)
        except Exception as e:  # noqa: BLE001 - re-raised by closed_loop
            error = error or e
            return False
        i += 1
        return True

    def on_done(t: float, eid: int, err: BaseException | None) -> None:
        nonlocal n, inflight, error
        now = perf()
        if err is not None:
            error = error or err
        else:
            counts[int((now - t) * 1e6)] += 1
            n += 1
            if acked_at is not None:
                acked_at[eid] = now
        if now < t_end and error is None and send(now):
            return
        inflight -= 1
        if inflight == 0 and not finished.done():
            finished.set_result(None)

    for s in senders:
        s.start(on_done)
    for _ in range(window):
        if not send(perf()):
            inflight -= 1
    if inflight == 0:
        finished.set_result(None)
    await finished
    if error is not None:
        raise error
    return n, perf() - t0


async def _open_loop(senders: list, payload: bytes, seconds: float, rate: float, lat: Latencies) -> tuple[int, float]:
    """Send at a fixed rate; latency counts from each add's intended send time (coordinated
    omission corrected: a late generator or a stalled bookie both count against the figure)."""
    finished = asyncio.get_running_loop().create_future()
    counts = lat.counts
    perf = time.perf_counter
    inflight = 0
    sending = True
    error: BaseException | None = None

    def on_done(t: float, eid: int, err: BaseException | None) -> None:
        nonlocal inflight, error
        inflight -= 1
        if err is not None:
            error = error or err
        else:
            counts[int((perf() - t) * 1e6)] += 1
        if not sending and inflight == 0 and not finished.done():
            finished.set_result(None)

    for s in senders:
        s.start(on_done)
    t0 = perf()
    sent = 0
    while (now := perf()) - t0 < seconds:
        due = int((now - t0) * rate)
        while sent < due:
            senders[sent % len(senders)].send(payload, t0 + sent / rate)
            sent += 1
            inflight += 1
        await asyncio.sleep(0.0005)
    sending = False
    if inflight:
        await finished
    if error is not None:
        raise error
    return sent, perf() - t0


def bookie_bench(directory: str, *, shards: int, size: int, seconds: float, window: int,
                 open_loop_rate: float = 0.0, sync: str = "io_uring", driver: str = "raw") -> list[BenchResult]:
    """One bookie (supervisor + shards), E=Qw=Qa=1, durable adds over loopback, one ledger per shard.

    Phases on the same bookie, seconds / 3 each: closed loop at W=window (the peak), closed
    loop at W=1 (latency of a lone add), open loop at half that peak (latency under load,
    coordinated omission corrected). With open_loop_rate, only an open loop at that rate.
    driver "raw" sends from the client's Cython pipe (_RawAdds), "client" through write handles.
    """
    cluster = LocalCluster(tempfile.mkdtemp(prefix="bookie-", dir=directory), bookies=1, shards=shards,
                           journal_sync=sync, bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    watch = ProcessWatch(cluster_processes(cluster))
    phases: list[tuple[str, int, Latencies, float, dict]] = []
    try:
        async def phase(handles: list, payload: bytes, mode: str, part: float, *, window: int = 0,
                        rate: float = 0.0) -> None:
            lat = histogram()
            before = watch.cpu()
            if rate:
                n, dt = await _open_loop(handles, payload, part, rate, lat)
            else:
                n, dt = await closed_loop(handles, payload, part, window, lat)
            phases.append((mode, n, lat, dt, watch.per_op(before, n, dt)))

        async def main() -> None:
            sampler = asyncio.create_task(watch.sample_rss_every(0.5))
            try:
                async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=1 << 20) as bk:
                    handles = await _ledgers_over_shards(bk, shards, ensemble=1, write_quorum=1, ack_quorum=1)
                    handles = [_RawAdds(bk, lh) if driver == "raw" else handle_adds(lh, driver) for lh in handles]
                    payload = os.urandom(size)
                    if open_loop_rate:
                        await phase(handles, payload, f"open loop {open_loop_rate:,.0f}/s", seconds,
                                    rate=open_loop_rate)
                        return
                    await phase(handles, payload, f"closed loop W={window}", seconds / 3, window=window)
                    await phase(handles, payload, "closed loop W=1", seconds / 3, window=1)
                    rate = phases[0][1] / phases[0][3] / 2
                    await phase(handles, payload, f"open loop {rate:,.0f}/s (half the peak)", seconds / 3, rate=rate)
            finally:
                sampler.cancel()
        uvloop.run(main())
        rss = cluster_rss(cluster)
    finally:
        cluster.stop()
    rss_over_run = {k: v for k, v in watch.rss_summary().items() if "shard" in k}
    return [BenchResult(f"bookie {shards} shard(s) {size} B {mode}, {driver} driver", n / dt, n * size / dt / 1e6,
                        latency_ms(lat), {"shards": shards, "entry_bytes": size, "mode": mode, "driver": driver,
                                          "sync": sync, "cpu": cpu, "shard_rss_mb_over_run": rss_over_run,
                                          "peak_rss_mb": rss})
            for mode, n, lat, dt, cpu in phases]


def cluster_bench(directory: str, *, size: int, seconds: float, window: int,
                  sync: str = "io_uring", driver: str = "client", tls: bool = False,
                  sizes: tuple[int, ...] | None = None) -> list[BenchResult]:
    """3 bookies, a 3/2/2 ledger written through a write handle (the real client: striping,
    quorum, in-order acks). Two phases, seconds / 2 each: closed loop at W=window (the
    peak), then W=1 with a tailing reader (another client in this process) following the
    ledger until the writer closes it. Three rows: the two phases' add latencies, and the
    tail latency, from the writer's ack of an entry to the reader's delivery of it, with
    its maximum (the close is part of the phase: the last entry's delivery counts).
    driver: how the handle is driven (handle_adds).

    tls: instead, what TLS costs (tls_cluster_bench): plain, TLS and mTLS at each of `sizes`
    (default 100 B, 1 KiB, 64 KiB; `size` is then unused)."""
    if tls:
        return tls_cluster_bench(directory, sizes=sizes or TLS_BENCH_SIZES, seconds=seconds, window=window,
                                 sync=sync, driver=driver)
    cluster = LocalCluster(tempfile.mkdtemp(prefix="cluster-", dir=directory), bookies=3, shards=1, journal_sync=sync,
                           bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    watch = ProcessWatch(cluster_processes(cluster))
    phases: list[tuple[str, int, Latencies, float, dict]] = []
    tail_lat = histogram()
    try:
        async def main() -> None:
            async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=1 << 20) as bk, \
                    await BookKeeper.connect(cluster.metadata_uri) as reader:
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                payload = os.urandom(size)
                lat, before = histogram(), watch.cpu()
                n, dt = await closed_loop([handle_adds(lh, driver)], payload, seconds / 2, window, lat)
                phases.append((f"W={window}", n, lat, dt, watch.per_op(before, n, dt)))

                rh = await reader.open_ledger(lh.ledger_id, recovery=False)
                acked_at: dict[int, float] = {}

                async def tail(start: int) -> None:
                    async for e in rh.tail(start):
                        t = acked_at.pop(e.entry_id, None)
                        if t is not None:
                            tail_lat.counts[int((time.perf_counter() - t) * 1e6)] += 1

                tailer = asyncio.create_task(tail(lh.last_add_confirmed + 1))
                lat, before = histogram(), watch.cpu()
                n, dt = await closed_loop([handle_adds(lh, driver)], payload, seconds / 2, 1, lat, acked_at)
                phases.append(("W=1, tailing reader", n, lat, dt, watch.per_op(before, n, dt)))
                await lh.close()
                await asyncio.wait_for(tailer, 30)
        uvloop.run(main())
        rss = cluster_rss(cluster)
    finally:
        cluster.stop()
    results = [BenchResult(f"cluster 3/2/2 {size} B {mode}, {driver} driver", n / dt, n * size / dt / 1e6,
                           latency_ms(lat), {"entry_bytes": size, "mode": mode, "sync": sync, "driver": driver,
                                             "cpu": cpu, "peak_rss_mb": rss})
               for mode, n, lat, dt, cpu in phases]
    delivered, dt = sum(tail_lat.counts.values()), phases[-1][3]
    results.append(BenchResult(f"cluster 3/2/2 {size} B tail, ack -> delivery", delivered / dt,
                               delivered * size / dt / 1e6, latency_ms(tail_lat),
                               {"entry_bytes": size, "mode": "tail", "entries": delivered,
                                "max_ms": max(tail_lat.counts, default=0) / 1000.0}))
    return results


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
                chunk = max(256, min(8192, (32 << 20) // max(1, size)))  # ~32 MiB per read call
                for start in range(0, entries, chunk):
                    s = time.perf_counter()
                    got = await rh.read(start, min(entries - 1, start + chunk - 1))
                    h.record_value(max(1, int((time.perf_counter() - s) * 1e6 / max(1, len(got)))))
                    n += len(got)
                return n, time.perf_counter() - t0
        n, dt = uvloop.run(read())
        rss = cluster_rss(cluster)
    finally:
        cluster.stop()
    return BenchResult(f"cold read {size} B x {entries}", n / dt, n * size / dt / 1e6, latency_ms(h),
                       {"entry_bytes": size, "entries": n,
                        "latency_note": "per entry, averaged per read call of ~32 MiB (256-8192 entries)",
                        "peak_rss_mb": rss})


TLS_BENCH_SIZES = (100, 1024, 65536)
TLS_MODES_BENCHED = ("plain", "tls", "mtls")
MAX_BYTES_IN_FLIGHT = 64 << 20  # a phase's window is cut to this over the entry size (64 KiB: W <= 1024)


def _bookie_trust(mode: str) -> dict[str, Any]:
    """The bookies' trust keys for a mode: `optional` serves plain and TLS clients alike;
    mTLS asks every client for its certificate, and takes the principal from it."""
    if mode == "mtls":
        return {"tls": "require", "tls_client_auth": True, "auth_provider": "mtls"}
    return {"tls": "optional", "tls_client_auth": False, "auth_provider": ""}


def _client_trust(cluster: LocalCluster, mode: str) -> dict[str, Any]:
    if mode == "plain":
        return {}
    return cluster.client_trust("bench" if mode == "mtls" else None, auth="mtls" if mode == "mtls" else "")


async def _handshake_ms(bk: BookKeeper, bookies: list[str], rounds: int = 5) -> float:
    """Connect -> first answer (GET_BOOKIE_INFO) of a new connection: TCP, START_TLS, the TLS
    handshake, the identity check and AUTH where the mode has them. The median over `rounds`
    new connections to each bookie (the client's connections are dropped before each round)."""
    times = []
    for _ in range(rounds):
        bk.pool.drop_connections()
        for b in bookies:
            t0 = time.perf_counter()
            await bk.pool.call(b, Op.GET_BOOKIE_INFO, 0, 0, -1, NO_KEY)
            times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def _shard_pids(bookies: list[LocalBookie]) -> dict[str, int]:
    return {f"bookie{i}-shard[{pid}]": pid for i, b in enumerate(bookies) for pid in b.shard_pids()}


def tls_cluster_bench(directory: str, *, sizes: tuple[int, ...] = TLS_BENCH_SIZES, seconds: float, window: int,
                      sync: str = "io_uring", driver: str = "client") -> list[BenchResult]:
    """What TLS costs a 3/2/2 writer. Two clusters of 3 bookies, certificates from a
    throw-away CA (one per bookie id): `tls = optional` serves the plain and the TLS client,
    `require` + client certificates + `mtls` authentication the mTLS one. At each size the
    three modes run one after the other (so drift on a shared machine hits all three alike):
    closed loops at W=window (cut to MAX_BYTES_IN_FLIGHT / size), `seconds` split evenly
    over the 3 x len(sizes) phases (at least 1 s each).

    Each row: adds/s, latency, the client's and the bookies' CPU per add (us: this process;
    the sum over the cluster's shard processes, from /proc/<pid>/stat), the handshake time
    (connect -> first answer, median) and, for TLS and mTLS, adds/s as a share of plain at
    the same size (issue 23's bar: TLS costs <= 30 % of adds/s at 1 KiB)."""
    from bookkeeper.testing.pki import TestPKI

    work = tempfile.mkdtemp(prefix="cluster-tls-", dir=directory)
    pki = TestPKI(os.path.join(work, "pki"))
    clusters = {kind: LocalCluster(os.path.join(work, kind), bookies=3, shards=1, journal_sync=sync, pki=pki,
                                   bookie_conf=PRODUCTION_JOURNAL, bookie_trust=_bookie_trust(kind))
                for kind in ("plain", "mtls")}
    of_mode = {"plain": clusters["plain"], "tls": clusters["plain"], "mtls": clusters["mtls"]}
    phase_s = max(1.0, seconds / (len(TLS_MODES_BENCHED) * len(sizes)))
    rows: list[tuple[str, int, int, Latencies, float, dict[str, float], float]] = []
    try:
        for c in clusters.values():
            c.start()

        async def main() -> None:
            clients = {mode: await BookKeeper.connect(of_mode[mode].metadata_uri, max_outstanding_adds=1 << 20,
                                                      **_client_trust(of_mode[mode], mode))
                       for mode in TLS_MODES_BENCHED}
            try:
                handshake = {mode: await _handshake_ms(bk, [b.bookie_id for b in of_mode[mode].bookies])
                             for mode, bk in clients.items()}
                for size in sizes:
                    for mode, bk in clients.items():
                        watch = ProcessWatch({"client": os.getpid(), **_shard_pids(of_mode[mode].bookies)})
                        lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                        lat, before = histogram(), watch.cpu()
                        n, dt = await closed_loop([handle_adds(lh, driver)], os.urandom(size), phase_s,
                                                  max(1, min(window, MAX_BYTES_IN_FLIGHT // size)), lat)
                        after = watch.cpu()
                        cpu = {"client": (after["client"] - before["client"]) / max(1, n) * 1e6,
                               "bookies": sum(after[k] - before[k] for k in after
                                              if k != "client" and k in before) / max(1, n) * 1e6}
                        rows.append((mode, size, n, lat, dt, cpu, handshake[mode]))
                        await lh.close()
            finally:
                for bk in clients.values():
                    await bk.close()
        uvloop.run(main())
    finally:
        for c in clusters.values():
            c.stop()
        shutil.rmtree(work, ignore_errors=True)
    plain = {size: n / dt for mode, size, n, _, dt, _, _ in rows if mode == "plain"}
    results = []
    for mode, size, n, lat, dt, cpu, handshake_ms in rows:
        rate = n / dt
        share = rate / plain[size] if plain.get(size) else None
        vs = f" ({share:.0%} of plain)" if mode != "plain" and share is not None else ""
        results.append(BenchResult(
            f"cluster 3/2/2 {size} B {mode}{vs}", rate, n * size / dt / 1e6, latency_ms(lat),
            {"entry_bytes": size, "mode": mode, "sync": sync, "driver": driver,
             "window": max(1, min(window, MAX_BYTES_IN_FLIGHT // size)),
             "client_cpu_us_per_add": round(cpu["client"], 2), "bookies_cpu_us_per_add": round(cpu["bookies"], 2),
             "handshake_ms": round(handshake_ms, 2), "adds_vs_plain": round(share, 3) if share is not None else None}))
    return results
