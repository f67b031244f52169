"""Client metrics (bookkeeper.metrics.register): what a service's Prometheus registry shows of
the clients in its process, scraped as text and read back with prometheus_client's own parser.

Reference: Prometheus exposition format (counters `_total`, histograms with cumulative `le`
buckets ending in `+Inf` whose value is `_count`); docs/api.md, "Metrics".
"""
from __future__ import annotations

import asyncio
import gc
import math
import subprocess
import sys
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper import BookKeeper, errors, metrics
from bookkeeper._ext.client import AddTracker, LatencyHistogram
from bookkeeper.testing.cluster import LocalCluster
from tests.conftest import run

C = metrics.CLIENT_PREFIX
HISTOGRAMS = (C + "add_entry_latency_seconds", C + "read_entry_latency_seconds")


def scrape(registry: CollectorRegistry) -> dict[str, Any]:
    """The registry's exposition, parsed: {sample name: value}, and for each histogram
    {name: [(le, cumulative count), ...]} in exposition order."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out.setdefault(family.name, []).append((s.labels["le"], s.value))
            else:
                out[s.name] = s.value
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """Every scalar sample's change; a histogram's as its _count and _sum."""
    return {k: v - before[k] for k, v in after.items() if not isinstance(v, list)}


def assert_histograms_well_formed(figures: dict[str, Any]) -> None:
    """Cumulative buckets over LATENCY_BUCKETS_S, +Inf last and equal to _count."""
    for name in HISTOGRAMS:
        buckets = figures[name]
        assert [le for le, _ in buckets] == [repr(b) for b in metrics.LATENCY_BUCKETS_S] + ["+Inf"], name
        counts = [n for _, n in buckets]
        assert counts == sorted(counts), (name, counts)
        assert buckets[-1] == ("+Inf", figures[name + "_count"]), name


def fresh_registry() -> CollectorRegistry:
    """A registry with the client metrics; unclosed clients of earlier tests collected first
    (they drop out), so what a test does is what changes."""
    gc.collect()
    registry = CollectorRegistry()
    metrics.register(registry)
    return registry


# -- the histogram and the tracker (no cluster) ---------------------------------------
EDGES = [(0.0, 0), (-1.0, 0), (0.001, 0), (math.nextafter(0.001, 1.0), 1), (0.01, 1), (0.1, 2),
         (math.nextafter(0.1, 1.0), 3), (1e9, 3)]


@pytest.mark.parametrize("value,bucket", EDGES, ids=[repr(v) for v, _ in EDGES])
def test_latency_histogram_bucket_edges(value: float, bucket: int) -> None:
    """A value equal to a bound counts in that bound's bucket (Prometheus `le`); just above the
    last bound, in +Inf (the last count)."""
    h = LatencyHistogram((0.001, 0.01, 0.1))
    h.observe(value)
    snap = h.snapshot()
    assert snap["bounds"] == [0.001, 0.01, 0.1]
    assert snap["counts"] == [int(i == bucket) for i in range(4)]
    assert snap["sum"] == value and h.count == 1


def test_latency_histogram_buckets_as_the_bookie_histogram() -> None:
    """Over the shared latency bounds, every bound and its neighbours land where bisect_left puts
    them (bookkeeper/bookie/metrics.py's Histogram rule), and the sum is the values' sum."""
    h = LatencyHistogram(metrics.LATENCY_BUCKETS_S)
    values = [v for b in metrics.LATENCY_BUCKETS_S for v in (math.nextafter(b, 0.0), b, math.nextafter(b, 1e9))]
    expected = [0] * (len(metrics.LATENCY_BUCKETS_S) + 1)
    for v in values:
        h.observe(v)
        expected[bisect_left(metrics.LATENCY_BUCKETS_S, v)] += 1
    snap = h.snapshot()
    assert snap["counts"] == expected and h.bounds == metrics.LATENCY_BUCKETS_S
    assert snap["sum"] == pytest.approx(sum(values))


@pytest.mark.parametrize("bounds", [(), (0.1, 0.1), (0.2, 0.1), (math.inf,), (math.nan,)],
                         ids=["empty", "repeated", "decreasing", "inf", "nan"])
def test_latency_histogram_refuses_bad_bounds(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="bound"):
        LatencyHistogram(bounds)


def test_tracker_observes_each_acknowledged_entry_once() -> None:
    """3/2/2: an entry is observed when it is acknowledged (Qa acks and every earlier entry
    acknowledged), not at its first ack; a run acknowledged at once is observed whole."""
    h = LatencyHistogram(metrics.LATENCY_BUCKETS_S)
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=2, latency=h)
    for e in range(3):
        t.add(e, 1)
    t.ack(1, 1)
    t.ack(1, 2)
    t.ack(0, 0)
    assert h.count == 0  # entry 1 has its quorum but waits for entry 0
    assert t.ack(0, 1) == [(0, 1), (1, 2)] and h.count == 2
    t.ack(2, 2)
    assert h.count == 2
    t.ack(2, 0)
    assert h.count == 3 and t.lac == 2
    assert h.snapshot()["sum"] >= 0.0


def test_tracker_without_a_histogram_records_nothing() -> None:
    """latency=None (a recovery's rewrites): acknowledged as ever, observed nowhere."""
    t = AddTracker(ensemble_size=1, write_quorum=1, ack_quorum=1)
    t.add(0, 1)
    assert t.ack(0, 0) == [(0, 1)]


# -- register ----------------------------------------------------------------------------
def test_register_twice_is_harmless_and_names_are_checked() -> None:
    """A second register() with the same registry neither raises nor duplicates a family; a
    name another collector holds in the registry is refused; a non-registry is a TypeError."""
    registry = CollectorRegistry()
    metrics.register(registry)
    metrics.register(registry)
    families = [f.name for f in text_string_to_metric_families(generate_latest(registry).decode())]
    assert sorted(families) == sorted(C + n for n in metrics.CLIENT_METRICS)
    taken = CollectorRegistry()
    Counter(C + "add_entry", "the service's own", registry=taken)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.register(taken)
    with pytest.raises(TypeError, match="CollectorRegistry"):
        metrics.register("registry")  # type: ignore[arg-type]


def test_the_client_does_not_import_prometheus_client() -> None:
    """prometheus_client is a bookie dependency: a client, bookkeeper.metrics included, runs
    without it until register() is called."""
    code = ("import sys, bookkeeper, bookkeeper.sync, bookkeeper.metrics; "
            "assert 'prometheus_client' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- real clusters -------------------------------------------------------------------------
def test_adds_reads_and_add_errors_are_counted_exactly(cluster5: LocalCluster) -> None:
    """A client adds 30 entries (single, batched, with callbacks) and reads 35; a recovery
    open by another client then fences a second ledger, and a batch of 4 sent to it fails.
    The scrape (from another thread, as an HTTP server's) shows exactly those counts, the
    histograms well formed; once the clients close, the figures are back where they were."""
    registry = fresh_registry()

    async def main() -> None:
        before = await asyncio.to_thread(scrape, registry)
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            for i in range(5):
                await lh.add_entry(b"a%d" % i)
            await lh.add_entries_async([b"b%d" % i for i in range(20)])
            called: list[int] = []
            all_called = asyncio.get_running_loop().create_future()

            def callback(entry_id: int, err: errors.BKError | None) -> None:
                assert err is None
                called.append(entry_id)
                if len(called) == 5:
                    all_called.set_result(None)
            for i in range(5):
                lh.add_entry_callback(b"c%d" % i, callback)
            await all_called
            await lh.close()
            rh = await bk.open_ledger(lh.ledger_id)
            assert len(await rh.read(0, 29)) == 30
            assert len(await rh.read(5, 9)) == 5

            fenced = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await fenced.add_entry(b"x")
            async with await BookKeeper.connect(cluster5.metadata_uri) as other:
                await other.open_ledger(fenced.ledger_id)  # recovery: fences the writer
            with pytest.raises(errors.LedgerFencedError):
                await fenced.add_entries_async([b"y%d" % i for i in range(4)])

            after = await asyncio.to_thread(scrape, registry)
            d = delta(after, before)
            assert d[C + "add_entry_total"] == 31 + 4
            assert d[C + "add_entry_errors_total"] == 4
            assert d[C + "add_entry_latency_seconds_count"] == 31
            assert d[C + "add_entry_latency_seconds_sum"] > 0
            assert d[C + "read_entry_total"] == 35
            assert d[C + "read_entry_errors_total"] == 0
            assert d[C + "read_entry_latency_seconds_count"] == 35
            assert d[C + "read_entry_latency_seconds_sum"] > 0
            assert d[C + "ensemble_changes_total"] == 0 and d[C + "quarantined_bookies"] == 0
            assert_histograms_well_formed(after)
        closed = await asyncio.to_thread(scrape, registry)
        assert delta(closed, before) == pytest.approx(dict.fromkeys(delta(closed, before), 0.0))
        assert {k: closed[k] for k in HISTOGRAMS} == {k: before[k] for k in HISTOGRAMS}
    run(main())


def test_ensemble_change_quarantine_speculative_reads_and_read_errors(
        make_cluster: Callable[..., LocalCluster]) -> None:
    """3 bookies, 2/2/2 ledgers. A hung first replica makes reads speculate; a killed ensemble
    bookie makes the writer change its ensemble (one change) and quarantine it (one bookie);
    with every bookie gone, each entry read fails on its whole write set (one error each).
    The exported counters are the client's own, summed."""
    cluster = make_cluster(bookies=3, shards=1)
    registry = fresh_registry()

    async def main() -> None:
        before = scrape(registry)
        async with await BookKeeper.connect(cluster.metadata_uri, placement="random",
                                            speculative_read_timeout_ms=50) as bk:
            lh = await bk.create_ledger(ensemble=2, write_quorum=2, ack_quorum=2)
            await lh.add_entries_async([b"s%d" % i for i in range(10)])
            await lh.close()
            rh = await bk.open_ledger(lh.ledger_id)
            hung = cluster_bookie(cluster, lh.metadata.ensembles[0][0])  # first replica of even entries
            hung.hang()
            try:
                assert len(await rh.read(0, 9)) == 10
            finally:
                hung.resume()

            lh = await bk.create_ledger(ensemble=2, write_quorum=2, ack_quorum=2)
            await lh.add_entries_async([b"e%d" % i for i in range(10)])
            cluster_bookie(cluster, lh.metadata.ensembles[0][1]).kill()
            await lh.add_entries_async([b"f%d" % i for i in range(10)])
            await lh.close()
            assert len(lh.metadata.ensembles) == 2
            rh = await bk.open_ledger(lh.ledger_id)
            for b in cluster.bookies:
                b.kill()
            for entry_id in range(20):  # one by one: a range read raises at its first failure
                with pytest.raises(errors.BKError):
                    await rh.read(entry_id, entry_id)

            d = delta(scrape(registry), before)
            assert d[C + "add_entry_total"] == 30 and d[C + "add_entry_errors_total"] == 0
            assert d[C + "add_entry_latency_seconds_count"] == 30
            assert d[C + "ensemble_changes_total"] == bk.stats["ensemble_changes"] == 1
            assert d[C + "quarantined_bookies"] == 1
            assert d[C + "speculative_reads_total"] == bk.stats["speculative_reads"] >= 5
            assert d[C + "read_entry_latency_seconds_count"] == 10
            assert d[C + "read_entry_errors_total"] == 20
            assert d[C + "read_entry_total"] == 30
    run(main())


def cluster_bookie(cluster: LocalCluster, bookie_id: str) -> Any:
    return next(b for b in cluster.bookies if b.bookie_id == bookie_id)
