"""Shard metrics: plain counters and fixed-bucket histograms a shard updates on its hot path,
and their Prometheus exposition in the supervisor.

Lives in: every shard process (recording) and the supervisor (exposition).

Why not prometheus_client in the shard: its metric objects take a lock per update and, in
multiprocess mode, an mmap write; at 100k adds/s that is several percent of a core. Here an
update is a list index increment on the loop thread; the supervisor asks each shard for a
snapshot over its control socket at scrape time (bookkeeper/bookie/control.py) and builds
prometheus_client metric families labelled `shard`, so one /metrics serves every shard.
"""
from __future__ import annotations

import asyncio
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from bookkeeper.metrics import BYTES_BUCKETS, COUNT_BUCKETS, DURATION_BUCKETS_S, LATENCY_BUCKETS_S, PREFIX
from bookkeeper.metrics import cumulative_buckets


class Histogram:
    """Cumulative-at-export histogram over fixed upper bounds (Prometheus `le` semantics)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Record `n` observations of `value` (n > 1: a run of requests with one latency)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def snapshot(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


# name -> (kind, help): every metric a shard reports. Counters end in _total in the exposition.
SHARD_METRICS: dict[str, tuple[str, str]] = {
    "add_entry": ("counter", "add requests answered, any status"),
    "add_entry_errors": ("counter", "add requests answered with an error status"),
    "read_entry": ("counter", "read requests answered, any status (long polls included)"),
    "fence": ("counter", "fencing requests (read or read-LAC with the fence flag)"),
    "write_lac": ("counter", "explicit LACs from idle writers (WRITE_LAC requests, any status)"),
    "bad_frames": ("counter", "connections closed for a frame that can never parse"),
    "journal_batches": ("counter", "journal blocks made durable"),
    "journal_bytes": ("counter", "journal bytes made durable"),
    "checkpoints": ("counter", "checkpoints completed"),
    "checkpoint_bytes": ("counter", "entry bytes written to entry logs by checkpoints"),
    "checkpoint_failures": ("counter", "checkpoints that failed (entries kept, journal not trimmed)"),
    "gc_ledgers_deleted": ("counter", "ledgers dropped because their metadata is gone"),
    "gc_failures": ("counter", "GC passes that dropped nothing because ZooKeeper failed or was not connected"),
    "gc_zk_reads": ("counter", "ZooKeeper requests of GC passes (bucket stats, listings, syncs)"),
    "gc_ledgers_touched": ("counter", "held ledgers GC passes compared with a bucket listing (changed buckets only)"),
    "compaction_bytes_copied": ("counter", "live entry bytes copied by compaction"),
    "compaction_bytes_reclaimed": ("counter", "entry-log bytes freed by compaction and GC"),
    "compaction_logs_deleted": ("counter", "entry logs deleted by compaction and GC"),
    "journal_pool_released_bytes": ("counter", "pooled journal bytes (reuse files, spare) given back because "
                                               "the journal disk passed disk_usage_warn"),
    "connections_refused": ("counter", "connections closed at once: max_connections were open"),
    "long_polls_refused": ("counter", "long polls answered at once: unknown ledger, or the connection's "
                                      "max_long_polls_per_connection parked"),
    "idle_closed": ("counter", "connections closed after idle_timeout_s without a request or anything outstanding"),
    "light_senders_read_on": ("counter", "receive buffers of light senders (few adds waiting, small buffers) read on "
                                         "while the shard was over its memory bounds and paused the others"),
    "share_read_on": ("counter", "receive buffers read on while the journal was full because their sender "
                                 "held under its share (half of journal_max_batch_bytes) of the records not yet durable"),
    "tls_handshakes": ("counter", "TLS handshakes completed (START_TLS)"),
    "tls_handshake_failures": ("counter", "TLS handshakes that failed (untrusted or missing client certificate, "
                                          "no common version, a peer gone or too slow)"),
    "trust_reloads": ("counter", "TLS, token-key or roles files re-read after a change, label kind"),
    "trust_reload_failures": ("counter", "changed TLS, token-key or roles files refused (the previous ones kept), "
                                         "label kind"),
    "auth_successes": ("counter", "AUTH exchanges that authenticated (renewals included)"),
    "auth_failures": ("counter", "AUTH exchanges refused, and ops refused before authentication, label reason"),
    "auth_expired_closed": ("counter", "connections closed because their credential expired without renewal"),
    "unauthenticated_refused": ("counter", "connections closed at once: max_unauthenticated_connections were "
                                           "waiting to authenticate"),
    "auth_timeouts": ("counter", "connections closed for not authenticating within auth_timeout_s"),
    "auth_backoff_refused": ("counter", "connections closed at once: their address is backed off after repeated "
                                        "AUTH or TLS failures"),
    "forbidden": ("counter", "requests answered FORBIDDEN, label role (the role the principal lacks)"),
    "add_entry_latency_seconds": ("histogram", "add request arrival to durable response"),
    "read_entry_latency_seconds": ("histogram", "read request service time (long polls excluded)"),
    "journal_sync_latency_seconds": ("histogram", "journal block write + fdatasync"),
    "journal_batch_entries": ("histogram", "records per journal block"),
    "journal_batch_bytes": ("histogram", "bytes per journal block"),
    "checkpoint_duration_seconds": ("histogram", "checkpoint flush (entry log write, fsync, index commit)"),
    "compaction_duration_seconds": ("histogram", "one GC pass's compaction"),
    "gc_duration_seconds": ("histogram", "one GC pass, its compaction included (failed passes too)"),
    "shard_loop_lag_seconds": ("histogram", "how late the shard's event loop ran a timer due every 10 ms while "
                                            "requests come (every second while idle): its longest turns, which "
                                            "every connection of the shard waits out"),
    "shard_loop_stall_seconds": ("histogram", "the loop lag less the time the loop's thread waited for a CPU "
                                              "meanwhile (/proc schedstat): a lower bound of what the shard's "
                                              "own work, the GIL or a blocking call held the loop"),
    "shard_loop_blocked_seconds": ("histogram", "the loop stall less the loop thread's time on a CPU meanwhile: "
                                                "a lower bound of how long it slept though due, waiting for the "
                                                "GIL (a worker thread held it) or in a blocking call"),
    "connections": ("gauge", "client connections open"),
    "paused_senders": ("gauge", "connections paused by backpressure"),
    "paused_readers": ("gauge", "connections not read because they do not read their answers "
                                "(over write_buffer_high_bytes)"),
    "write_buffer_bytes": ("gauge", "answers written but not yet taken by their peers"),
    "long_polls": ("gauge", "long polls parked"),
    "unauthenticated_connections": ("gauge", "connections not yet authenticated"),
    "tls_cert_expiry_days": ("gauge", "days until the bookie's TLS certificate expires (negative once expired)"),
    "journal_queue_bytes": ("gauge", "bytes waiting in the journal's filling batch"),
    "write_cache_bytes": ("gauge", "bytes in the write cache (accounted with per-entry overhead)"),
    "ledgers": ("gauge", "ledgers this shard holds"),
    "entry_log_bytes": ("gauge", "bytes in this shard's entry logs"),
    "entry_log_live_bytes": ("gauge", "live bytes in this shard's entry logs"),
    "readonly": ("gauge", "1 if this shard refuses adds (read-only or failed)"),
    "journal_pool_bytes": ("gauge", "bytes in this shard's journal pool (reuse files, spare): counted as free"),
}


# The metrics with a label besides `shard`: their snapshot value is {label value: number}.
SHARD_METRIC_LABELS: dict[str, str] = {"trust_reloads": "kind", "trust_reload_failures": "kind",
                                       "auth_failures": "reason", "forbidden": "role"}


def shard_histograms() -> dict[str, Histogram]:
    """A shard's histograms, fresh."""
    return {
        "add_entry_latency_seconds": Histogram(LATENCY_BUCKETS_S),
        "read_entry_latency_seconds": Histogram(LATENCY_BUCKETS_S),
        "journal_sync_latency_seconds": Histogram(LATENCY_BUCKETS_S),
        "journal_batch_entries": Histogram(COUNT_BUCKETS),
        "journal_batch_bytes": Histogram(BYTES_BUCKETS),
        "checkpoint_duration_seconds": Histogram(DURATION_BUCKETS_S),
        "compaction_duration_seconds": Histogram(DURATION_BUCKETS_S),
        "gc_duration_seconds": Histogram(DURATION_BUCKETS_S),
        "shard_loop_lag_seconds": Histogram(LATENCY_BUCKETS_S),
        "shard_loop_stall_seconds": Histogram(LATENCY_BUCKETS_S),
        "shard_loop_blocked_seconds": Histogram(LATENCY_BUCKETS_S),
    }


LOOP_LAG_PROBE_S = 0.01  # the probe's period while requests come: a longer stall always delays one probe
LOOP_LAG_IDLE_S = 1.0  # its period while none came since the last probe


class LoopLag:
    """How late the loop runs a timer due every LOOP_LAG_PROBE_S, into a histogram.

    Why a timer and not a hook per callback: uvloop offers no hook, and a turn of the loop
    that runs long (a checkpoint's index work, a GC step, a big receive buffer) delays the
    next due timer by as much, which is what a request arriving meanwhile waits too. Every
    stall longer than the period delays some probe; shorter ones may fall between probes.
    Once no request has come for LOOP_LAG_IDLE_S (`activity()`, a count of requests, did not
    move) the period is LOOP_LAG_IDLE_S until one comes: 100 wake-ups a second cost an idle
    shard ~0.5 % of a core here, and nobody waits on an idle loop. uvloop's clock advances once per loop
    iteration, in milliseconds: lags below 1 ms are noise.

    A lag is also the time the loop's thread was runnable but waited for a CPU: on a machine
    with more busy threads than cores that is most of it (measured here, 2 cores, 3 bookies
    and two clients: lags of 20-85 ms were 75-100 % run-queue wait). `stall`, when given,
    gets the lag less the run-queue wait its thread accumulated since the previous probe: a
    lower bound of the part the shard itself caused. `blocked`, when given, gets the lag less
    that wait and less the thread's time on a CPU since the previous probe: a lower bound of
    the time the loop's thread slept though a timer was due, which is waiting for the GIL (a
    worker thread holds it: a checkpoint's flush, freeing flushed entries; on a busy machine
    often while that thread itself waits for a CPU) or a blocking call on the loop. The
    rest of a stall is at most the loop running (callbacks that take long). Both read
    `schedstat_ns()`, (time on a CPU, time waiting on a run queue) in ns, by default the
    loop thread's /proc schedstat (one pread a probe). The two differences span the whole
    time since the previous probe (the period and the lag; after an idle spell, up to
    LOOP_LAG_IDLE_S), so both figures are lower bounds, the blocked one loosest after idle."""

    def __init__(self, loop: asyncio.AbstractEventLoop, histogram: Histogram, activity: Callable[[], int],
                 period_s: float = LOOP_LAG_PROBE_S, idle_period_s: float = LOOP_LAG_IDLE_S, *,
                 stall: Histogram | None = None, blocked: Histogram | None = None,
                 schedstat_ns: Callable[[], tuple[int, int]] | None = None) -> None:
        self.loop = loop
        self.histogram = histogram
        self.stall = stall
        self.blocked = blocked
        self._schedstat_ns = schedstat_ns if stall is not None or blocked is not None else None
        self._schedstat = -1
        self._was = (0, 0)  # schedstat at the previous probe
        self.activity = activity
        self.period_s = period_s
        self.idle_period_s = idle_period_s
        self._due = 0.0
        self._seen = -1
        self._active_at = 0.0  # when a probe last saw activity() move
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """On the loop's thread (the default schedstat reader is that thread's)."""
        if (self.stall is not None or self.blocked is not None) and self._schedstat_ns is None:
            try:
                self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
                self._schedstat_ns = self._thread_schedstat_ns
                self._was = self._schedstat_ns()
            except (OSError, ValueError, IndexError):
                self._stop_split()  # no schedstat (a kernel without it): the lag alone
        elif self._schedstat_ns is not None:
            self._was = self._schedstat_ns()
        self._arm(time.monotonic(), self.period_s)

    def _thread_schedstat_ns(self) -> tuple[int, int]:
        """The loop thread's time on a CPU and on a run queue waiting for one (schedstat's first
        two fields)."""
        cpu, runq = os.pread(self._schedstat, 128, 0).split()[:2]
        return int(cpu), int(runq)

    def _stop_split(self) -> None:
        """No more stall or blocked figures (schedstat unreadable, or the probe stopped); the
        lag goes on."""
        self.stall = self.blocked = None
        self._schedstat_ns = None
        if self._schedstat >= 0:
            os.close(self._schedstat)
            self._schedstat = -1

    def _arm(self, now: float, period_s: float) -> None:
        self._due = now + period_s
        self._timer = self.loop.call_later(period_s, self._probe)

    def _probe(self) -> None:
        now = time.monotonic()
        lag = max(0.0, now - self._due)
        self.histogram.observe(lag)
        if self._schedstat_ns is not None:  # set only while a split histogram is kept (_stop_split)
            try:
                cpu, runq = self._schedstat_ns()
            except (OSError, ValueError, IndexError):
                self._stop_split()
            else:
                not_waiting = lag - (runq - self._was[1]) / 1e9
                if self.stall is not None:
                    self.stall.observe(max(0.0, not_waiting))
                if self.blocked is not None:
                    self.blocked.observe(max(0.0, not_waiting - (cpu - self._was[0]) / 1e9))
                self._was = (cpu, runq)
        seen = self.activity()
        if seen != self._seen:
            self._seen, self._active_at = seen, now
        self._arm(now, self.period_s if now - self._active_at < self.idle_period_s else self.idle_period_s)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop_split()


def families(snapshots: Mapping[int, Mapping[str, Any]]) -> Iterator[Metric]:
    """Prometheus metric families from shard snapshots ({shard index: snapshot}).

    A snapshot is `{"counters": {name: n}, "gauges": {name: v}, "histograms": {name:
    Histogram.snapshot()}}`; names missing from a shard's snapshot are left out for it.
    """
    for name, (kind, doc) in SHARD_METRICS.items():
        label = SHARD_METRIC_LABELS.get(name)
        labels = ["shard", label] if label else ["shard"]
        if kind == "counter":
            fam: Metric = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        elif kind == "gauge":
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        else:
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
        section = {"counter": "counters", "gauge": "gauges", "histogram": "histograms"}[kind]
        for index, snap in sorted(snapshots.items()):
            value = snap.get(section, {}).get(name)
            if value is None:
                continue
            if label:
                for label_value, n in sorted(value.items()):
                    fam.add_metric([str(index), label_value], n)  # type: ignore[attr-defined]
            elif kind == "histogram":
                fam.add_metric([str(index)], cumulative_buckets(value), value["sum"])  # type: ignore[attr-defined]
            else:
                fam.add_metric([str(index)], value)  # type: ignore[attr-defined]
        yield fam
