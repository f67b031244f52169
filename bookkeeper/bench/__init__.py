"""`bk bench`: the benchmarks users quote, each printing figures (never asserting them).

  limits.py   the machine's own ceilings: write+fdatasync per batch size, uvloop framed echo
  journal.py  the journal alone (no network)
  cluster.py  one bookie (E=Qw=Qa=1, --shards) and a 3/2/2 cluster with a tailing reader; cold reads
Latencies are HDR histograms in microseconds; open-loop runs record from the intended send
time (coordinated omission corrected). Every run reports peak RSS per process.
"""
from __future__ import annotations

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
    """p50/p99/p999 in milliseconds (API.md's JSON keys)."""
    h = lat.histogram()
    if h.get_total_count() == 0:
        return {"p50": 0.0, "p99": 0.0, "p999": 0.0}
    return {k: round(h.get_value_at_percentile(p) / 1000.0, 3)
            for k, p in (("p50", 50.0), ("p99", 99.0), ("p999", 99.9))}


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a live process, in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        return None
    return None


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
