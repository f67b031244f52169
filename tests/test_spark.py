"""The "bookkeeper" Spark source on a real local[2] SparkSession and a real cluster.

Reference: issue 12's acceptance list; issue 22 item 5 (failOnDataLoss, as Kafka's source);
issue 27 items 1 and 5 (docs/spark.md's programs run as written; skipUnreadable); docs/api.md
section 7; PySpark 4's Python Data Source API (pyspark.sql.datasource). Checked:
rows equal what was written (count and a CRC sum per ledger computed in Spark), partitions as
the options say, ledgers of other passwords or digests in a range failing the read or skipped,
open ledgers skipped or read to their LAC without fencing, a killed bookie, a
corrupt entry on every replica, stream reads by position, a streaming query stopped and
restarted from its checkpoint, truncation under a query (between two triggers, under a
start position, between planning and reading) failing it or skipped, logged and counted,
Trigger.AvailableNow runs, and docs/spark.md's two whole programs (examples/spark_*.py) shown
verbatim and run as subprocesses against this module's cluster.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import bookkeeper.sync
from bookkeeper import BookKeeper
from bookkeeper.meta.ledger_metadata import DigestType, LedgerState
from bookkeeper.stream import Position
from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.testing.waiting import wait_until
from tests.conftest import run

pytestmark = [pytest.mark.cluster, pytest.mark.runtime(290)]
PASSWORD = b"spark"
BIG = 10_000  # entries of the one big ledger: 4 partitions at max_entries_per_partition=3000


@dataclass
class Written:
    """What the module fixture wrote: per ledger, entry count and the sum of CRC32s of the payloads."""

    closed: dict[int, tuple[int, int]]
    big: int
    small_quorum: list[int]
    replicated: list[int]


def payload(lid: int, e: int, size: int) -> bytes:
    return (b"%d:%d:" % (lid, e)).ljust(size, b"x")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """3 bookies x 1 shard, private to this module (a test kills a bookie)."""
    c = LocalCluster(tmp_path_factory.mktemp("spark"), bookies=3, shards=1)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def written(cluster: LocalCluster) -> Written:
    """20 closed ledgers: 10 at 3/2/2 (one of 10,000 entries), 10 at 1/1/1, 40-2,000 entries each."""
    async def write() -> Written:
        closed: dict[int, tuple[int, int]] = {}
        small, replicated = [], []
        async with await BookKeeper.connect(cluster.metadata_uri, max_outstanding_adds=200_000) as bk:
            for i in range(20):
                e, w, a = (3, 2, 2) if i < 10 else (1, 1, 1)
                n = BIG if i == 0 else 40 + 100 * i
                lh = await bk.create_ledger(ensemble=e, write_quorum=w, ack_quorum=a, password=PASSWORD)
                datas = [payload(lh.ledger_id, k, 100 if i == 0 else 20 + k % 200) for k in range(n)]
                futs = [lh.add_entry_async(d) for d in datas]
                for f in futs:
                    await f
                await lh.close()
                closed[lh.ledger_id] = (n, sum(zlib.crc32(d) for d in datas))
                (replicated if i < 10 else small).append(lh.ledger_id)
        return Written(closed, replicated[0], small, replicated)
    return run(write())


def read_ledgers(spark: Any, cluster: LocalCluster, ledgers: str, **options: str) -> Any:
    reader = (spark.read.format("bookkeeper").option("metadata_uri", cluster.metadata_uri)
              .option("ledgers", ledgers).option("password", PASSWORD.decode()))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def per_ledger(df: Any) -> dict[int, tuple[int, int]]:
    """Count and the sum of crc32(data) per ledger, computed by Spark."""
    from pyspark.sql import functions as F
    rows = df.groupBy("ledger_id").agg(F.count("*").alias("n"), F.sum(F.crc32("data")).alias("crc")).collect()
    return {r["ledger_id"]: (r["n"], r["crc"]) for r in rows}


def test_bulk_read_of_twenty_ledgers_equals_what_was_written(spark, cluster, written: Written) -> None:
    """Ids and ranges select the ledgers; every row comes back once (count and CRC sum per ledger);
    the 10,000-entry ledger is split into max_entries_per_partition ranges, the rest one each."""
    ids = sorted(written.closed)
    df = read_ledgers(spark, cluster, f"{ids[0]}-{ids[9]},{ids[10]},{ids[11]}-{ids[-1] + 1000}",
                      max_entries_per_partition="3000")
    assert df.columns == ["ledger_id", "entry_id", "data"]
    assert df.rdd.getNumPartitions() == 4 + 19
    assert per_ledger(df) == written.closed
    first = df.where(f"ledger_id = {written.big} and entry_id in (0, {BIG - 1})").orderBy("entry_id").collect()
    assert [r["data"] for r in first] == [payload(written.big, 0, 100), payload(written.big, BIG - 1, 100)]


def test_pushed_down_id_filters_plan_only_what_they_select(spark, cluster, written: Written) -> None:
    """With filter pushdown on (Spark's setting and the pushdown_filters option), ledger_id /
    entry_id comparisons become the planned ranges: one partition for 1,000 entries of the big
    ledger, and exactly those rows; filters the source does not take are still applied."""
    ids = sorted(written.closed)
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        df = read_ledgers(spark, cluster, f"{ids[0]}-{ids[-1]}", max_entries_per_partition="3000",
                          pushdown_filters="true")
        assert df.rdd.getNumPartitions() == 23
        sel = df.where(f"ledger_id = {written.big} and entry_id >= 2000 and entry_id < 3000")
        assert sel.rdd.getNumPartitions() == 1
        assert sorted(r["entry_id"] for r in sel.collect()) == list(range(2000, 3000))
        other = df.where(f"ledger_id > {ids[17]} and entry_id % 2 = 0")  # a filter Spark keeps
        assert per_ledger(other) == {lid: (sum(1 for k in range(n) if k % 2 == 0), per_ledger(
            df.where(f"ledger_id = {lid} and entry_id % 2 = 0"))[lid][1])
            for lid, (n, _) in written.closed.items() if lid > ids[17]}
    finally:
        spark.conf.unset("spark.sql.python.filterPushdown.enabled")


def test_a_single_missing_id_fails_and_a_bad_option_is_named(spark, cluster, written: Written) -> None:
    """A single id naming no ledger fails the read; ids in a range naming none are skipped; bad options are named."""
    with pytest.raises(Exception, match="ledger 999999, named in the ledgers option, does not exist"):
        read_ledgers(spark, cluster, "999999").count()
    assert read_ledgers(spark, cluster, "999990-999999").count() == 0
    with pytest.raises(Exception, match="max_entries_per_partition must be a positive integer"):
        read_ledgers(spark, cluster, "1", max_entries_per_partition="0").count()
    with pytest.raises(Exception, match="is not an id or an inclusive range"):
        read_ledgers(spark, cluster, "1,x").count()


def _ledger(bk: bookkeeper.sync.BookKeeper, entries: int, password: bytes,
            digest: DigestType = DigestType.CRC32C) -> tuple[int, int, int]:
    """A closed 3/2/2 ledger: (id, entries, payload bytes)."""
    lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=password, digest=digest)
    datas = [b"%d:%d" % (lh.ledger_id, k) for k in range(entries)]
    for d in datas:
        lh.add_entry(d)
    lh.close()
    return lh.ledger_id, entries, sum(map(len, datas))


def test_skip_unreadable_skips_what_a_range_caught_and_fails_on_what_was_named(spark, cluster, caplog) -> None:
    """A range over ledgers of two passwords and a MAC ledger: by default the read fails naming the
    first ledger it cannot open (and the option); with skipUnreadable=true it reads the others,
    whole, and the planner logs one WARNING naming and counting the skipped. A ledger named by
    its id fails either way; a bad value fails at load."""
    import logging

    from pyspark.sql import functions as F

    from bookkeeper.spark.ledgers import plan_ledgers
    from bookkeeper.spark.options import SourceOptions
    with bookkeeper.sync.BookKeeper.connect(cluster.metadata_uri) as bk:
        a, b, c, d = (_ledger(bk, 30, PASSWORD), _ledger(bk, 20, b"other"),
                      _ledger(bk, 10, PASSWORD, DigestType.MAC), _ledger(bk, 50, PASSWORD))
    ids = f"{a[0]}-{d[0]}"
    with pytest.raises(Exception, match=re.escape(f"UnauthorizedError: ledger {b[0]}: wrong password (option "
                                                  f"password; skipUnreadable=true skips the ledgers of a range")):
        read_ledgers(spark, cluster, ids).count()
    df = read_ledgers(spark, cluster, ids, skipUnreadable="true")
    got = {r["ledger_id"]: (r["n"], r["bytes"]) for r in df.groupBy("ledger_id").agg(
        F.count("*").alias("n"), F.sum(F.length("data")).alias("bytes")).collect()}
    assert got == {a[0]: a[1:], d[0]: d[1:]}
    with pytest.raises(Exception, match=re.escape(f"UnauthorizedError: ledger {b[0]}: wrong password (option password)")):
        read_ledgers(spark, cluster, f"{b[0]},{ids}", skipUnreadable="true").count()
    with pytest.raises(Exception, match=re.escape(f"DigestMismatchError: ledger {c[0]}: digest mac, not crc32c "
                                                  f"(option digest)")):
        read_ledgers(spark, cluster, str(c[0]), skipUnreadable="true").count()
    with pytest.raises(Exception, match="option skipUnreadable must be true or false, not 'yes'"):
        read_ledgers(spark, cluster, ids, skipUnreadable="yes")
    caplog.set_level(logging.WARNING, logger="bookkeeper.spark.ledgers")
    opts = SourceOptions.parse({"metadata_uri": cluster.metadata_uri, "ledgers": ids,
                                "password": PASSWORD.decode(), "skipUnreadable": "true"})
    assert sorted({r.ledger_id for r in run(plan_ledgers(opts))}) == [a[0], d[0]]
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bookkeeper.spark.ledgers"] == [
        (logging.WARNING, f"skipped 2 of 4 ledgers that cannot be opened with this read's password and digest "
                          f"(skipUnreadable=true): {b[0]} (wrong password), {c[0]} (digest mac, not crc32c)")]


def test_open_ledger_is_skipped_or_read_to_its_lac_and_never_fenced(spark, cluster, written: Written) -> None:
    """An open ledger is skipped by default; with include_open it is read up to its LAC, and its
    writer keeps writing afterwards (nothing fenced it)."""
    with bookkeeper.sync.BookKeeper.connect(cluster.metadata_uri) as bk:
        lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=PASSWORD)
        for k in range(500):
            lh.add_entry(b"open-%d" % k)
        lid = str(lh.ledger_id)
        assert read_ledgers(spark, cluster, lid).count() == 0
        df = read_ledgers(spark, cluster, lid, include_open="true")
        got = sorted(r["entry_id"] for r in df.collect())
        assert got == list(range(len(got))) and 498 <= len(got) <= 500
        lh.add_entry(b"after the read")
        assert bk.ledger_metadata(lh.ledger_id).state is LedgerState.OPEN
        lh.close()


def test_read_survives_a_killed_bookie(spark, cluster, written: Written) -> None:
    """With a bookie killed before the read, the replicated ledgers are read whole from the others."""
    victim = cluster.bookies[0]
    victim.kill()
    try:
        ids = ",".join(map(str, written.replicated[1:]))
        want = {lid: written.closed[lid] for lid in written.replicated[1:]}
        assert per_ledger(read_ledgers(spark, cluster, ids)) == want
    finally:
        victim.start()
        cluster.wait_registered()


def test_corrupt_entry_on_every_replica_fails_the_job_naming_it(spark, cluster) -> None:
    """An entry whose bytes are damaged on every replica fails the task with the ledger and entry
    named (DigestMismatchError), never a silently short result."""
    with bookkeeper.sync.BookKeeper.connect(cluster.metadata_uri) as bk:
        lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=PASSWORD)
        for k in range(20):
            if k == 13:
                _damage_next_entry(lh)
            lh.add_entry(b"entry %d" % k)
        lh.close()
    with pytest.raises(Exception, match=rf"ledger {lh.ledger_id}.*entry {lh.ledger_id}:13.*DigestMismatch|"
                                        rf"DigestMismatchError.*ledger {lh.ledger_id}.*entry {lh.ledger_id}:13"):
        read_ledgers(spark, cluster, str(lh.ledger_id)).collect()


def _damage_next_entry(lh: bookkeeper.sync.WriteHandle) -> None:
    """The next entry leaves the client with one payload byte flipped after its checksum was
    computed: every replica stores the same damaged bytes (bookies do not check digests).
    The handle's usual send path encodes in C (AddTracker.send_entries), past any Python hook,
    so for this entry the handle takes the per-entry path (as a recovery's rewrite does),
    which encodes through the digest manager."""
    handle = lh._h  # the asyncio handle behind the blocking view
    real = handle._digest

    class Damaging:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode(self, entry_id: int, lac: int, length: int, data: bytes) -> bytes:
            handle._digest = real
            handle._recovery = False
            out = bytearray(real.encode(entry_id, lac, length, data))
            out[-1] ^= 0xFF
            return bytes(out)
    handle._digest = Damaging()
    handle._recovery = True


def test_stream_batch_read_by_positions(spark, cluster) -> None:
    """A stream read in batch: every record once, with its position and txid; startingOffsets is
    inclusive and endingOffsets exclusive, across segments."""
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, "spark") as ns:
        ns.create_stream("batch")
        with ns.open_writer("batch", segment_max_records=700) as w:
            ps = w.write_batch([b"rec-%d" % i for i in range(3000)])
    base = spark.read.format("bookkeeper").option("metadata_uri", cluster.metadata_uri).option("stream", "batch") \
        .option("namespace", "spark").option("max_entries_per_partition", "1")
    rows = base.load().orderBy("txid").collect()
    assert [r["data"] for r in rows] == [b"rec-%d" % i for i in range(3000)]
    assert [r["position"] for r in rows] == [str(p) for p in ps]
    part = base.option("startingOffsets", str(ps[650])).option("endingOffsets", str(ps[2100])).load()
    assert sorted(r["txid"] for r in part.collect()) == list(range(650, 2100))


def test_streaming_query_restarted_from_checkpoint_writes_each_record_once(spark, cluster, tmp_path: Path) -> None:
    """A writer appends 50,000 records across rolls while a query copies them to Parquet; the query
    is stopped mid-way and restarted from its checkpoint; the Parquet holds each record exactly
    once, and maxRecordsPerTrigger bounds every micro-batch."""
    import threading
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    total, limit = 50_000, 8_000
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, "spark") as ns:
        ns.create_stream("live")

        def produce() -> None:
            with ns.open_writer("live", segment_max_records=6_000) as w:
                for i in range(0, total, 500):
                    w.write_batch([b"%d" % k for k in range(i, i + 500)])
                    time.sleep(0.01)
        writer = threading.Thread(target=produce)
        writer.start()

        def start() -> Any:
            return (spark.readStream.format("bookkeeper").option("metadata_uri", cluster.metadata_uri)
                    .option("stream", "live").option("namespace", "spark").option("startingOffsets", "earliest")
                    .option("maxRecordsPerTrigger", str(limit)).load()
                    .writeStream.format("parquet").option("checkpointLocation", ck)
                    .trigger(processingTime="200 milliseconds").start(out))
        q = start()
        _wait_rows(q, 10_000)
        q.stop()
        batches = list(q.recentProgress)
        q = start()
        writer.join(120)
        _wait_rows(q, total, seen=_parquet_count(spark, out))
        batches += list(q.recentProgress)
        q.stop()
    df = spark.read.parquet(out)
    assert df.count() == total
    assert df.select("txid").distinct().count() == total
    assert sorted(int(r["data"]) for r in df.select("data").collect()) == list(range(total))
    sizes = [b["numInputRows"] for b in batches]
    assert max(sizes) <= limit and sum(1 for s in sizes if s) >= 2, sizes


def _parquet_count(spark: Any, path: str) -> int:
    try:
        return spark.read.parquet(path).count()
    except Exception:  # noqa: BLE001 - no file written yet
        return 0


def _wait_rows(q: Any, rows: int, seen: int = 0, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    done = seen
    counted: set[str] = set()
    while done < rows:
        assert q.exception() is None, q.exception()
        assert time.monotonic() < deadline, f"{done} of {rows} rows after {timeout_s}s"
        for p in q.recentProgress:
            if p["id"] + str(p["batchId"]) not in counted:
                counted.add(p["id"] + str(p["batchId"]))
                done += p["numInputRows"]
        time.sleep(0.2)


def test_position_offsets_are_readable_json(spark, cluster) -> None:
    """The streaming source's offsets are {"position": "SEQ:ENTRY:SLOT"} and, when known, the txid
    of the record before that position: what a person reads in the offset log."""
    from bookkeeper.spark.options import SourceOptions
    from bookkeeper.spark.source import StreamReader
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, "spark") as ns:
        ns.create_stream("offsets")
        with ns.open_writer("offsets") as w:
            ps = w.write_batch([b"a", b"b", b"c"])
    r = StreamReader(SourceOptions.parse({"metadata_uri": cluster.metadata_uri, "stream": "offsets",
                                          "namespace": "spark", "maxRecordsPerTrigger": "2"}))
    start = r.initialOffset()
    assert start == {"position": str(Position(ps[0].segment, 0, 0))}
    end = r.latestOffset(start, r.getDefaultReadLimit())
    assert end == {"position": str(ps[2]), "after_txid": 1}
    assert r.latestOffset(end, r.getDefaultReadLimit())["position"] == str(Position(ps[0].segment + 1, 0, 0))


# -- failOnDataLoss: retention and truncation under a query ----------------------------------------
NS = "spark"


def _three_segments(cluster: LocalCluster, name: str) -> list[Position]:
    """30 records, txids 0..29, in three closed segments of one record set each (1:0:*, 2:0:*, 3:0:*)."""
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, NS) as ns:
        ns.create_stream(name)
        with ns.open_writer(name, segment_max_records=10) as w:
            ps = [p for i in range(0, 30, 10) for p in w.write_batch([b"%d" % k for k in range(i, i + 10)])]
    assert [str(p) for p in ps[::10]] == ["1:0:0", "2:0:0", "3:0:0"]
    return ps


def _truncate(cluster: LocalCluster, name: str, before: Position) -> list[int]:
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, NS) as ns:
        return ns.truncate(name, before=before)


def _options(name: str, cluster: LocalCluster, fail: str | None, **more: str) -> dict[str, str]:
    """A stream source's options; fail None leaves failOnDataLoss at its default."""
    return {"metadata_uri": cluster.metadata_uri, "stream": name, "namespace": NS, **more,
            **({"failOnDataLoss": fail} if fail else {})}


def _query(spark: Any, options: dict[str, str], checkpoint: Path, sink: Any) -> Any:
    return (spark.readStream.format("bookkeeper").options(**options).load()
            .writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).start())


def _skipped(q: Any) -> dict[str, int]:
    """The data-loss counts of the last progress that reported them (in the source's latestOffset)."""
    import json
    reports = [json.loads(p["sources"][0]["latestOffset"]) for p in q.recentProgress if p["sources"][0]["latestOffset"]]
    return reports[-1]["dataLoss"]


@pytest.mark.parametrize("fail", [None, "false"])
def test_retention_between_two_triggers_fails_the_query_or_is_skipped_and_counted(spark, cluster, tmp_path: Path,
                                                                               fail: str | None) -> None:
    """A query reads 5 records a trigger from three segments of 10; between its first and second
    trigger (inside the first batch's sink) truncation deletes segments 1 and 2, so the checkpointed
    offset 1:0:5 lies in deleted data. By default the query fails naming the stream and the range
    (txids 5..19: the txid before the offset is in the offset); with failOnDataLoss=false it goes on
    from the first surviving record (txid 20) and the progress counts one range of two segments."""
    from pyspark.errors import StreamingQueryException
    name = f"between-{fail or 'default'}"
    ps = _three_segments(cluster, name)
    txids: list[int] = []
    deleted: list[int] = []

    def sink(df: Any, batch_id: int) -> None:
        txids.extend(r["txid"] for r in df.collect())
        if batch_id == 0:
            deleted.extend(_truncate(cluster, name, ps[20]))
    q = _query(spark, _options(name, cluster, fail, maxRecordsPerTrigger="5"), tmp_path, sink)
    try:
        if fail is None:
            with pytest.raises(StreamingQueryException, match=re.escape(
                    f"DataLossError: stream '{name}' (namespace 'spark'): positions 1:0:5 up to 3:0:0 "
                    f"(segments 1..2; txids 5..19) were deleted by retention or truncation")):
                q.processAllAvailable()
            assert txids == list(range(5))
        else:
            q.processAllAvailable()
            assert sorted(txids) == list(range(5)) + list(range(20, 30))
            assert _skipped(q) == {"skippedRanges": 1, "skippedSegments": 2}
    finally:
        q.stop()
    assert deleted == [1, 2]


@pytest.mark.parametrize("fail", [None, "false"])
def test_a_start_position_in_a_truncated_segment_fails_or_is_skipped(spark, cluster, tmp_path: Path,
                                                                     fail: str | None) -> None:
    """startingOffsets 1:0:3 after segments 1 and 2 were truncated, in a streaming query and a batch
    read: by default both fail naming the stream and the range; with failOnDataLoss=false both read
    segment 3 whole and the query counts the skip. A value other than true/false fails at load."""
    from pyspark.errors import StreamingQueryException
    name = f"start-{fail or 'default'}"
    ps = _three_segments(cluster, name)
    assert _truncate(cluster, name, ps[20]) == [1, 2]
    options = _options(name, cluster, fail, startingOffsets=str(ps[3]))
    txids: list[int] = []
    q = _query(spark, {**options, "maxRecordsPerTrigger": "5"}, tmp_path,
               lambda df, _batch: txids.extend(r["txid"] for r in df.collect()))
    batch = spark.read.format("bookkeeper").options(**options).load()
    lost = re.escape(f"DataLossError: stream '{name}' (namespace 'spark'): positions 1:0:3 up to 3:0:0 (segments 1..2) "
                     f"were deleted by retention or truncation")
    try:
        if fail is None:
            with pytest.raises(StreamingQueryException, match=lost):
                q.processAllAvailable()
            with pytest.raises(Exception, match=lost):
                batch.collect()
            assert txids == []
        else:
            q.processAllAvailable()
            assert sorted(txids) == list(range(20, 30))
            assert _skipped(q) == {"skippedRanges": 1, "skippedSegments": 2}
            assert sorted(r["txid"] for r in batch.collect()) == list(range(20, 30))
    finally:
        q.stop()
    with pytest.raises(Exception, match="option failOnDataLoss must be true or false, not 'yes'"):
        spark.read.format("bookkeeper").options(**{**options, "failOnDataLoss": "yes"}).load()


@pytest.mark.parametrize("unread", [0, 3])
def test_a_deleted_segment_read_to_its_end_is_no_loss(cluster, unread: int) -> None:
    """The driver-side reader (what Spark's planner process calls) on a query that has read an open
    segment to its LAC; its writer is replaced (segment 1 closed, segment 2 begun) and truncation
    deletes segment 1. While segment 2 is empty the source waits (latestOffset returns the start);
    once it holds records, a first txid that follows the last one read means nothing was lost and
    the query goes on under the default failOnDataLoss=true, while `unread` records written after
    the query's end are a loss named with their txids."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from bookkeeper.spark import DataLossError
    from bookkeeper.spark.options import SourceOptions
    from bookkeeper.spark.source import StreamReader
    name = f"ended-{unread}"
    all_available = ReadAllAvailable()
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, NS) as ns:
        ns.create_stream(name)
        r = StreamReader(SourceOptions.parse(_options(name, cluster, None)))
        with ns.open_writer(name) as w:
            w.write_batch([b"read"] * 10)
            start = r.initialOffset()
            end = r.latestOffset(start, all_available)
            # the end of segment 1 so far: 1:1:0, or 1:2:0 after an idle writer's LAC control entry
            assert Position.parse(end["position"])[:2] >= (1, 1) and end["after_txid"] == 9
            assert len(r.partitions(start, end)) == 1
            if unread:
                w.write_batch([b"unread"] * unread)
        with ns.open_writer(name) as w:
            assert ns.truncate(name, before=Position(2, 0, 0)) == [1]
            assert r.latestOffset(end, all_available) == end
            w.write_batch([b"later"] * 5)
            # Segment 2's one record set is acknowledged, but a reader sees it once a bookie's
            # LAC covers it (the writer's explicit LAC, a moment later): until then the source
            # still waits at `end` (seen in a clean-clone run).
            nxt = wait_until("segment 2's records visible to the reader",
                             lambda: (o := r.latestOffset(end, all_available)) != end and o)
            assert Position.parse(nxt["position"])[:2] >= (2, 1) and nxt["after_txid"] == 9 + unread + 5
            if unread:
                with pytest.raises(DataLossError, match=re.escape(
                        f"stream '{name}' (namespace 'spark'): positions {end['position']} up to 2:0:0 "
                        f"(segment 1; txids 10..12)")):
                    r.partitions(end, nxt)
            else:
                assert len(r.partitions(end, nxt)) == 1
                assert r.reportLatestOffset() == {"position": nxt["position"],
                                                  "dataLoss": {"skippedRanges": 0, "skippedSegments": 0}}


def test_skips_are_logged_once_and_a_segment_deleted_after_planning_is_lost_too(cluster, caplog) -> None:
    """failOnDataLoss=false logs one WARNING naming the stream and the range per skipped range
    (Spark may plan a batch again) and counts it once. A segment deleted between planning and an
    executor's read (truncation up to the stream's end) is lost data as well: the read fails by
    default, and with false yields nothing and logs the range with the segment's ledger."""
    import logging

    from pyspark.sql.streaming.datasource import ReadMaxRows

    from bookkeeper.spark import DataLossError
    from bookkeeper.spark.options import SourceOptions
    from bookkeeper.spark.source import StreamReader
    from bookkeeper.spark.streams import read_stream_range
    name = "logged"
    ps = _three_segments(cluster, name)
    assert _truncate(cluster, name, ps[20]) == [1, 2]
    failing, skipping = (SourceOptions.parse(_options(name, cluster, fail)) for fail in (None, "false"))
    r = StreamReader(skipping)
    start = {"position": str(ps[5])}
    end = r.latestOffset(start, ReadMaxRows(2))
    assert end == {"position": "3:0:2", "after_txid": 21}
    caplog.set_level(logging.WARNING, logger="bookkeeper.spark.streams")
    gap = f"stream '{name}' (namespace 'spark'): positions 1:0:5 up to 3:0:0 (segments 1..2) were deleted"
    with pytest.raises(DataLossError, match=re.escape(gap)):
        StreamReader(failing).partitions(start, end)
    for _ in range(2):
        parts = r.partitions(start, end)
    assert [(p.value.seq, p.value.first, p.value.last) for p in parts] == [(3, 0, 0)]
    assert r.reportLatestOffset()["dataLoss"] == {"skippedRanges": 1, "skippedSegments": 2}
    assert _truncate(cluster, name, Position(4, 0, 0)) == [3]
    planned = (f"stream '{name}' (namespace 'spark'): positions 3:0:0 up to 3:0:2 "
               f"(segment 3, ledger {parts[0].value.ledger_id}) were deleted")
    with pytest.raises(DataLossError, match=re.escape(planned)):
        list(read_stream_range(failing, parts[0].value))
    assert list(read_stream_range(skipping, parts[0].value)) == []
    skipped = " by retention or truncation before this query read them: skipped (failOnDataLoss=false)"
    assert [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.name == "bookkeeper.spark.streams"] == [
        (logging.WARNING, gap + skipped), (logging.WARNING, planned + skipped)]


def test_available_now_reads_what_was_there_in_bounded_batches(spark, cluster, tmp_path: Path) -> None:
    """Trigger.AvailableNow (the source is SupportsTriggerAvailableNow): a run reads what the
    stream held when it began, in batches of at most maxRecordsPerTrigger, and stops; records
    written during the run (here by the first batch's sink) wait for the next run, which reads
    them from the checkpoint."""
    name = "available-now"
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, NS) as ns:
        ns.create_stream(name)
        with ns.open_writer(name, segment_max_records=12) as w:
            w.write_batch([b"%d" % k for k in range(25)])
    runs: list[list[list[int]]] = []

    def sink(df: Any, batch_id: int) -> None:
        runs[-1].append(sorted(r["txid"] for r in df.collect()))
        if len(runs) == 1 and batch_id == 0:
            with bookkeeper.sync.Namespace.connect(cluster.metadata_uri, NS) as ns, ns.open_writer(name) as w:
                w.write_batch([b"later"] * 7)
    for _ in range(2):
        runs.append([])
        q = (spark.readStream.format("bookkeeper").options(**_options(name, cluster, None, maxRecordsPerTrigger="10"))
             .load().writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path))
             .trigger(availableNow=True).start())
        try:
            assert q.awaitTermination(120), "an availableNow run that did not end"
        finally:
            q.stop()
    assert runs == [[list(range(0, 10)), list(range(10, 20)), list(range(20, 25))], [list(range(25, 32))]]


# -- docs/spark.md's whole programs: examples/spark_*.py, shown verbatim and run -------------------
ROOT = Path(__file__).resolve().parents[1]
SPARK_DOC = ROOT / "docs" / "spark.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _python_blocks() -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(SPARK_DOC.read_text()) if m.group(1) == "python"]


def test_docs_spark_shows_each_example_verbatim_and_only_those_programs() -> None:
    """Each examples/spark_*.py is a block of docs/spark.md, character for character; every block
    that builds its own SparkSession is one of them (a whole program no test runs would drift);
    the other blocks are fragments that compile."""
    files = {p.read_text(): p.name for p in sorted((ROOT / "examples").glob("spark_*.py"))}
    blocks = _python_blocks()
    assert sorted(files.values()) == ["spark_batch.py", "spark_streaming.py"]
    assert [name for text, name in files.items() if text not in blocks] == []
    assert [b for b in blocks if "SparkSession.builder" in b and b not in files] == []
    for block in blocks:
        compile(block, str(SPARK_DOC), "exec")


def _run_example(name: str, cluster: LocalCluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python examples/NAME ARGS` as a user runs it, with BK_METADATA_URI naming this module's
    cluster; Spark as the session fixture's: local[2] on loopback, no UI, the C1-only JVM
    (SPARK_SUBMIT_OPTS from tests/conftest.py). Its own process group, killed whole (the
    driver and its JVM) if it overstays."""
    env = {**os.environ, "BK_METADATA_URI": cluster.metadata_uri, "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_SUBMIT_ARGS": "--master local[2] --conf spark.ui.enabled=false "
                                  "--conf spark.sql.shuffle.partitions=2 pyspark-shell"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / name), *args], cwd=cwd, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_batch_example_counts_the_ledgers_its_password_opens(cluster, tmp_path: Path) -> None:
    """examples/spark_batch.py over a range of three ledgers, one of another password: the Parquet
    and the printed table hold the other two (entries, bytes), and the planner's WARNING naming the
    skipped ledger and the count reaches the program's stderr (through Spark's Python worker)."""
    import pyarrow.parquet as pq
    with bookkeeper.sync.BookKeeper.connect(cluster.metadata_uri) as bk:
        a, b, c = _ledger(bk, 40, b"secret"), _ledger(bk, 5, b"not the example's"), _ledger(bk, 70, b"secret")
    proc = _run_example("spark_batch.py", cluster, tmp_path, "--ledgers", f"{a[0]}-{c[0]}", "--out", "per-ledger")
    table = pq.read_table(tmp_path / "per-ledger").to_pylist()
    assert sorted((r["ledger_id"], r["entries"], r["bytes"]) for r in table) == [a, c]
    assert re.search(rf"^\|\s*{a[0]}\|\s*40\|\s*{a[2]}\|$", proc.stdout, re.M), proc.stdout
    assert (f"skipped 1 of 3 ledgers that cannot be opened with this read's password and digest "
            f"(skipUnreadable=true): {b[0]} (wrong password)\n") in proc.stderr


def test_streaming_example_copies_the_stream_to_parquet_and_stops(cluster, tmp_path: Path) -> None:
    """examples/spark_streaming.py on the stream `events` (its default) of three segments: the
    availableNow query copies every record once, with position and txid, and ends by itself;
    the program prints the count and the last record."""
    import pyarrow.parquet as pq
    with bookkeeper.sync.Namespace.connect(cluster.metadata_uri) as ns:
        ns.create_stream("events")
        with ns.open_writer("events", segment_max_records=1000) as w:
            ps = w.write_batch([b"event %d" % i for i in range(2500)])
    proc = _run_example("spark_streaming.py", cluster, tmp_path, "--dir", "copy")
    rows = sorted(pq.read_table(tmp_path / "copy" / "parquet").to_pylist(), key=lambda r: r["txid"])
    assert [(r["position"], r["txid"], r["text"]) for r in rows] == [
        (str(p), i, f"event {i}") for i, p in enumerate(ps)]
    assert proc.stdout.startswith("2500 records in copy/parquet, the last ones:\n"), proc.stdout
    assert re.search(rf"^\|{ps[-1]}\s*\|2499\s*\|event 2499\s*\|$", proc.stdout, re.M), proc.stdout
