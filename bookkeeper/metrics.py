"""Client metrics for a service's own Prometheus registry, and the metric names' shared scheme.

    from prometheus_client import REGISTRY
    import bookkeeper.metrics
    bookkeeper.metrics.register(REGISTRY)   # once; every client of this process is reported

Lives in: any process with BookKeeper clients. Each client records as it works (counters in
`BookKeeper.stats`, latencies in C histograms: adds in the write path's AddTracker, reads per
entry read) and adds itself to this module's set of live clients when it is made, drops out
when it is closed. `register` puts one collector into the registry; at scrape time (any thread:
prometheus_client's HTTP server scrapes from its own) it sums every live client of the
process, as a service normally has one.

Why prometheus_client is imported only inside `register`: the client does not need it (it is
a bookie dependency); a service that never asks for metrics never imports it. The names and
bucket bounds below are shared with the bookie's metrics (bookkeeper/bookie/metrics.py), which
do import it: `bookkeeper_` first, counters ending in `_total`, latencies in seconds over the
same buckets, and `client` in every client name, so a client's and a bookie's series never
collide in one Prometheus.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import Metric
    from prometheus_client.registry import CollectorRegistry

    from bookkeeper.client.client import BookKeeper

PREFIX = "bookkeeper_"
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5, 5.0, 10.0)
DURATION_BUCKETS_S = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
BYTES_BUCKETS = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)

CLIENT_PREFIX = PREFIX + "client_"

# name (after CLIENT_PREFIX) -> (kind, help). A counter's samples end in _total.
CLIENT_METRICS: dict[str, tuple[str, str]] = {
    "add_entry": ("counter", "entries added by write handles, acknowledged or failed (a recovery's "
                             "rewrites are not counted)"),
    "add_entry_errors": ("counter", "entries sent whose add failed (the handle failed: fenced, closed by "
                                    "another client, no replacement bookie, ...)"),
    "add_entry_latency_seconds": ("histogram", "add sent to add acknowledged by the ack quorum (in id order; "
                                               "resends after an ensemble change included)"),
    "read_entry": ("counter", "entries read (range reads; tailing long polls are not counted), any outcome"),
    "read_entry_errors": ("counter", "entry reads that failed on every replica of the write set"),
    "read_entry_latency_seconds": ("histogram", "entry read asked to first copy that passed its digest "
                                                "(speculative and retried replicas included)"),
    "ensemble_changes": ("counter", "ensemble changes written to ledger metadata (a failed bookie replaced)"),
    "speculative_reads": ("counter", "reads sent to a further replica because the first was slow"),
    "placement_degraded": ("counter", "ensembles or replacements placed without rack diversity (too few racks)"),
    "quarantine_overridden": ("counter", "replacements that had to pick a quarantined bookie (nothing else left)"),
    "write_lacs": ("counter", "WRITE_LAC requests sent: explicit LACs of writers that paused (client/lac_wheel.py)"),
    "quarantined_bookies": ("gauge", "bookies that failed adds lately, kept out of new ensembles "
                                     "(bookie_quarantine_s); distinct over the process's clients"),
}

# Counters kept in BookKeeper.stats under these names; add_entry and read_entry are the
# latencies observed plus the errors (a success is counted once, by its histogram).
_STATS = {"add_entry_errors": "add_errors", "read_entry_errors": "read_errors", "ensemble_changes": "ensemble_changes",
          "speculative_reads": "speculative_reads", "placement_degraded": "placement_degraded",
          "quarantine_overridden": "quarantine_overridden", "write_lacs": "write_lacs"}

_clients: weakref.WeakSet[BookKeeper] = weakref.WeakSet()
_registries: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()
_lock = threading.Lock()  # guards both sets: clients come and go on loops, scrapes run in other threads


def add_client(client: BookKeeper) -> None:
    """Report `client` from now on (BookKeeper calls this when it is made)."""
    with _lock:
        _clients.add(client)


def drop_client(client: BookKeeper) -> None:
    """Stop reporting `client` (BookKeeper calls this when it is closed; a client that is
    garbage collected unclosed drops out by itself)."""
    with _lock:
        _clients.discard(client)


def register(registry: CollectorRegistry) -> None:
    """Report this process's BookKeeper clients in `registry` (a prometheus_client
    CollectorRegistry the service already exposes). A second call with the same registry
    does nothing; a name already taken in it by another collector raises prometheus_client's
    ValueError."""
    from prometheus_client.registry import CollectorRegistry

    if not isinstance(registry, CollectorRegistry):
        raise TypeError(f"registry must be a prometheus_client CollectorRegistry, not {type(registry).__name__}")
    with _lock:
        if registry in _registries:
            return
        registry.register(_COLLECTOR)
        _registries.add(registry)


def cumulative_buckets(snapshot: Mapping[str, Any]) -> list[tuple[str, float]]:
    """A histogram snapshot's per-bucket counts as Prometheus cumulative buckets, +Inf last."""
    out, running = [], 0
    for bound, count in zip([*snapshot["bounds"], float("inf")], snapshot["counts"]):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


def client_totals() -> dict[str, Any]:
    """Every CLIENT_METRICS value over the live clients: counters and histograms summed (a
    histogram as a snapshot), quarantined bookies counted once however many clients hold them."""
    with _lock:
        clients = list(_clients)
    totals: dict[str, Any] = dict.fromkeys(_STATS, 0)
    add, read = _empty_snapshot(), _empty_snapshot()
    quarantined: set[str] = set()
    for bk in clients:
        own = dict(bk.stats)  # a copy first: the client's loop may add a key meanwhile
        for name, key in _STATS.items():
            totals[name] += own.get(key, 0)
        _merge(add, bk.add_latency.snapshot())
        _merge(read, bk.read_latency.snapshot())
        quarantined |= bk.quarantine.penalized_now()
    totals["add_entry_latency_seconds"], totals["read_entry_latency_seconds"] = add, read
    totals["add_entry"] = sum(add["counts"]) + totals["add_entry_errors"]
    totals["read_entry"] = sum(read["counts"]) + totals["read_entry_errors"]
    totals["quarantined_bookies"] = len(quarantined)
    return totals


def _empty_snapshot() -> dict[str, Any]:
    return {"bounds": list(LATENCY_BUCKETS_S), "counts": [0] * (len(LATENCY_BUCKETS_S) + 1), "sum": 0.0}


def _merge(into: dict[str, Any], snap: Mapping[str, Any]) -> None:
    """Add a client's histogram snapshot to a sum (both over LATENCY_BUCKETS_S)."""
    into["counts"] = [a + b for a, b in zip(into["counts"], snap["counts"], strict=True)]
    into["sum"] += snap["sum"]


class _ClientCollector:
    """The one collector of client metrics (prometheus_client calls collect() per scrape)."""

    def describe(self) -> list[Metric]:
        """The families with no samples: the registry checks their names against its others."""
        return list(_families(None))

    def collect(self) -> Iterator[Metric]:
        return _families(client_totals())


def _families(totals: Mapping[str, Any] | None) -> Iterator[Metric]:
    """Prometheus families of CLIENT_METRICS from client_totals() (None: names only, no samples)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
    for name, (kind, doc) in CLIENT_METRICS.items():
        full = CLIENT_PREFIX + name
        if totals is None:
            yield kinds[kind](full, doc)
        elif kind == "histogram":
            snap = totals[name]
            yield HistogramMetricFamily(full, doc, buckets=cumulative_buckets(snap), sum_value=snap["sum"])
        elif kind == "gauge":
            yield GaugeMetricFamily(full, doc, value=totals[name])
        else:
            yield CounterMetricFamily(full, doc, value=totals[name])


_COLLECTOR = _ClientCollector()
