"""Streams as a Spark table and a streaming source: offsets are stream positions.

Why positions make exactly-once simple: a micro-batch is the half-open position range
[start, end), both ends written to Spark's offset log before it runs; reading the same
range again after a restart yields the same records, because a segment's entries up to a
LAC never change. `end` is always at or below a LAC, so no unacknowledged record is read.

Admission control needs "the position N records after start" without reading N records:
each record set's header says how many records came before it in its segment, so that is
a binary search over entry headers (a few entry reads), not a scan.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

import bookkeeper.sync
from bookkeeper.client.ledger import ReadHandle
from bookkeeper.errors import BKError
from bookkeeper.meta.streams import Segment
from bookkeeper.spark.options import SourceOptions, chunk_entries
from bookkeeper.stream import Namespace, Position, recordset

STREAM_SCHEMA = "position string, txid long, data binary"
STREAM_ARROW = pa.schema([("position", pa.string()), ("txid", pa.int64()), ("data", pa.binary())])


@dataclass(frozen=True, slots=True)
class StreamRange:
    """One partition: entries first..last of segment `seq`, records kept if start <= pos < end."""

    seq: int
    ledger_id: int
    first: int
    last: int
    start: Position
    end: Position
    planned_bytes: int


class _Segments:
    """The live segments of one stream with, per segment, its last readable entry (closed:
    its last entry; open: its LAC, read without fencing) and read handles, for one planning call."""

    def __init__(self, ns: Namespace, name: str) -> None:
        self.ns = ns
        self.name = name
        self.live: list[Segment] = []
        self.next_seq = 1
        self._handles: dict[int, ReadHandle] = {}

    async def load(self) -> _Segments:
        self.next_seq = (await self.ns.stream_meta(self.name)).next_seq
        self.live = [s for s in await self.ns.segments(self.name) if s.state != "truncated"]
        return self

    async def handle(self, seg: Segment) -> ReadHandle:
        if seg.seq not in self._handles:
            self._handles[seg.seq] = await self.ns.bk.open_ledger(seg.ledger_id, password=self.ns.password,
                                                                  recovery=False)
        return self._handles[seg.seq]

    async def last_entry(self, seg: Segment) -> int:
        return seg.last_entry if seg.state == "closed" else (await self.handle(seg)).last_add_confirmed

    async def header(self, seg: Segment, entry: int) -> tuple[int, int]:
        """(records before this entry in the segment, records in it)."""
        data = (await (await self.handle(seg)).read(entry, entry))[0].data
        count, before, _, _ = recordset.decode_header(data)
        return before, count

    async def position(self, which: str | Position) -> Position:
        """earliest | latest (after the last acknowledged record) | a position, as a Position."""
        if isinstance(which, Position):
            return which
        if which == "earliest":
            return Position(self.live[0].seq if self.live else self.next_seq, 0, 0)
        if not self.live:
            return Position(self.next_seq, 0, 0)
        last = self.live[-1]
        if last.state == "closed":
            return Position(last.seq + 1, 0, 0)
        return Position(last.seq, await self.last_entry(last) + 1, 0)


async def _with_segments(opts: SourceOptions, fn):  # noqa: ANN001, ANN202 - fn(_Segments) -> awaitable
    async with await Namespace.connect(opts.metadata_uri, opts.namespace) as ns:
        return await fn(await _Segments(ns, opts.stream).load())  # type: ignore[arg-type]


async def resolve(opts: SourceOptions, which: str | Position) -> Position:
    return await _with_segments(opts, lambda segs: segs.position(which))


async def advance(opts: SourceOptions, start: Position, end: Position, records: int) -> Position:
    """The position `records` records after `start`, or `end` if fewer lie between them."""
    async def walk(segs: _Segments) -> Position:
        remaining = records
        for seg in segs.live:
            if seg.seq < start.segment or Position(seg.seq, 0, 0) >= end:
                continue
            last = await segs.last_entry(seg)
            if last < 0:
                continue
            before_last, count_last = await segs.header(seg, last)
            total = before_last + count_last
            first = start.entry if seg.seq == start.segment else 0
            if first > last:
                continue
            index = 0
            if seg.seq == start.segment:
                index = (await segs.header(seg, first))[0] + start.slot
            if index + remaining < total:
                return min(end, await _locate(segs, seg, first, last, index + remaining))
            remaining -= max(0, total - index)
        return end
    return await _with_segments(opts, walk)


async def _locate(segs: _Segments, seg: Segment, lo: int, hi: int, target: int) -> Position:
    """The position of the segment's record number `target` (0-based), in entries lo..hi."""
    while lo < hi:  # the largest entry whose records_before <= target
        mid = (lo + hi + 1) // 2
        if (await segs.header(seg, mid))[0] <= target:
            lo = mid
        else:
            hi = mid - 1
    before, _ = await segs.header(seg, lo)
    return Position(seg.seq, lo, target - before)


async def plan_stream(opts: SourceOptions, start: Position, end: Position) -> list[StreamRange]:
    """Partitions covering [start, end): per segment, entry ranges of at most max_entries_per_partition."""
    async def plan(segs: _Segments) -> list[StreamRange]:
        out: list[StreamRange] = []
        for seg in segs.live:
            if seg.seq < start.segment or seg.seq > end.segment:
                continue
            first = start.entry if seg.seq == start.segment else 0
            last = await segs.last_entry(seg)
            if seg.seq == end.segment:
                last = min(last, end.entry if end.slot > 0 else end.entry - 1)
            size = seg.size_bytes if seg.state == "closed" else 0
            step = opts.max_entries_per_partition
            for a in range(first, last + 1, step):
                b = min(last, a + step - 1)
                share = size * (b - a + 1) // (seg.last_entry + 1) if seg.last_entry >= 0 else 0
                out.append(StreamRange(seg.seq, seg.ledger_id, a, b, start, end, share))
        return out
    return await _with_segments(opts, plan)


def _slots(r: StreamRange, entry: int, count: int) -> tuple[int, int]:
    """The slots of `entry` inside [r.start, r.end): all of them except in the two edge entries."""
    here = Position(r.seq, entry, 0)
    first = r.start.slot if here[:2] == r.start[:2] else (0 if here >= r.start else count)
    stop = min(count, r.end.slot) if here[:2] == r.end[:2] else (count if here < r.end else 0)
    return first, max(first, stop)


def read_stream_range(opts: SourceOptions, r: StreamRange) -> Iterator[pa.RecordBatch]:
    """One partition on an executor: decode record sets, keep start <= position < end."""
    bk = bookkeeper.sync.BookKeeper.connect(opts.metadata_uri)
    try:
        rh = bk.open_ledger(r.ledger_id, recovery=False)
        step = chunk_entries(r.planned_bytes, r.last - r.first + 1) if r.planned_bytes else 64
        for a in range(r.first, r.last + 1, step):
            b = min(r.last, a + step - 1)
            try:
                entries = rh.read(a, b)
            except BKError as e:
                raise type(e)(f"bookkeeper source: stream {opts.stream!r} segment {r.seq} (ledger {r.ledger_id}), "
                              f"reading entries {a}..{b}: {e}") from e
            positions, txids, datas = [], [], []
            for entry in entries:
                records = recordset.decode(entry.data).records
                first, stop = _slots(r, entry.entry_id, len(records))
                prefix = f"{r.seq}:{entry.entry_id}:"
                positions += [prefix + str(slot) for slot in range(first, stop)]
                txids += [txid for txid, _ in records[first:stop]]
                datas += [data for _, data in records[first:stop]]
            if positions:
                yield pa.RecordBatch.from_arrays([pa.array(positions, pa.string()), pa.array(txids, pa.int64()),
                                                  pa.array(datas, pa.binary())], schema=STREAM_ARROW)
    finally:
        bk.close()
