# examples/spark_streaming.py: a Structured Streaming query copies a stream's records to Parquet
import argparse
import os
import sys

from pyspark.sql import SparkSession, functions as F

import bookkeeper.spark

METADATA_URI = os.environ.get("BK_METADATA_URI", "zk://127.0.0.1:2181/ledgers")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark's Python workers: this Python, with bookkeeper


def main() -> None:
    parser = argparse.ArgumentParser(description="copy a stream's new records to Parquet, then stop")
    parser.add_argument("--stream", default="events", help="the stream, namespace default (examples/streams.py's)")
    parser.add_argument("--dir", default="/tmp/bk-events", help="holds parquet/ and checkpoint/")
    args = parser.parse_args()

    spark = SparkSession.builder.appName("bookkeeper-streaming").getOrCreate()
    bookkeeper.spark.register(spark)
    records = (spark.readStream.format("bookkeeper")
               .option("metadata_uri", METADATA_URI)
               .option("stream", args.stream)
               .option("startingOffsets", "earliest")    # where a new checkpoint starts
               .option("maxRecordsPerTrigger", "10000")  # records per micro-batch, at most
               .load()                                   # position string, txid long, data binary
               .withColumn("text", F.col("data").cast("string")))
    query = (records.writeStream.format("parquet")
             .option("path", f"{args.dir}/parquet")
             .option("checkpointLocation", f"{args.dir}/checkpoint")
             .trigger(availableNow=True)                 # what the stream holds now, then stop
             .start())
    query.awaitTermination()
    copy = spark.read.parquet(f"{args.dir}/parquet")
    print(f"{copy.count()} records in {args.dir}/parquet, the last ones:")
    copy.orderBy(F.desc("txid")).select("position", "txid", "text").show(5, truncate=False)
    spark.stop()


if __name__ == "__main__":
    main()
