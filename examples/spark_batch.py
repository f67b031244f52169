# examples/spark_batch.py: entries and bytes per ledger over a range of ledger ids, as Parquet
import argparse
import os
import sys

from pyspark.sql import SparkSession, functions as F

import bookkeeper.spark

METADATA_URI = os.environ.get("BK_METADATA_URI", "zk://127.0.0.1:2181/ledgers")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark's Python workers: this Python, with bookkeeper


def main() -> None:
    parser = argparse.ArgumentParser(description="entries and bytes per ledger, as Parquet")
    parser.add_argument("--ledgers", default="0-999999999", help="ids and inclusive ranges, e.g. 1,2,10-20")
    parser.add_argument("--password", default="secret", help="the ledgers' password (examples/client.py's)")
    parser.add_argument("--out", default="/tmp/bk-ledgers", help="the Parquet directory (replaced)")
    args = parser.parse_args()

    spark = SparkSession.builder.appName("bookkeeper-batch").getOrCreate()
    bookkeeper.spark.register(spark)
    entries = (spark.read.format("bookkeeper")
               .option("metadata_uri", METADATA_URI)
               .option("ledgers", args.ledgers)
               .option("password", args.password)
               .option("skipUnreadable", "true")  # a range also catches other applications' ledgers
               .load())                           # ledger_id long, entry_id long, data binary
    per_ledger = entries.groupBy("ledger_id").agg(F.count("*").alias("entries"),
                                                  F.sum(F.length("data")).alias("bytes"))
    per_ledger.write.mode("overwrite").parquet(args.out)
    spark.read.parquet(args.out).orderBy("ledger_id").show()
    spark.stop()


if __name__ == "__main__":
    main()
