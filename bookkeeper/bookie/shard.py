"""Entry point of one shard process: storage + journal + server on its own uvloop.

Lives in: a shard process started by the supervisor (`python -m bookkeeper.bookie.shard`).

Start order is the durability argument: open storage (its checkpoint mark), replay
the journal past the mark (stopping at a torn tail), start a fresh journal file,
checkpoint what was replayed, and only then listen. A shard shares no mutable
state with its siblings; it owns the ledgers `shard_for_ledger` gives it.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import fcntl
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

from bookkeeper._ext.journal import REC_ADD, REC_FENCE, REC_MASTER_KEY
from bookkeeper.bookie import control
from bookkeeper.bookie.add_trace import REPORT_PAGE
from bookkeeper.bookie.gc import GarbageCollector, GcSettings
from bookkeeper.bookie.metrics import LoopLag
from bookkeeper.bookie.journal import Journal, make_syncer
from bookkeeper.bookie.journal.journal import Record, journal_pool_bytes, pool_files
from bookkeeper.bookie.journal.syncer import AckBeforeSyncSyncer, Syncer
from bookkeeper.bookie.server import BookieProtocol, PeerBounds, ShardServer
from bookkeeper.bookie.state import disk_usage, journal_space
from bookkeeper.bookie.storage import LedgerStorage
from bookkeeper.bookie.storage.ledger_storage import ENTRY_OVERHEAD_BYTES, Snapshot
from bookkeeper.bookie.trust import shard_trust
from bookkeeper.config import BookieConfig
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.meta.zk_security import zk_security_from
from bookkeeper.proto import Op, entry_header
from bookkeeper.testing_switches import ACK_BEFORE_SYNC, ACK_BEFORE_SYNC_HOLD_S, switches_from_env, warn_switches

log = logging.getLogger("bookkeeper.shard")


def apply_records(storage: LedgerStorage, records: list[Record]) -> None:
    """Replay journal records into storage: idempotent, in journal order."""
    for rtype, ledger_id, entry_id, data in records:
        st = storage.ledger(ledger_id)
        if rtype == REC_MASTER_KEY:
            if st is None:
                storage.create_ledger(ledger_id, data)
        elif rtype == REC_FENCE:
            if st is not None:
                st.fenced = True
        elif rtype == REC_ADD and st is not None:
            storage.put_entry(ledger_id, entry_id, data, entry_header(data)[2])


async def checkpoint(loop: asyncio.AbstractEventLoop, storage: LedgerStorage, journal: Journal,
                     server: ShardServer, retire: concurrent.futures.Executor | None = None) -> int:
    """One checkpoint: the write cache flushed to the entry log + index (off the loop), then
    the journal files before the mark dropped; returns the entry bytes flushed. A failed flush
    loses nothing: the cache is kept, the journal is not trimmed, the next checkpoint retries.
    One implementation for the shard process and the simulator (bookkeeper/testing/sim).

    `retire`: the executor that then trims the journal and frees the flushed entries
    (retire_flushed) while this returns at once, so the next checkpoint (and the senders its
    snapshot releases from backpressure) never waits for them; one thread, so trims run one
    at a time and in order. None (the simulator): the same job, awaited."""
    mark = journal.position()
    nbytes = storage.write_cache_bytes - ENTRY_OVERHEAD_BYTES * len(storage.write_cache)
    snap = storage.snapshot()
    server.release_backpressure()  # the write cache is empty again
    try:
        await loop.run_in_executor(None, storage.flush, snap, mark)
    except BaseException:
        storage.flush_failed(snap)
        raise
    storage.flush_done(snap)
    job = loop.run_in_executor(retire, retire_flushed, journal, mark[0], snap)
    if retire is None:
        await job
    else:
        job.add_done_callback(_retire_done)
    return nbytes


def retire_flushed(journal: Journal, mark_file_id: int, snap: Snapshot) -> None:
    """After a checkpoint committed, in a worker thread: the journal files before its mark
    trimmed, then its entries freed (Snapshot.release). Off the loop: a trim's renames and
    unlinks wait on a busy disk (21-76 ms each measured on the loop beside bulk traffic, a
    stall every connection of the shard waited out); a roll meanwhile takes from the pool
    what the trim has already put there."""
    journal.trim(mark_file_id)
    snap.release()


def _retire_done(job: asyncio.Future[None]) -> None:
    if not job.cancelled() and job.exception() is not None:
        log.error("retiring a committed checkpoint's journal files failed (the next checkpoint trims them): %s",
                  job.exception())


SWITCH_INTERVAL_S = 0.001  # the shard process's GIL switch interval (main says why)
DISK_GUARD_S = 0.05  # while adds flow, a shard measures its disks at most this often (statvfs: ~2 us each)


class Shard:
    """One shard's components and periodic work (checkpoint, garbage collection, compaction).

    `switches`: the test-only switches it was started with (bookkeeper/testing_switches.py);
    empty in every real bookie.
    """

    def __init__(self, cfg: BookieConfig, index: int, *, supervisor_pid: int = 0,
                 switches: frozenset[str] = frozenset()) -> None:
        self.cfg = cfg
        self.index = index
        self.supervisor_pid = supervisor_pid
        self.loop = asyncio.get_running_loop()
        self.storage = LedgerStorage(cfg.shard_ledger_dir(index), log_dirs=cfg.shard_ledger_dirs(index),
                                     entry_log_max_bytes=cfg.entry_log_max_bytes, dir_writable=self._dir_writable)
        self.server = ShardServer(storage=self.storage, shard_index=index, shards=cfg.shards,
                                  max_frame_bytes=cfg.max_frame_bytes, readonly=cfg.readonly,
                                  data_dir=str(cfg.shard_ledger_dir(index)),
                                  write_cache_max_bytes=cfg.write_cache_max_bytes,
                                  bounds=PeerBounds(max_connections=cfg.max_connections,
                                                    write_buffer_high_bytes=cfg.write_buffer_high_bytes,
                                                    max_long_polls_per_connection=cfg.max_long_polls_per_connection,
                                                    idle_timeout_s=cfg.idle_timeout_s),
                                  trust=shard_trust(cfg))
        self.syncer: Syncer = make_syncer(cfg.journal_sync, self.loop)
        if ACK_BEFORE_SYNC in switches:  # TEST ONLY: acknowledged adds are lost on kill -9
            self.syncer = AckBeforeSyncSyncer(self.syncer, self.loop, ACK_BEFORE_SYNC_HOLD_S)
        self.journal = Journal(cfg.shard_journal_dir(index), syncer=self.syncer, loop=self.loop,
                               on_durable=self._on_durable, on_failed=self._on_journal_failed,
                               group_wait_us_max=cfg.journal_max_group_wait_us,
                               batch_bytes_max=cfg.journal_max_batch_bytes,
                               batch_entries_max=cfg.journal_max_batch_entries,
                               block_bytes_max=cfg.journal_max_block_bytes,
                               preallocate_bytes=cfg.journal_preallocate_bytes,
                               file_max_bytes=cfg.journal_file_max_bytes,
                               reuse_files=cfg.journal_reuse_files)
        warn_switches(log, switches, f"shard {index}")
        self.server.journal = self.journal
        self.journal.observe_batch = self._observe_batch
        self._checkpointing: asyncio.Task[None] | None = None
        # Trims the journal and frees the entries after each checkpoint (checkpoint() says why).
        self._retire = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="retire")
        self._stopping = asyncio.Event()
        self._meta: ZkMetadataStore | None = None  # for garbage collection only
        self.failed: str | None = None  # why this shard can make nothing durable any more
        self._disks_checked = 0.0  # when _guard_disks last measured
        self.counters: dict[str, int] = dict.fromkeys(
            ("checkpoints", "checkpoint_bytes", "checkpoint_failures", "gc_ledgers_deleted", "gc_failures",
             "gc_zk_reads", "gc_ledgers_touched", "compaction_bytes_copied", "compaction_bytes_reclaimed",
             "compaction_logs_deleted", "journal_pool_released_bytes"), 0)
        self.gc = GarbageCollector(
            index, self.storage, self.loop, store=self._gc_store, checkpoint=self._checkpoint_committed,
            settings=GcSettings(minor_threshold=cfg.minor_compaction_threshold,
                                minor_interval_s=cfg.minor_compaction_interval_s,
                                major_threshold=cfg.major_compaction_threshold,
                                major_interval_s=cfg.major_compaction_interval_s,
                                rate_bytes_s=cfg.compaction_rate_mb_s * 1e6),
            clock=time.monotonic, wall_clock=time.time, should_stop=self._stopping.is_set, counters=self.counters,
            observe_duration=self.server.histograms["compaction_duration_seconds"].observe,
            observe_pass=self.server.histograms["gc_duration_seconds"].observe)

    def _dir_writable(self, path: Path) -> bool:
        """May a new entry log go to this ledger dir (under the read-only threshold)?"""
        return disk_usage(path)[2] < self.cfg.disk_usage_threshold

    def _observe_batch(self, records: int, nbytes: int, seconds: float) -> None:
        h = self.server.histograms
        h["journal_sync_latency_seconds"].observe(seconds)
        h["journal_batch_entries"].observe(records)
        h["journal_batch_bytes"].observe(nbytes)
        now = time.monotonic()
        if now - self._disks_checked >= DISK_GUARD_S:
            self._disks_checked = now
            self._guard_disks()

    def _guard_disks(self) -> None:
        """Give back the journal pool when its disk passes the warning; turn read-only at once
        when the journal's filesystem (its pool counted as free), or every ledger dir's, passes
        the threshold, and tell the supervisor: adds can fill a disk faster than its
        disk_check_interval_s, and a journal that meets ENOSPC fails. The supervisor then
        decides for the bookie (with hysteresis) and every shard follows it."""
        usage = self._journal_space()
        if self.server.readonly:
            return
        cfg = self.cfg
        if usage >= cfg.disk_usage_threshold:
            reason = f"journal dir {cfg.journal_dir} is {usage:.0%} full"
        else:
            ledger = [(d, disk_usage(d)[2]) for d in cfg.ledger_dirs]
            if any(u < cfg.disk_usage_threshold for _d, u in ledger):
                return
            reason = "every ledger dir is full: " + ", ".join(f"{d} {u:.0%}" for d, u in ledger)
        self.server.readonly = True
        self.server.readonly_reason = reason
        log.warning("shard %d: %s: refusing adds", self.index, reason)
        self._tell_supervisor()

    def _journal_space(self) -> float:
        """Release this shard's pooled journal files while the journal disk is past
        disk_usage_warn (state.journal_space decides); returns the disk's used share with every
        shard's pool counted as free.

        Under the warning nothing is released and the share is under every threshold either
        way, so the pools are only listed past it: the hot path stays one statvfs.
        """
        cfg, journal = self.cfg, self.journal
        total, free, raw = disk_usage(cfg.journal_dir)
        past_warn = raw >= cfg.disk_usage_warn
        space = journal_space(total_bytes=total, free_bytes=free,
                              pool_bytes=journal_pool_bytes(cfg.journal_dir) if past_warn else 0,
                              own_pool=pool_files(journal.dir) if past_warn else (), pooling=journal.pooling,
                              warn=cfg.disk_usage_warn, lwm=cfg.disk_usage_lwm)
        if space.pooling != journal.pooling:
            log.info("shard %d: journal disk %.0f%% full: trimmed journal files are %s", self.index, raw * 100,
                     "pooled for reuse again" if space.pooling else "deleted, not pooled, until it is under "
                     f"{cfg.disk_usage_lwm:.0%}")
            journal.pooling = space.pooling
        freed = journal.release(space.release) if space.release else []
        if freed:
            nbytes = sum(size for _name, size in freed)
            self.counters["journal_pool_released_bytes"] += nbytes
            log.warning("shard %d: journal disk %s is %.0f%% full (warning at %.0f%%): released %d pooled journal "
                        "file(s), %d bytes: %s", self.index, cfg.journal_dir, raw * 100, cfg.disk_usage_warn * 100,
                        len(freed), nbytes, ", ".join(name for name, _size in freed))
        return space.usage

    def _tell_supervisor(self) -> None:
        """SIGUSR1: the supervisor evaluates the bookie's state now, not at its next check."""
        if self.supervisor_pid:
            try:
                os.kill(self.supervisor_pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def _on_journal_failed(self, items: list, err: OSError) -> None:
        """Answer the items with errors; the first time, turn the shard read-only and tell the
        supervisor at once (SIGUSR1: it re-registers the bookie read-only and says why)."""
        self.server.on_failed(items, err)
        if self.failed is None:
            self.failed = f"journal failed: {err}"
            self.server.readonly = True
            self.server.readonly_reason = self.failed
            log.error("shard %d: %s; refusing adds from now on (reads still served)", self.index, self.failed)
            self._tell_supervisor()

    def _on_durable(self, items: list) -> None:
        self.server.on_durable(items)
        if self.storage.write_cache_bytes > self.cfg.write_cache_max_bytes:
            self.request_checkpoint()

    def request_checkpoint(self) -> None:
        if self._checkpointing is None or self._checkpointing.done():
            self._checkpointing = self.loop.create_task(self.checkpoint())
            self._checkpointing.add_done_callback(self._checkpoint_done)

    def _checkpoint_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("shard %d: checkpoint failed (entries kept, journal not trimmed): %s", self.index,
                      task.exception())
        elif self.storage.write_cache_bytes > self.cfg.write_cache_max_bytes and not self._stopping.is_set():
            self.request_checkpoint()  # adds outran that flush: senders wait until this one swaps

    async def checkpoint(self) -> None:
        """Flush the write cache to the entry log + index, then drop journal files before the mark."""
        t0 = time.monotonic()
        try:
            nbytes = await checkpoint(self.loop, self.storage, self.journal, self.server, self._retire)
        except BaseException:
            self.counters["checkpoint_failures"] += 1
            raise
        self.counters["checkpoints"] += 1
        self.counters["checkpoint_bytes"] += nbytes
        self.server.histograms["checkpoint_duration_seconds"].observe(time.monotonic() - t0)

    async def run(self) -> None:
        t0 = time.monotonic()
        result = self.journal.replay(self.storage.checkpoint_mark(),
                                     lambda recs: apply_records(self.storage, recs))
        self.journal.start()
        await self.checkpoint()
        log.info("shard %d: replayed %d records from %d journal files (%d torn block(s) discarded) in %.2fs; "
                 "journal sync: %s", self.index, result.records, result.files, result.blocks_torn,
                 time.monotonic() - t0, self.syncer.kind)
        port = self.cfg.port_of_shard(self.index)
        srv = await self.loop.create_server(lambda: BookieProtocol(self.server), self.cfg.bind_address, port,
                                            reuse_address=True, backlog=1024)
        ctl = await control.serve(control.socket_name(self.supervisor_pid or os.getppid(), self.index),
                                  self.on_control)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopping.set)
        # What start-up made (modules, config, the replayed state) lives as long as the shard:
        # out of the cyclic GC's generations, a full collection no longer walks ~40,000 objects
        # on the loop (10-60 ms each, measured under load).
        gc.collect()
        gc.freeze()
        print(f"READY shard={self.index} port={port} sync={self.syncer.kind}", flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # nobody reads the pipe after READY: never block on a full one
        os.close(devnull)
        periodic = [self.loop.create_task(self._every(self.cfg.checkpoint_interval_s, self._checkpoint_now)),
                    self.loop.create_task(self._every(self.cfg.gc_interval_s, self.garbage_collect)),
                    self.loop.create_task(self._every(self.cfg.disk_check_interval_s, self._check_disks)),
                    self.loop.create_task(self._every(self.cfg.tls_reload_interval_s, self._reload_trust))]
        counters = self.server.counters
        lag = LoopLag(self.loop, self.server.histograms["shard_loop_lag_seconds"],
                      lambda: sum(n for op, n in counters.items() if isinstance(op, int)),  # requests, per op
                      stall=self.server.histograms["shard_loop_stall_seconds"],
                      blocked=self.server.histograms["shard_loop_blocked_seconds"])
        lag.start()
        try:
            await self._stopping.wait()
        finally:
            lag.stop()
        srv.close()
        ctl.close()
        for conn in list(self.server.connections):
            conn.close()
        for task in periodic:
            task.cancel()
        if self.gc.compacting is not None:
            await asyncio.gather(self.gc.compacting, return_exceptions=True)
        await self.journal.drain()
        if self._checkpointing is not None:
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        await self.checkpoint()
        await self.loop.run_in_executor(None, self._retire.shutdown)  # its last trim done
        self.journal.close()
        self.syncer.close()
        self.storage.close()
        if self._meta is not None:
            await self.loop.run_in_executor(None, self._meta.close)
        log.info("shard %d stopped", self.index)

    async def _check_disks(self) -> None:
        """The disk guard of an idle shard (with adds flowing it runs after durable blocks):
        the journal disk can fill from outside while nothing is written."""
        self._disks_checked = time.monotonic()
        self._guard_disks()

    async def _reload_trust(self) -> None:
        """The TLS files, token keys and roles file re-read where changed (bad ones kept old, counted)."""
        self.server.maybe_reload()

    async def _checkpoint_now(self) -> None:
        """Run (or join) a checkpoint; its failure is logged by its done callback."""
        self.request_checkpoint()
        await asyncio.gather(self._checkpointing, return_exceptions=True)  # type: ignore[arg-type]

    async def _every(self, interval_s: float, job: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("shard %d: periodic %s failed", self.index, getattr(job, "__name__", job))

    async def on_control(self, req: dict[str, Any]) -> dict[str, Any]:
        """A supervisor request (bookkeeper/bookie/control.py)."""
        op = req.get("op")
        if op == "stats":
            return self.stats()
        if op == "readonly":
            self.server.readonly = bool(req["on"]) or self.failed is not None
            self.server.readonly_reason = self.failed or (req.get("reason") if req["on"] else None)
            return self.state()
        if op == "gc":
            return await self.garbage_collect(force=bool(req.get("force", True)))
        if op == "add_trace":
            if "peers" in req:
                return self.server.start_add_trace(req["peers"], req.get("seconds"))
            start, limit = req.get("from", 0), req.get("limit", REPORT_PAGE)
            if not all(type(v) is int and v >= 0 for v in (start, limit)):
                raise ValueError(f"add_trace: from and limit must be integers >= 0, got {start!r}, {limit!r}")
            return self.server.add_trace_report(start, min(limit, REPORT_PAGE))
        raise ValueError(f"unknown control op {op!r}")

    def state(self) -> dict[str, Any]:
        return {"index": self.index, "state": "readonly" if self.server.readonly else "writable",
                "reason": self.server.readonly_reason, "failed": self.failed}

    def stats(self) -> dict[str, Any]:
        """Everything the supervisor exposes for this shard (bookkeeper/bookie/metrics.py)."""
        server, journal, storage = self.server, self.journal, self.storage
        usage = storage.log_usage()
        counters = {"add_entry": server.counters[int(Op.ADD_ENTRY)], "add_entry_errors": server.counters["add_errors"],
                    "read_entry": server.counters[int(Op.READ_ENTRY)], "fence": server.counters["fence"],
                    "write_lac": server.counters[int(Op.WRITE_LAC)],
                    "bad_frames": server.counters["bad_frames"], "journal_batches": journal.stats["blocks"],
                    "connections_refused": server.counters["connections_refused"],
                    "long_polls_refused": server.counters["long_polls_refused"],
                    "idle_closed": server.counters["idle_closed"],
                    "light_senders_read_on": server.counters["light_senders_read_on"],
                    "share_read_on": server.counters["share_read_on"],
                    "journal_bytes": journal.stats["bytes"], **self.counters, **self._trust_counters()}
        gauges: dict[str, float] = {"connections": len(server.connections), "paused_senders": len(server.paused),
                  "paused_readers": len(server.write_paused), "write_buffer_bytes": server.write_buffer_bytes(),
                  "long_polls": server.long_polls(), "unauthenticated_connections": len(server.unauthenticated),
                  "journal_queue_bytes": journal.queued_bytes, "write_cache_bytes": storage.write_cache_bytes,
                  "ledgers": len(storage.ledgers), "entry_log_bytes": sum(u[1] for u in usage.values()),
                  "entry_log_live_bytes": sum(u[2] for u in usage.values()), "readonly": int(server.readonly),
                  "journal_pool_bytes": sum(size for _name, size in pool_files(journal.dir))}
        days = server.trust.tls.days_to_expiry() if server.trust.tls is not None else None
        if days is not None:
            gauges["tls_cert_expiry_days"] = round(days, 3)
        return {**self.state(), "counters": counters, "gauges": gauges,
                "histograms": {k: h.snapshot() for k, h in server.histograms.items()}}

    def _trust_counters(self) -> dict[str, Any]:
        """The trust counters of stats(); the labelled ones as {label value: count}."""
        server, trust = self.server, self.server.trust
        files = {"tls": trust.tls, "token_keys": getattr(trust.provider, "keys", None),
                 "authz": trust.authz if trust.authz.enabled else None}
        plain = {name: server.counters[name] for name in (
            "tls_handshakes", "tls_handshake_failures", "auth_successes", "auth_expired_closed",
            "unauthenticated_refused", "auth_timeouts", "auth_backoff_refused")}
        return {**plain, "auth_failures": dict(server.auth_failures), "forbidden": dict(server.forbidden),
                "trust_reloads": {kind: f.reloads for kind, f in files.items() if f is not None},
                "trust_reload_failures": {kind: f.reload_failures for kind, f in files.items() if f is not None}}

    async def garbage_collect(self, *, force: bool = False) -> dict[str, Any]:
        """One GC pass (bookie/gc.py, GarbageCollector): drop deleted ledgers, compact if due."""
        return await self.gc.run(force=force)

    def _gc_store(self) -> ZkMetadataStore:
        """One ZooKeeper session per shard for GC, made on first use (in the worker thread) and kept."""
        if self._meta is None:
            self._meta = ZkMetadataStore(self.cfg.metadata_uri, create=False,
                                         session_timeout_ms=self.cfg.zk_session_timeout_ms,
                                         security=zk_security_from(self.cfg))
        return self._meta

    async def _checkpoint_committed(self) -> None:
        """A checkpoint that starts after this call, run to its commit: a running one may have
        swapped its snapshot before the caller's change, so it is awaited first."""
        if self._checkpointing is not None and not self._checkpointing.done():
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        self.request_checkpoint()
        assert self._checkpointing is not None
        await asyncio.shield(self._checkpointing)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this shard when its supervisor dies (PR_SET_PDEATHSIG): a shard never outlives
    the supervisor that owns its directories and registration. (The supervisor starts shards
    from its main thread, which lives as long as the process: the signal follows the process.)"""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def lock_shard_dir(path: Path, timeout_s: float = 30.0) -> int:
    """Exclusive lock on the shard's journal directory; waits for a dying predecessor."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(f"shard directory {path} is locked by another process") from None
            time.sleep(0.05)


def pin_to_core(index: int) -> None:
    """Pin this shard to one of the cores the bookie may use (shard i -> i-th core)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[index % len(cpus)]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bookkeeper.bookie.shard",
                                     description="one shard; its configuration (JSON) comes on stdin")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = BookieConfig.from_dict(json.loads(sys.stdin.buffer.read()))  # not argv: it holds secrets
    switches = switches_from_env()  # inherited from the supervisor, which refused unknown names already
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s shard-{args.index} %(levelname)s %(name)s: %(message)s")
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    lock_shard_dir(cfg.shard_journal_dir(args.index))
    if cfg.pin_shards:
        pin_to_core(args.index)
    # The loop waits for the GIL whenever a worker thread (a checkpoint's flush, compaction, a
    # GC sweep) holds it: at most one switch interval plus the worker's current C step
    # (FLUSH_SLICE_ENTRIES bounds those). 1 ms instead of Python's 5 bounds a loop stall by
    # a journal sync (issue 28), for more GIL hand-offs while both threads are busy.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def run() -> None:
        await Shard(cfg, args.index, supervisor_pid=args.parent_pid, switches=switches).run()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
