"""The Grafana dashboard in docs/grafana/ draws what bookies expose: every metric its panels
query appears in a real bookie's /metrics (parsed with prometheus_client's parser), so a
renamed metric cannot leave a panel silently empty."""
from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper.client import BookKeeper
from bookkeeper.testing.cluster import LocalCluster, free_port_block
from bookkeeper.testing.waiting import wait_until
from tests.conftest import run

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "bookkeeper-bookies.json"


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def test_dashboard_is_well_formed() -> None:
    """Importable anywhere: a datasource input, unique ids, every panel with a query."""
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"instance", "shard"}
    for p in panels(dash):
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]), p["title"]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Sample names of one bookie's /metrics after adds, reads and a GC pass (auto-recovery on,
    so its gauges are there too)."""
    port = free_port_block()
    c = LocalCluster(tmp_path_factory.mktemp("grafana"), bookies=0, shards=1)
    c.start()
    try:
        c.add_bookie(http_port=port, autorecovery=True)

        async def traffic() -> None:
            async with await BookKeeper.connect(c.metadata_uri) as bk:
                lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1)
                for fut in [lh.add_entry_async(b"g" * 100) for _ in range(50)]:
                    await fut
                await lh.read(0, 10)
                await lh.close()

        run(traffic())
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/bookie/gc", method="POST")
        urllib.request.urlopen(req, timeout=60).read()

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                return r.read().decode()

        # Auto-recovery's gauges appear once its worker has started (after the bookie is ready).
        text = wait_until("auto-recovery's gauges in /metrics",
                          lambda: t if "bookkeeper_autorecovery_auditor_zk_writes" in (t := metrics()) else None,
                          timeout_s=60)
        yield {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    finally:
        c.stop()


def test_every_metric_the_dashboard_queries_is_exposed(scraped: set[str]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    queried = {name for p in panels(dash) for t in p["targets"] for name in re.findall(r"bookkeeper_[a-z0-9_]+", t["expr"])}
    queried |= {name for v in dash["templating"]["list"] for name in re.findall(r"bookkeeper_[a-z0-9_]+", v["definition"])}
    assert len(queried) >= 25
    assert queried - scraped == set(), f"the dashboard queries metrics no bookie exposes: {sorted(queried - scraped)}"
    histograms = {n[: -len("_bucket")] for n in scraped if n.endswith("_bucket")}
    assert {"bookkeeper_add_entry_latency_seconds", "bookkeeper_journal_sync_latency_seconds"} <= histograms
