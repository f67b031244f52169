"""`bk bench spark`: the same closed ledgers read by Spark (local[2]) and by the plain client.

Why both in one run: the figure that matters is the ratio (what the data source costs over
the client it is built on), on the same bookies and the same page cache state. Each size is
written once; the client reads it three times (all ledgers at once, pipelined range reads),
then Spark three times (a job that sums the payload lengths, so every byte reaches a Python
worker and the JVM). Both sides are treated alike: the first read is reported as
`cold_mb_per_s`, the figure is the total of the other two. Why warm and why ~1 GB per size:
a Spark job has a fixed cost (planning in a Python worker, task start-up, and the JVM
compiling the query's generated code: 0.3-0.9 CPU-seconds of C2 per job measured here) that
a bulk read amortizes and a 200 MB one does not. Spark's start-up is not timed.
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

# (entry bytes, ledgers, entries per ledger): 20 MB of 100 B rows, 1 GB each of 4 and 64 KiB
PLAN = ((100, 4, 50_000), (4096, 4, 62_500), (65536, 4, 4_000))
READS = 3  # per side and size: one cold, then the figure's two


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
                client_times = []
                for _ in range(READS):
                    t0 = time.perf_counter()
                    rows, nbytes = uvloop.run(_client_read(uri, lids, chunk_entries(size * entries, entries)))
                    client_times.append(time.perf_counter() - t0)
                df = (spark.read.format("bookkeeper").option("metadata_uri", uri)
                      .option("ledgers", ",".join(map(str, lids))).load())
                spark_times = []
                for _ in range(READS):
                    t0 = time.perf_counter()
                    got = df.agg(F.count("*").alias("n"), F.sum(F.length("data")).alias("b")).collect()[0]
                    spark_times.append(time.perf_counter() - t0)
                    if (got["n"], got["b"]) != (rows, nbytes):
                        raise RuntimeError(f"spark read {got['n']} rows / {got['b']} bytes, client {rows} / {nbytes}")
                client_s, spark_s = sum(client_times[1:]), sum(spark_times[1:])
                warm = READS - 1
                none = latency_ms(histogram())
                common = {"entry_bytes": size, "ledgers": len(lids), "rows": rows}
                out.append(BenchResult(f"spark read {size} B entries (local[2])", warm * rows / spark_s,
                                       warm * nbytes / spark_s / 1e6, none,
                                       {**common, "partitions": df.rdd.getNumPartitions(),
                                        "cold_mb_per_s": round(nbytes / spark_times[0] / 1e6, 1),
                                        "ratio_to_client": round(client_s / spark_s, 2)}))
                out.append(BenchResult(f"client read {size} B entries", warm * rows / client_s,
                                       warm * nbytes / client_s / 1e6, none,
                                       {**common, "cold_mb_per_s": round(nbytes / client_times[0] / 1e6, 1)}))
        finally:
            stop_session(spark)
    finally:
        cluster.stop()
    return out
