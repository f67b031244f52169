"""The "bookkeeper" format: PySpark 4's Python Data Source API over ledgers and streams.

Driver side: planning (`partitions`, and for streaming `initialOffset`/`latestOffset`) runs
each call on a fresh event loop with its own client (`uvloop.run`), so nothing long-lived
sits in a reader that Spark pickles. Executor side: `read` gets a pickled copy of the reader
and one partition, connects, reads, closes (ledgers.py, streams.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import uvloop
from pyspark.sql.datasource import (DataSource, DataSourceReader, DataSourceStreamReader, EqualTo, Filter,
                                    GreaterThan, GreaterThanOrEqual, InputPartition, LessThan, LessThanOrEqual)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from bookkeeper.errors import ConfigError
from bookkeeper.spark import ledgers, streams
from bookkeeper.spark.options import SourceOptions
from bookkeeper.spark.planning import Bounds
from bookkeeper.stream import Position


class _Partition(InputPartition):
    """A LedgerRange or a StreamRange (frozen dataclasses: picklable)."""


class BookKeeperDataSource(DataSource):
    """`spark.read.format("bookkeeper")` / `spark.readStream.format("bookkeeper")`."""

    @classmethod
    def name(cls) -> str:
        return "bookkeeper"

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.opts = SourceOptions.parse(options)

    def schema(self) -> str:
        return streams.STREAM_SCHEMA if self.opts.stream else ledgers.LEDGER_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return FilteringBatchReader(self.opts) if self.opts.pushdown_filters else BatchReader(self.opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if not self.opts.stream:
            raise ConfigError("a streaming read needs the stream option (ledgers are read in batch)")
        return StreamReader(self.opts)


_OPS = {EqualTo: "=", GreaterThan: ">", GreaterThanOrEqual: ">=", LessThan: "<", LessThanOrEqual: "<="}


class BatchReader(DataSourceReader):
    """Ledgers (one partition per ledger or per entry range) or a stream's [start, end)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.bounds = Bounds()

    def partitions(self) -> Sequence[InputPartition]:
        if self.opts.ledgers is not None:
            return [_Partition(r) for r in uvloop.run(ledgers.plan_ledgers(self.opts, self.bounds))]
        loss, ranges = uvloop.run(streams.plan_stream(self.opts, self.opts.starting, self.opts.ending))
        if loss is not None:
            streams.report_loss(self.opts, loss.describe(self.opts))
        return [_Partition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(self.opts, partition)


class FilteringBatchReader(BatchReader):
    """BatchReader with filter pushdown: chosen by the option pushdown_filters=true, because
    Spark fails any reader that implements pushFilters unless spark.sql.python.filterPushdown.enabled
    is set, and a data source cannot see that setting when it makes its reader."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        """Accept comparisons of ledger_id / entry_id with an integer (Spark 4.1+, when
        spark.sql.python.filterPushdown.enabled): they become exact bounds on which ledgers and
        entries are planned, so every row read satisfies them and read() need not filter.
        Everything else is left to Spark (Spark applies what is returned; a stream read returns all)."""
        rest = []
        for f in filters:
            op = _OPS.get(type(f))
            attribute: tuple[str, ...] = getattr(f, "attribute", ())
            column = attribute[0] if len(attribute) == 1 else None
            value = getattr(f, "value", None)
            if (self.opts.ledgers is not None and op and column in ("ledger_id", "entry_id")
                    and type(value) is int):
                self.bounds = self.bounds.narrow(column, op, value)
            else:
                rest.append(f)
        return rest


def _read(opts: SourceOptions, partition: InputPartition | None) -> Iterator[pa.RecordBatch]:
    """One partition's batches. Spark calls read once with no partition when partitions() was
    empty (nothing to read): that yields nothing."""
    value = getattr(partition, "value", None)
    if value is None:
        return iter(())
    if isinstance(value, streams.StreamRange):
        return streams.read_stream_range(opts, value)
    return ledgers.read_ledger_range(opts, value)


def _offset(pos: Position, after_txid: int | None) -> dict[str, Any]:
    """Offsets are JSON in Spark's offset log: a position string, readable by people, and the
    txid of the record before it when known (streams.py says why)."""
    return {"position": str(pos)} if after_txid is None else {"position": str(pos), "after_txid": after_txid}


def _position(offset: dict[str, Any]) -> Position:
    return Position.parse(offset["position"])


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of [start, end) positions; `maxRecordsPerTrigger` bounds each one.
    Under Trigger.AvailableNow the stream's end when the run began bounds every batch, so the
    run ends after what was there then, in batches of at most maxRecordsPerTrigger.

    Lives on the driver (a Python process per query run): it counts what failOnDataLoss=false
    skipped, and reportLatestOffset shows the counts in the query's progress, the one place
    PySpark lets a Python source put figures (it has no custom source metrics).

    `commit` does nothing: a query's progress lives in its checkpoint, and retention stays
    the stream's own setting (docs/spark.md says why).
    """

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.latest: Position | None = None
        self.skipped: set[Position] = set()    # start positions of the ranges skipped
        self.skipped_segments = 0
        self.target: Position | None = None    # Trigger.AvailableNow: where this run stops

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: the end of what is acknowledged now is this run's target;
        records written later wait for the next run (Spark ends the run once latestOffset
        returns its start)."""
        self.target, _ = uvloop.run(streams.resolve(self.opts, "latest"))

    def initialOffset(self) -> dict[str, Any]:
        return _offset(*uvloop.run(streams.resolve(self.opts, self.opts.starting)))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any] | None = None, limit: ReadLimit | None = None) -> dict[str, Any]:
        """The end of what is acknowledged now (new segments included), or `limit` records past start."""
        if start is None:
            self.latest, txid = uvloop.run(streams.resolve(self.opts, "latest"))
            return _offset(self.latest, txid)
        if limit is None and self.opts.max_records_per_trigger:  # a Spark that passes no limit
            limit = ReadMaxRows(self.opts.max_records_per_trigger)
        rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        nxt = uvloop.run(streams.next_end(self.opts, _position(start), start.get("after_txid"), rows, self.target))
        self.latest = nxt.latest
        return start if nxt.end == _position(start) else _offset(nxt.end, nxt.after_txid)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """The stream's end as last seen, and what failOnDataLoss=false skipped in this run:
        Spark shows it as `latestOffset` in the query's progress (sources[i])."""
        if self.latest is None:
            return None
        return {"position": str(self.latest),
                "dataLoss": {"skippedRanges": len(self.skipped), "skippedSegments": self.skipped_segments}}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        a, b = _position(start), _position(end)
        loss, ranges = uvloop.run(streams.plan_stream(self.opts, a, b, start.get("after_txid")))
        if loss is not None and a not in self.skipped:
            streams.report_loss(self.opts, loss.describe(self.opts))
            self.skipped.add(a)
            self.skipped_segments += len(loss.gap.segments)
        return [_Partition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(self.opts, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: progress is the query's checkpoint, not the stream's state."""
