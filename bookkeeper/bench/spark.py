"""`bk bench spark`: the same closed ledgers read by Spark (local[2]) and by the plain client.

Why both in one run: the figure that matters is the ratio (what the data source costs over
the client it is built on), on the same bookies and the same page cache state. Each size is
written once; the client reads it first (all ledgers at once, pipelined range reads), then
Spark reads it twice (a job that sums the payload lengths, so every byte reaches a Python
worker and the JVM): the first job of a size is reported as `cold_mb_per_s` (Python workers
and JIT warming up), the second is the figure. Spark's start-up is not timed.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time

import uvloop

from bookkeeper.bench import BenchResult, histogram, latency_ms
from bookkeeper.bench.cluster import PRODUCTION_JOURNAL
from bookkeeper.client import BookKeeper
from bookkeeper.testing.cluster import LocalCluster

# (entry bytes, ledgers, entries per ledger): 20 MB of 100 B rows, 200 MB each of 4 and 64 KiB
PLAN = ((100, 4, 50_000), (4096, 4, 12_500), (65536, 4, 800))


async def _write(uri: str, plan: tuple[tuple[int, int, int], ...]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async with await BookKeeper.connect(uri, max_outstanding_adds=1 << 20) as bk:
        for size, ledgers, entries in plan:
            data = os.urandom(size)
            for _ in range(ledgers):
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                for i in range(0, entries, 2000):
                    await asyncio.gather(*(lh.add_entry_async(data) for _ in range(min(2000, entries - i))))
                await lh.close()
                out.setdefault(size, []).append(lh.ledger_id)
    return out


async def _client_read(uri: str, ledger_ids: list[int], chunk: int) -> tuple[int, int]:
    async with await BookKeeper.connect(uri) as bk:
        async def one(lid: int) -> tuple[int, int]:
            rh = await bk.open_ledger(lid, recovery=False)
            rows = size = 0
            for a in range(0, rh.last_add_confirmed + 1, chunk):
                entries = await rh.read(a, min(rh.last_add_confirmed, a + chunk - 1))
                rows += len(entries)
                size += sum(len(e.data) for e in entries)
            return rows, size
        results = await asyncio.gather(*(one(lid) for lid in ledger_ids))
    return sum(r for r, _ in results), sum(s for _, s in results)


def spark_bench(directory: str, *, sync: str = "io_uring", scale: float = 1.0) -> list[BenchResult]:
    """Rows/s and MB/s for 100 B, 4 KiB and 64 KiB entries: client, then Spark, per size.
    `scale` multiplies the entry counts (tests run it small)."""
    plan = tuple((size, ledgers, max(1, int(entries * scale))) for size, ledgers, entries in PLAN)
    from pyspark.sql import functions as F

    from bookkeeper.spark.options import chunk_entries
    from bookkeeper.spark.session import local_session, stop_session

    cluster = LocalCluster(tempfile.mkdtemp(prefix="spark-", dir=directory), bookies=3, shards=1,
                           journal_sync=sync, bookie_conf=PRODUCTION_JOURNAL)
    cluster.start()
    out: list[BenchResult] = []
    try:
        uri = cluster.metadata_uri
        ids = uvloop.run(_write(uri, plan))
        spark = local_session(app="bk-bench-spark")
        try:
            for size, _, entries in plan:
                lids = ids[size]
                t0 = time.perf_counter()
                rows, nbytes = uvloop.run(_client_read(uri, lids, chunk_entries(size * entries, entries)))
                client_s = time.perf_counter() - t0
                df = (spark.read.format("bookkeeper").option("metadata_uri", uri)
                      .option("ledgers", ",".join(map(str, lids))).load())
                times = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    got = df.agg(F.count("*").alias("n"), F.sum(F.length("data")).alias("b")).collect()[0]
                    times.append(time.perf_counter() - t0)
                cold_s, spark_s = times
                if (got["n"], got["b"]) != (rows, nbytes):
                    raise RuntimeError(f"spark read {got['n']} rows / {got['b']} bytes, client {rows} / {nbytes}")
                none = latency_ms(histogram())
                client = BenchResult(f"client read {size} B entries", rows / client_s, nbytes / client_s / 1e6, none,
                                     {"entry_bytes": size, "ledgers": len(lids), "rows": rows})
                out.append(BenchResult(f"spark read {size} B entries (local[2])", rows / spark_s,
                                       nbytes / spark_s / 1e6, none,
                                       {"entry_bytes": size, "ledgers": len(lids), "rows": rows,
                                        "partitions": df.rdd.getNumPartitions(),
                                        "cold_mb_per_s": round(nbytes / cold_s / 1e6, 1),
                                        "ratio_to_client": round(client_s / spark_s, 2)}))
                out.append(client)
        finally:
            stop_session(spark)
    finally:
        cluster.stop()
    return out
