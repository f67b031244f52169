"""Spark's "bookkeeper" data source (docs/api.md section 7, docs/spark.md).

Importing this module imports pyspark (the `[spark]` extra); importing `bookkeeper` never does.
"""
from __future__ import annotations

from typing import Any

from bookkeeper.spark.source import BookKeeperDataSource
from bookkeeper.errors import DataLossError


def register(spark: Any) -> None:
    """Register the "bookkeeper" format on a SparkSession."""
    spark.dataSource.register(BookKeeperDataSource)


__all__ = ["BookKeeperDataSource", "DataLossError", "register"]
