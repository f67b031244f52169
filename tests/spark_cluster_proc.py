"""The programs tests/test_spark_cluster.py runs inside its test hosts, one role per call.

`python -m tests.spark_cluster_proc ROLE ...`, run with `Host.popen` / `Host.run` (each host is
a network namespace of its own, so these must be processes, not threads of the test):

- `store DIR ADDRESS`: ZooKeeper and 3 bookies (LocalCluster) binding and advertising ADDRESS;
  prints one JSON line `{"metadata_uri", "bookie_ids"}` once every bookie is registered, then
  waits until stdin closes and stops the cluster.
- `write URI`: the data the Spark programs read, written with the plain client: ledgers of
  different lengths and a stream of several segments; prints the ledger ids (JSON).
- `read URI IDS`: what the plain client reads back of those (JSON `{"rows", "records"}`).
- `driver URI STORE IDS`: the Spark driver (its master and settings: PYSPARK_SUBMIT_ARGS). It
  waits for two executors, runs the bulk read and an availableNow streaming query, and prints (JSON) the
  rows and records, each with the address of the executor that read it, and Spark's block
  managers (`host:port` of the driver and of each executor).

Why the executor's address and not its host name: the test hosts share one UTS namespace (one
host name), so the address is what tells them apart: the source address the executor's
namespace uses towards the store, which is its own address on the bridge.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

PASSWORD = "spark"
STREAM = "events"
EXECUTORS = 2
EXECUTORS_TIMEOUT_S = 120.0


def store(directory: str, address: str) -> None:
    from bookkeeper.testing.cluster import LocalCluster
    with LocalCluster(directory, bookies=3, shards=1, address=address) as cluster:
        print(json.dumps({"metadata_uri": cluster.metadata_uri,
                          "bookie_ids": [b.bookie_id for b in cluster.bookies]}), flush=True)
        sys.stdin.read()  # the test closes our stdin to stop us


def write(uri: str) -> None:
    import bookkeeper.sync
    ids = []
    with bookkeeper.sync.BookKeeper.connect(uri) as bk:
        for i in range(4):
            lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=PASSWORD.encode())
            futures = [lh.add_entry_async(b"%d:%d:" % (lh.ledger_id, k) + b"x" * (k % 50))
                       for k in range(300 + 50 * i)]
            for f in futures:
                f.result()
            lh.close()
            ids.append(lh.ledger_id)
    with bookkeeper.sync.Namespace.connect(uri) as ns:
        ns.create_stream(STREAM)
        with ns.open_writer(STREAM, segment_max_records=400) as w:
            w.write_batch([b"event %d" % i for i in range(1000)])
    print(json.dumps(ids))


def read(uri: str, ids: str) -> None:
    import bookkeeper.sync
    rows = []
    with bookkeeper.sync.BookKeeper.connect(uri) as bk:
        for lid in json.loads(ids):
            rh = bk.open_ledger(lid, password=PASSWORD.encode())
            rows += [[lid, e.entry_id, e.data.hex()] for e in rh.read(0, rh.last_add_confirmed)]
    with bookkeeper.sync.Namespace.connect(uri) as ns, ns.open_reader(STREAM, follow=False) as r:
        records = [[str(rec.position), rec.txid, rec.data.hex()] for rec in r]
    print(json.dumps({"rows": rows, "records": records}))


def own_address(towards: str) -> str:
    """This namespace's address on the route to `towards` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((towards, 9))
        return str(s.getsockname()[0])


def driver(uri: str, store_address: str, ids: str) -> None:
    from pyspark.sql import SparkSession, functions as F

    import bookkeeper.spark
    # The master, the driver's address and the executors' sizes come in PYSPARK_SUBMIT_ARGS,
    # as for the example programs the test runs on the same cluster.
    spark = SparkSession.builder.appName("bookkeeper-on-a-cluster").getOrCreate()
    try:
        spark.sparkContext.setLogLevel("WARN")
        bookkeeper.spark.register(spark)
        _wait_executors(spark)
        # Run as __main__ (python -m), so cloudpickle ships own_address by value: the executors'
        # Python workers need not import this module.
        where = F.udf(lambda: own_address(store_address), "string", useArrow=False)
        entries = (spark.read.format("bookkeeper").option("metadata_uri", uri).option("ledgers", ids)
                   .option("password", PASSWORD).option("max_entries_per_partition", "100").load())
        rows = [[r.ledger_id, r.entry_id, bytes(r.data).hex(), r.host]
                for r in entries.withColumn("host", where()).collect()]
        records: list[list[Any]] = []

        def sink(batch: Any, batch_id: int) -> None:
            records.extend([r.position, r.txid, bytes(r.data).hex(), r.host, batch_id]
                           for r in batch.withColumn("host", where()).collect())
        query = (spark.readStream.format("bookkeeper").option("metadata_uri", uri).option("stream", STREAM)
                 .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", "300").load()
                 .writeStream.foreachBatch(sink).option("checkpointLocation", "/tmp/checkpoint")
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        print(json.dumps({"rows": rows, "records": records, "partitions": entries.rdd.getNumPartitions(),
                          "block_managers": _block_managers(spark), "driver": own_address(store_address)}))
    finally:
        spark.stop()


def _block_managers(spark: Any) -> list[str]:
    """`host:port` of every block manager Spark knows: the driver's and each executor's."""
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    keys = status.keys().toList()
    return [str(keys.apply(i)) for i in range(status.size())]


def _wait_executors(spark: Any) -> None:
    """Until both executors registered (the driver counts as one block manager): tasks offered
    earlier would all go to whichever executor came first."""
    deadline = time.monotonic() + EXECUTORS_TIMEOUT_S
    while len(_block_managers(spark)) < EXECUTORS + 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"{EXECUTORS} executors not registered within {EXECUTORS_TIMEOUT_S:.0f} s: "
                             f"{_block_managers(spark)}")
        time.sleep(0.2)


ROLES: dict[str, Callable[..., None]] = {"store": store, "write": write, "read": read, "driver": driver}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ROLES:
        raise SystemExit(f"usage: python -m tests.spark_cluster_proc {{{'|'.join(ROLES)}}} ARGS...")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    ROLES[sys.argv[1]](*sys.argv[2:])
