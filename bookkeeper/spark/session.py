"""A local SparkSession for tests and `bk bench spark`, and stopping it for good.

Why here: both start Spark the same way (this interpreter on the workers, loopback only,
no UI, the format registered) and must stop its JVM by pid, not only ask it to stop.
"""
from __future__ import annotations

import os
import subprocess
import sys

from pyspark import SparkContext
from pyspark.sql import SparkSession

from bookkeeper.spark.source import BookKeeperDataSource


def local_session(master: str = "local[2]", app: str = "bookkeeper") -> SparkSession:
    """local[N] on 127.0.0.1, workers on this interpreter (which has bookkeeper installed)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(BookKeeperDataSource)
    return session


def stop_session(session: SparkSession) -> None:
    """Stop the session, then its JVM (the gateway process pyspark started) by pid."""
    gateway = SparkContext._gateway
    jvm = getattr(gateway, "proc", None)
    session.stop()
    if gateway is not None:
        gateway.shutdown()
        SparkContext._gateway = None
        SparkContext._jvm = None
    if jvm is not None and jvm.poll() is None:
        jvm.terminate()
        try:
            jvm.wait(30)
        except subprocess.TimeoutExpired:
            jvm.kill()
            jvm.wait()
