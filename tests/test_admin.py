"""Operators informed: every shard's Prometheus metrics on the supervisor's http_port (parsed with
prometheus_client's own parser), the admin routes, and a decommission marker turning a live
bookie read-only (and back when removed).

Reference: issue 10 item 4, docs/api.md section 10; Apache BookKeeper's HTTP admin and stats.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper import BookKeeper
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.testing.cluster import LocalBookie, LocalCluster, free_port_block
from tests.conftest import run


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("admin"), bookies=3, shards=2,
                     bookie_conf={"disk_check_interval_s": 0.5})
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def watched(cluster: LocalCluster) -> tuple[LocalBookie, int]:
    port = free_port_block()
    return cluster.add_bookie(http_port=port), port


def get(port: int, path: str, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read()
            return r.status, body.decode() if path == "/metrics" else json.loads(body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """name -> {labels as sorted tuple: value} for every sample."""
    status, text = get(port, "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, {}).items() if all((k, m) in labels for k, m in match.items()))


async def write_to(cluster: LocalCluster, bookie_id: str, entries: int) -> int:
    """Write `entries` to a ledger that has `bookie_id` in every write set if one can be made
    (the 50th try is used regardless); returns its id."""
    async with await BookKeeper.connect(cluster.metadata_uri) as bk:
        for attempt in range(50):
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            if bookie_id in lh.metadata.ensembles[0] or attempt == 49:
                break
            await lh.close()
        for fut in [lh.add_entry_async(b"m" * 100) for _ in range(entries)]:
            await fut
        await lh.read(0, lh.last_add_confirmed - 1)
        await lh.close()
        return lh.ledger_id


def test_metrics_parse_and_move_under_load(cluster: LocalCluster, watched: tuple[LocalBookie, int]) -> None:
    bookie, port = watched
    before = scrape(port)
    assert total(before, "bookkeeper_bookie_shards_up") == 2
    assert {dict(k)["shard"] for k in before["bookkeeper_add_entry_total"]} == {"0", "1"}
    run(write_to(cluster, bookie.bookie_id, 500))
    after = scrape(port)
    added = total(after, "bookkeeper_add_entry_total") - total(before, "bookkeeper_add_entry_total")
    assert added >= 500
    hist = total(after, "bookkeeper_add_entry_latency_seconds_count") - \
        total(before, "bookkeeper_add_entry_latency_seconds_count")
    assert hist >= 500
    inf = total(after, "bookkeeper_add_entry_latency_seconds_bucket", le="+Inf")
    assert inf == total(after, "bookkeeper_add_entry_latency_seconds_count")
    assert total(after, "bookkeeper_journal_sync_latency_seconds_count") > \
        total(before, "bookkeeper_journal_sync_latency_seconds_count")
    assert total(after, "bookkeeper_read_entry_total") > total(before, "bookkeeper_read_entry_total")
    assert total(after, "bookkeeper_journal_batch_entries_sum") >= 500
    assert total(after, "bookkeeper_ledgers") >= 1
    for name in ("bookkeeper_connections", "bookkeeper_write_cache_bytes", "bookkeeper_paused_senders",
                 "bookkeeper_journal_queue_bytes", "bookkeeper_disk_usage_ratio", "bookkeeper_bad_frames_total",
                 "bookkeeper_checkpoint_duration_seconds_count", "bookkeeper_compaction_duration_seconds_count",
                 "bookkeeper_entry_log_bytes", "bookkeeper_bookie_readonly"):
        assert name in after, name
    kinds = {dict(k)["kind"] for k in after["bookkeeper_disk_usage_ratio"]}
    assert kinds == {"journal", "ledger"}


def test_admin_routes(cluster: LocalCluster, watched: tuple[LocalBookie, int]) -> None:
    bookie, port = watched
    assert get(port, "/api/v1/bookie/state") == (200, {
        "bookie_id": bookie.bookie_id, "state": "writable", "reason": None,
        "shards": [{"index": 0, "state": "writable", "reason": None},
                   {"index": 1, "state": "writable", "reason": None}]})
    status, info = get(port, "/api/v1/bookie/info")
    assert status == 200 and info["bookie_id"] == bookie.bookie_id and info["ledgers"] >= 0
    assert sorted(d["kind"] for d in info["dirs"]) == ["journal", "ledger"]
    assert all(0 < d["free_bytes"] <= d["total_bytes"] for d in info["dirs"])
    status, gc = get(port, "/api/v1/bookie/gc", method="POST")
    assert status == 200 and gc["shards_failed"] == [] and len(gc["shards"]) == 2
    assert {"bytes_reclaimed", "logs_deleted", "logs_compacted", "ledgers_deleted", "duration_s"} <= set(gc)
    assert get(port, "/api/v1/bookie/gc")[0] == 405
    assert get(port, "/api/v1/autorecovery/status")[0] == 404  # autorecovery = false here
    assert get(port, "/nope")[0] == 404


def _wait_registered_as(store: ZkMetadataStore, bookie_id: str, readonly: bool, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while bookie_id not in store.get_bookies(readonly=readonly) or bookie_id in store.get_bookies(
            readonly=not readonly):
        assert time.monotonic() < deadline, f"{bookie_id} not registered {'read-only' if readonly else 'writable'}"
        time.sleep(0.1)


def test_decommission_marker_turns_a_live_bookie_readonly(cluster: LocalCluster,
                                                          watched: tuple[LocalBookie, int]) -> None:
    """The marker `bk decommission` sets: the bookie re-registers read-only at once (adds get
    READ_ONLY, writers move on), says why, and is writable again when the marker goes; a
    restart while marked stays read-only."""
    bookie, port = watched
    store = ZkMetadataStore(cluster.metadata_uri, create=False)
    try:
        store.set_decommissioning(bookie.bookie_id)
        _wait_registered_as(store, bookie.bookie_id, readonly=True)
        status, state = get(port, "/api/v1/bookie/state")
        assert state["state"] == "readonly" and state["reason"] == "being decommissioned"
        assert {s["state"] for s in state["shards"]} == {"readonly"}
        before = scrape(port)
        run(write_to(cluster, "nobody", 50))  # new ensembles leave the read-only bookie out
        assert total(scrape(port), "bookkeeper_add_entry_total") == total(before, "bookkeeper_add_entry_total")
        bookie.stop()
        bookie.start()
        _wait_registered_as(store, bookie.bookie_id, readonly=True, timeout_s=60)
        store.clear_decommissioning(bookie.bookie_id)
        _wait_registered_as(store, bookie.bookie_id, readonly=False)
        assert get(port, "/api/v1/bookie/state")[1]["state"] == "writable"
    finally:
        store.clear_decommissioning(bookie.bookie_id)
        store.close()
