"""`bk bench`: the benchmarks users quote, each printing figures (never asserting them).

  limits.py   the machine's own ceilings: write+fdatasync per batch size, uvloop framed echo
  journal.py  the journal alone (no network)
  cluster.py  one bookie (E=Qw=Qa=1, --shards) and a 3/2/2 cluster with a tailing reader; cold reads
Latencies are HDR histograms in microseconds; open-loop runs record from the intended send
time (coordinated omission corrected). Every run reports peak RSS per process.
"""
from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

LATENCY_MAX_US = 60_000_000


class Latencies:
    """Latency samples in microseconds, counted per value, folded into an HDR histogram when read.

    Why not record into HdrHistogram directly: its record_value is pure Python (~2 us), which
    at 100,000 adds/s is a fifth of the load generator's CPU. Hot loops add to `counts`.
    """

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: defaultdict[int, int] = defaultdict(int)

    def record_value(self, us: int) -> None:
        self.counts[us] += 1

    def histogram(self) -> HdrHistogram:
        h = HdrHistogram(1, LATENCY_MAX_US, 3)
        for us, n in self.counts.items():
            h.record_value(min(max(1, us), LATENCY_MAX_US), n)
        return h


def histogram() -> Latencies:
    return Latencies()


def latency_ms(lat: Latencies) -> dict[str, float]:
    """p50/p99/p999 in milliseconds (docs/api.md's JSON keys), none past the largest sample:
    the histogram answers a bucket's highest equivalent value, up to 0.1 % above it (a p99
    of 39.327 ms over a max of 39.325 ms, in a short phase whose p99 was its max)."""
    h = lat.histogram()
    if h.get_total_count() == 0:
        return {"p50": 0.0, "p99": 0.0, "p999": 0.0}
    top = min(max(1, max(lat.counts)), LATENCY_MAX_US)
    return {k: round(min(h.get_value_at_percentile(p), top) / 1000.0, 3)
            for k, p in (("p50", 50.0), ("p99", 99.0), ("p999", 99.9))}


def _status_kb(pid: int, field: str) -> int | None:
    """A kB field of /proc/PID/status ("VmHWM:", "RssAnon:", ...; None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _status_mb(pid: int, field: str) -> float | None:
    """A kB field of /proc/PID/status, in MiB (None once the process is gone)."""
    kb = _status_kb(pid, field)
    return None if kb is None else round(kb / 1024.0, 1)


def rss_anon_kb(pid: int) -> int | None:
    """RssAnon of a live process, in KiB: the memory it allocated, without the file pages it
    maps (a shard's entry logs and index map), which come and go with the page cache. Why
    KiB: per-ledger figures divide a small growth by the ledgers that made it."""
    return _status_kb(pid, "RssAnon:")


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak RSS) of a live process, in MiB."""
    return _status_mb(pid, "VmHWM:")


def rss_mb(pid: int) -> float | None:
    """VmRSS of a live process, in MiB."""
    return _status_mb(pid, "VmRSS:")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used, from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ProcessWatch:
    """CPU time and RSS of the processes under test, over a run.

    Why: every figure must say what limits it. The CPU each process spends per operation
    shows which one saturates first; RSS sampled through a sustained run shows whether a
    shard's memory stays flat (the journal's backpressure) or grows.
    """

    def __init__(self, procs: dict[str, int]) -> None:
        self.procs = procs
        self.rss: dict[str, list[float]] = {name: [] for name in procs}

    def cpu(self) -> dict[str, float]:
        return {name: c for name, pid in self.procs.items() if (c := cpu_seconds(pid)) is not None}

    def per_op(self, before: dict[str, float], ops: int, seconds: float) -> dict[str, dict[str, float]]:
        """CPU per operation (us) and CPU use (% of one core) of each process since `before`."""
        after = self.cpu()
        return {name: {"cpu_us_per_op": round((after[name] - before[name]) / max(1, ops) * 1e6, 2),
                       "cpu_percent": round((after[name] - before[name]) / seconds * 100, 1)}
                for name in after if name in before}

    def sample_rss(self) -> None:
        for name, pid in self.procs.items():
            v = rss_mb(pid)
            if v is not None:
                self.rss[name].append(v)

    async def sample_rss_every(self, interval_s: float) -> None:
        """Sample RSS until cancelled."""
        while True:
            self.sample_rss()
            await asyncio.sleep(interval_s)

    def rss_summary(self) -> dict[str, dict[str, Any]]:
        """Per process: RSS (MiB) at eight evenly spaced moments of the run, and the highest seen."""
        return {name: {"max": max(v), "over_run": [v[min(len(v) - 1, i * len(v) // 7)] for i in range(8)]}
                for name, v in self.rss.items() if v}


def self_rss() -> dict[str, float | None]:
    return {f"bench-client[{os.getpid()}]": peak_rss_mb(os.getpid())}


@dataclass(slots=True)
class BenchResult:
    """One measured configuration; `row` is what the human table shows."""

    name: str
    ops_per_s: float
    mb_per_s: float
    latency: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ops_per_s": round(self.ops_per_s, 1), "mb_per_s": round(self.mb_per_s, 3),
                "latency_ms": self.latency, **self.extra}
