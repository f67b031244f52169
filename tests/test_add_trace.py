"""The add trace (issue 28 item 1): a bookie records, for the peers it is told, when each add
arrived, when its journal block was sealed, when the block was durable and when the answer
was written; `bk bench neighbour` lays those beside the writer's own send and answer times.

Reference: docs/operations.md "Tracing one client's adds", bookkeeper/bookie/add_trace.py.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bookkeeper import BookKeeper
from bookkeeper.bench.neighbour import SEGMENTS, add_breakdown
from bookkeeper.bookie.add_trace import FIELDS, MAX_PEERS, MAX_RECORDS, REPORT_PAGE, AddTrace, parse_peers, parse_seconds
from bookkeeper.bookie.admin import add_trace_report
from bookkeeper.testing.cluster import LocalCluster
from tests.conftest import run

PATH = "/api/v1/bookie/add_trace"


@pytest.mark.parametrize("peers, said", [
    ([], "non-empty list"), ("127.0.0.1:5", "non-empty list"), (["127.0.0.1"], "is not 'host:port'"),
    (["127.0.0.1:0"], "is not 'host:port'"), (["127.0.0.1:70000"], "is not 'host:port'"), ([5], "is not 'host:port'"),
    ([":80"], "is not 'host:port'"), ([f"10.0.0.1:{p}" for p in range(1, MAX_PEERS + 2)], f"at most {MAX_PEERS}")])
def test_bad_peers_are_refused_naming_what_is_wrong(peers: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_peers(peers)


@pytest.mark.parametrize("seconds", [0, -1, 601, "5", True, None])
def test_bad_seconds_are_refused(seconds: Any) -> None:
    with pytest.raises(ValueError, match="seconds"):
        parse_seconds(seconds)


def test_ipv6_peers_and_seconds_in_range_are_taken() -> None:
    assert parse_peers(["::1:4000", "127.0.0.1:5"]) == {"::1:4000", "127.0.0.1:5"}
    assert parse_seconds(600) == 600.0


class _Conn:
    def __init__(self, host: str, port: int) -> None:
        self.peer = (host, port)


def test_a_trace_keeps_only_its_peers_adds_and_counts_what_it_drops() -> None:
    """C path runs (count from the item), Python-path adds (one each), a non-add response and
    a connection-less item (a fence's) are told apart; other peers' items are left out."""
    mine, other = _Conn("127.0.0.1", 4000), _Conn("127.0.0.1", 4001)
    trace = AddTrace(frozenset({"127.0.0.1:4000"}), until=100.0)
    add_resp, read_resp = (1, 0, 7, 1, 0, -1, b""), (2, 0, 8, 1, 0, -1, b"")
    items = [(mine, None, 1.0, 3, 120), (other, None, 1.0, 5, 200), (mine, add_resp, 1.5),
             (mine, read_resp, 1.5), (None, None, 1.6, 1, 40)]
    trace.record(items, (2.0, 3.0, 9, 4096), answered={mine: 3.5, other: 3.4})
    assert [list(r) for r in trace.records] == [["127.0.0.1:4000", 1.0, 2.0, 3.0, 3.5, 3, 9, 4096],
                                                ["127.0.0.1:4000", 1.5, 2.0, 3.0, 3.5, 1, 9, 4096]]
    for _ in range(MAX_RECORDS):
        trace.record([(mine, None, 4.0, 1, 40)], (4.0, 5.0, 1, 512), answered={mine: 5.0})
    report = trace.report(now=99.0, limit=MAX_RECORDS)
    assert len(report["records"]) == MAX_RECORDS and report["dropped"] == 2 and report["fields"] == list(FIELDS)
    assert len(trace._names) == 2
    del other, items
    assert list(trace._names) == [mine]  # the untraced peer's connection, gone, is not kept (weak)
    assert report["remaining_s"] == 1.0 and report["peers"] == ["127.0.0.1:4000"]


def test_a_trace_is_read_in_pages_numbered_from_its_first_record() -> None:
    """report() answers at most a page, from a record number on (dropped ones count, so a number
    stays the same record while older ones drop), with the next number and the end; the admin
    route reads every shard page by page up to the end it saw first, and leaves out a shard
    that fails or answers an error. A whole trace at once held a shard's loop 20-84 ms."""
    conn = _Conn("127.0.0.1", 4000)
    trace = AddTrace(frozenset({"127.0.0.1:4000"}), until=100.0)
    for i in range(MAX_RECORDS + 5):  # records 0-4 dropped
        trace.record([(conn, None, float(i), 1, 40)], (0.0, 0.0, 1, 512), answered={conn: 0.0})
    first = trace.report(now=0.0, start=0, limit=REPORT_PAGE)
    assert [r[1] for r in first["records"]] == [float(i) for i in range(5, 5 + REPORT_PAGE)]
    assert first["next"] == 5 + REPORT_PAGE and first["end"] == MAX_RECORDS + 5 and first["dropped"] == 5
    later = trace.report(now=0.0, start=first["next"], limit=3)
    assert [r[1] for r in later["records"]] == [float(i) for i in range(5 + REPORT_PAGE, 8 + REPORT_PAGE)]
    tail = trace.report(now=0.0, start=MAX_RECORDS + 4, limit=REPORT_PAGE)
    assert [r[1] for r in tail["records"]] == [float(MAX_RECORDS + 4)] and tail["next"] == tail["end"]

    class Sup:  # the supervisor's control calls, answered by the shards' traces; shard 2 does not
        procs = {0: None, 1: None, 2: None}  # answer (shard_call leaves a failed or refused call out)
        calls: list[tuple[int, int]] = []

        def shard_call(self, req: dict[str, Any], *, timeout_s: float, shards: list[int]) -> dict[int, Any]:
            (i,) = shards
            self.calls.append((i, req["from"]))
            if i == 2:
                return {}
            return {i: (trace if i == 0 else AddTrace(frozenset(), 0.0)).report(0.0, req["from"], req["limit"])}

    sup = Sup()
    got = add_trace_report(sup)  # type: ignore[arg-type]
    assert [s["index"] for s in got["shards"]] == [0, 1] and got["shards_failed"] == [2]
    assert [r[1] for r in got["shards"][0]["records"]] == [float(i) for i in range(5, MAX_RECORDS + 5)]
    pages = -(-MAX_RECORDS // REPORT_PAGE)
    assert [c for c in sup.calls if c[0] == 0] == [(0, 0)] + [(0, 5 + k * REPORT_PAGE) for k in range(1, pages)]
    assert got["shards"][1]["records"] == [] and got["shards"][0]["dropped"] == 5


def test_breakdown_joins_each_add_with_the_record_that_completed_its_quorum() -> None:
    """Two records per add (Qw = 2); the later answered one completed it (Qa = 2); its
    segments add up to the add's latency. An add without enough records is not joined."""
    adds = [(10.0, 10.010), (20.0, 20.002), (30.0, 30.001)]
    records = [["a:1", 10.001, 10.002, 10.006, 10.007, 1, 3, 900],   # answered first
               ["b:1", 10.001, 10.003, 10.008, 10.009, 1, 3, 900],   # completed the quorum
               ["a:1", 20.0005, 20.0006, 20.0015, 20.0016, 1, 1, 300],
               ["b:1", 20.0005, 20.0006, 20.0014, 20.0015, 1, 1, 300],
               ["a:1", 30.0002, 30.0003, 30.0007, 30.0008, 1, 1, 300]]  # one only: not joined
    out = add_breakdown(adds, records, ack_quorum=2, quantile=0.5)
    assert out["adds"] == 3 and out["joined"] == 2 and out["threshold_ms"] == 2.0 and out["slow"] == 2
    slow_first = add_breakdown(adds[:1], records, ack_quorum=2)
    assert slow_first["slow_mean_ms"] == {"to_shard": 1.0, "queued": 2.0, "sync": 5.0, "answer": 1.0,
                                          "to_client": 1.0}
    assert slow_first["slow_block_bytes_max"] == 900 and slow_first["slowest_ms"] == slow_first["slow_mean_ms"]
    assert out["slowest_ms"] == slow_first["slow_mean_ms"]
    assert sum(out["all_mean_ms"].values()) == pytest.approx(6.0, abs=0.01)  # (10 + 2) / 2 ms
    assert list(out["all_mean_ms"]) == list(SEGMENTS)
    assert add_breakdown([], records, ack_quorum=2) == {"adds": 0, "joined": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("trace"), bookies=3, shards=2, http_ports=True)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _http(port: int, method: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{PATH}", method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_traced_clients_adds_are_recorded_in_order_and_no_one_elses(cluster: LocalCluster) -> None:
    """Two clients write one add at a time; only the traced one's adds are recorded, each
    add's Qw records fall within its own send and answer times, and every record's stamps
    run arrival <= sealed <= synced <= answered. A new trace drops the old one's records;
    past its seconds a trace records no more."""
    ports = [b.http_port for b in cluster.bookies]

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as traced, \
                await BookKeeper.connect(cluster.metadata_uri) as other:
            lt = await traced.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            lo = await other.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            for _ in range(3):  # each of the 3 bookies gets an entry: every connection open
                await lt.add_entry(b"warm")
                await lo.add_entry(b"warm")
            peers = traced.pool.local_addresses()
            assert len(peers) == 3 and not set(peers) & set(other.pool.local_addresses())
            for port in ports:
                status, answer = _http(port, "POST", {"peers": peers, "seconds": 120})
                assert status == 200 and answer["peers"] == peers and answer["shards"] == [0, 1], answer
            times = []
            for i in range(50):
                t0 = time.monotonic()
                await asyncio.gather(lt.add_entry(b"t%d" % i), lo.add_entry(b"o%d" % i))
                times.append((t0, time.monotonic()))
            records = _records(ports)
            assert {r[0] for r in records} <= set(peers)
            assert sum(r[5] for r in records) == 50 * 2, "each add recorded once per bookie it went to"
            for r in records:
                assert r[1] <= r[2] <= r[3] <= r[4] and r[6] >= r[5] and r[7] > 0, r
            for t0, t1 in times:
                assert sum(1 for r in records if t0 <= r[1] and r[4] <= t1) == 2
            # A new trace replaces the running one (its records dropped) and ends by itself.
            for port in ports:
                assert _http(port, "POST", {"peers": peers, "seconds": 0.2})[0] == 200
            assert _records(ports) == []
            deadline = time.monotonic() + 30
            while any(s["remaining_s"] > 0 for port in ports for s in _http(port, "GET")[1]["shards"]):
                assert time.monotonic() < deadline, "a 0.2 s trace still running after 30 s"
                await asyncio.sleep(0.05)
            for _ in range(3):
                await lt.add_entry(b"after")
            assert _records(ports) == []
    run(main())


def _records(ports: list[int]) -> list[list[Any]]:
    out = []
    for port in ports:
        status, answer = _http(port, "GET")
        assert status == 200 and answer["shards_failed"] == []
        out += [r for shard in answer["shards"] for r in shard["records"]]
    return out


@pytest.mark.parametrize("raw, said", [
    (b"not json", "Expecting value"), (b'{"peers": ["127.0.0.1:5"]}', "body must be"),
    (b'{"peers": ["127.0.0.1:5"], "seconds": 5, "x": 1}', "body must be"),
    (b'{"peers": ["nowhere"], "seconds": 5}', "is not 'host:port'"),
    (b'{"peers": ["127.0.0.1:5"], "seconds": 9999}', "seconds")])
def test_a_bad_trace_request_is_a_400_that_changes_nothing(cluster: LocalCluster, raw: bytes, said: str) -> None:
    port = cluster.bookies[0].http_port
    status, before = _http(port, "GET")
    assert status == 200
    status, answer = _http(port, "POST", raw=raw)
    assert status == 400 and said in answer["error"], answer
    assert _http(port, "GET") == (200, before)
