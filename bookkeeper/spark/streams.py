"""Streams as a Spark table and a streaming source: offsets are stream positions.

Why positions make exactly-once simple: a micro-batch is the half-open position range
[start, end), both ends written to Spark's offset log before it runs; reading the same
range again after a restart yields the same records, because a segment's entries up to a
LAC never change. `end` is always at or below a LAC, so no unacknowledged record is read.

Admission control needs "the position N records after start" without reading N records:
each record set's header says how many records came before it in its segment, so that is
a binary search over entry headers (a few entry reads), not a scan.

Why an offset carries the txid of the record before its position: retention may delete a
segment a query has not finished. A read whose start lies in a removed segment jumps to the
next survivor, and only the txids on both sides of the jump (planning.judge) tell a query that
had read everything there from one that lost records (failOnDataLoss decides what follows).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa

import bookkeeper.sync
from bookkeeper.client.ledger import ReadHandle
from bookkeeper.errors import BKError, DataLossError, NoSuchLedgerError
from bookkeeper.meta.streams import Segment
from bookkeeper.spark.options import SourceOptions, chunk_entries
from bookkeeper.spark.planning import Gap, Verdict, describe_gap, find_gap, judge
from bookkeeper.stream import Namespace, Position, recordset

STREAM_SCHEMA = "position string, txid long, data binary"
STREAM_ARROW = pa.schema([("position", pa.string()), ("txid", pa.int64()), ("data", pa.binary())])
log = logging.getLogger(__name__)
T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class Loss:
    """A gap judged LOST (or WAIT, where no waiting is possible) with the txids around it."""

    gap: Gap
    verdict: Verdict
    after_txid: int | None
    first_txid: int | None

    def describe(self, opts: SourceOptions) -> str:
        return f"stream {opts.stream!r} (namespace {opts.namespace!r}): " + \
            describe_gap(self.gap, self.after_txid, self.first_txid)


@dataclass(frozen=True, slots=True)
class NextEnd:
    """What latestOffset needs: the stream's end now, and the end of the next micro-batch with
    the txid of the record before it (end == start: nothing to read yet)."""

    latest: Position
    end: Position
    after_txid: int | None


class _Segments:
    """The segments of one stream with, per live segment, its last readable entry (closed:
    its last entry; open: its LAC, read without fencing) and read handles, for one planning call."""

    def __init__(self, ns: Namespace, name: str) -> None:
        self.ns = ns
        self.name = name
        self.nodes: list[Segment] = []      # every segment node, those marked truncated included
        self.live: list[Segment] = []
        self.next_seq = 1
        self._handles: dict[int, ReadHandle] = {}
        self._entries: dict[tuple[int, int], bytes] = {}   # entries up to a LAC never change

    async def load(self) -> _Segments:
        self.next_seq = (await self.ns.stream_meta(self.name)).next_seq
        self.nodes = await self.ns.segments(self.name)
        self.live = [s for s in self.nodes if s.state != "truncated"]
        return self

    async def handle(self, seg: Segment) -> ReadHandle:
        if seg.seq not in self._handles:
            self._handles[seg.seq] = await self.ns.bk.open_ledger(seg.ledger_id, password=self.ns.password,
                                                                  recovery=False)
        return self._handles[seg.seq]

    async def last_entry(self, seg: Segment) -> int:
        return seg.last_entry if seg.state == "closed" else (await self.handle(seg)).last_add_confirmed

    async def entry(self, seg: Segment, entry: int) -> bytes:
        """One entry, read once per planning call (a search and the txid of its answer share it)."""
        if (seg.seq, entry) not in self._entries:
            self._entries[seg.seq, entry] = (await (await self.handle(seg)).read(entry, entry))[0].data
        return self._entries[seg.seq, entry]

    async def header(self, seg: Segment, entry: int) -> tuple[int, int]:
        """(records before this entry in the segment, records in it)."""
        count, before, _, _ = recordset.decode_header(await self.entry(seg, entry))
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

    async def txid_before(self, pos: Position) -> int | None:
        """The txid of the last record before `pos`, if it survives (None: unknown or none)."""
        seg = next((s for s in self.live if s.seq == pos.segment), None)
        if seg is not None and (pos.entry, pos.slot) > (0, 0):
            if pos.entry - (pos.slot == 0) > await self.last_entry(seg):
                return None  # a position past what the segment holds
            if pos.slot:
                records = recordset.decode(await self.entry(seg, pos.entry)).records
                return records[pos.slot - 1][0] if pos.slot <= len(records) else None
            _, _, last_txid, _ = recordset.decode_header(await self.entry(seg, pos.entry - 1))
            return last_txid if last_txid >= 0 else None
        below = [s for s in self.live if s.seq < pos.segment]
        return below[-1].last_txid if below and below[-1].state == "closed" and below[-1].records else None

    async def first_txid(self, seq: int) -> int | None:
        """The txid of the first record of live segment `seq` (None: it holds none yet)."""
        seg = next(s for s in self.live if s.seq == seq)
        if seg.state == "closed":
            return seg.first_txid if seg.records else None
        if await self.last_entry(seg) < 0:
            return None
        return recordset.decode(await self.entry(seg, 0)).records[0][0]

    async def loss(self, start: Position, after_txid: int | None) -> Loss | None:
        """A read from `start` judged (planning.find_gap, planning.judge): None when nothing is lost."""
        gap = find_gap(start, self.nodes, self.next_seq)
        if gap is None:
            return None
        first = await self.first_txid(gap.resume_seq) if gap.resume_seq is not None else None
        verdict = judge(gap, after_txid, first)
        return None if verdict is Verdict.NONE else Loss(gap, verdict, after_txid, first)


async def _with_segments(opts: SourceOptions, fn: Callable[[_Segments], Awaitable[T]]) -> T:
    assert opts.stream is not None
    async with await Namespace.connect(opts.metadata_uri, opts.namespace) as ns:
        return await fn(await _Segments(ns, opts.stream).load())


async def resolve(opts: SourceOptions, which: str | Position) -> tuple[Position, int | None]:
    """`which` as a position, with the txid of the record before it (None: unknown)."""
    async def at(segs: _Segments) -> tuple[Position, int | None]:
        pos = await segs.position(which)
        return pos, await segs.txid_before(pos)
    return await _with_segments(opts, at)


async def next_end(opts: SourceOptions, start: Position, after_txid: int | None,
                   max_records: int | None, stop: Position | None = None) -> NextEnd:
    """The end of the micro-batch from `start`: the stream's end (or `stop`, if lower: a
    Trigger.AvailableNow run's target), or `max_records` records on. A start in a removed
    segment whose verdict is WAIT stays put until a record decides it."""
    async def step(segs: _Segments) -> NextEnd:
        latest = await segs.position("latest")
        bound = latest if stop is None else min(latest, stop)
        if bound <= start:
            return NextEnd(latest, start, after_txid)
        loss = await segs.loss(start, after_txid)
        if loss is not None and loss.verdict is Verdict.WAIT:
            return NextEnd(latest, start, after_txid)
        end = await _advance(segs, start, bound, max_records) if max_records else bound
        return NextEnd(latest, end, await segs.txid_before(end))
    return await _with_segments(opts, step)


async def _advance(segs: _Segments, start: Position, end: Position, records: int) -> Position:
    """The position `records` records after `start`, or `end` if fewer lie between them."""
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


async def plan_stream(opts: SourceOptions, start: str | Position, end: str | Position,
                      after_txid: int | None = None) -> tuple[Loss | None, list[StreamRange]]:
    """What a read of [start, end) loses at its start (a WAIT verdict counts as lost: the range
    is fixed), and its partitions: per segment, entry ranges of at most max_entries_per_partition."""
    async def plan(segs: _Segments) -> tuple[Loss | None, list[StreamRange]]:
        a, b = await segs.position(start), await segs.position(end)
        if b <= a:
            return None, []
        return await segs.loss(a, after_txid), await _ranges(segs, opts.max_entries_per_partition, a, b)
    return await _with_segments(opts, plan)


async def _ranges(segs: _Segments, step: int, start: Position, end: Position) -> list[StreamRange]:
    out: list[StreamRange] = []
    for seg in segs.live:
        if seg.seq < start.segment or seg.seq > end.segment:
            continue
        first = start.entry if seg.seq == start.segment else 0
        last = await segs.last_entry(seg)
        if seg.seq == end.segment:
            last = min(last, end.entry if end.slot > 0 else end.entry - 1)
        size = seg.size_bytes if seg.state == "closed" else 0
        for a in range(first, last + 1, step):
            b = min(last, a + step - 1)
            share = size * (b - a + 1) // (seg.last_entry + 1) if seg.last_entry >= 0 else 0
            out.append(StreamRange(seg.seq, seg.ledger_id, a, b, start, end, share))
    return out


def report_loss(opts: SourceOptions, what: str) -> None:
    """Records deleted before a read got to them (`what` names stream and range): DataLossError
    when failOnDataLoss is true, else a WARNING line, and the read goes on past them."""
    if opts.fail_on_data_loss:
        raise DataLossError(f"{what} were deleted by retention or truncation before this query read them "
                            f"(failOnDataLoss is true; set it to false to skip lost records and go on)")
    log.warning("%s were deleted by retention or truncation before this query read them: skipped "
                "(failOnDataLoss=false)", what)


def _slots(r: StreamRange, entry: int, count: int) -> tuple[int, int]:
    """The slots of `entry` inside [r.start, r.end): all of them except in the two edge entries."""
    here = Position(r.seq, entry, 0)
    first = r.start.slot if here[:2] == r.start[:2] else (0 if here >= r.start else count)
    stop = min(count, r.end.slot) if here[:2] == r.end[:2] else (count if here < r.end else 0)
    return first, max(first, stop)


def read_stream_range(opts: SourceOptions, r: StreamRange) -> Iterator[pa.RecordBatch]:
    """One partition on an executor: decode record sets, keep start <= position < end. A segment
    deleted between planning and this read is lost data (report_loss)."""
    bk = bookkeeper.sync.BookKeeper.connect(opts.metadata_uri)
    try:
        try:
            rh = bk.open_ledger(r.ledger_id, recovery=False)
        except NoSuchLedgerError:
            report_loss(opts, f"stream {opts.stream!r} (namespace {opts.namespace!r}): positions "
                              f"{max(r.start, Position(r.seq, r.first, 0))} up to "
                              f"{min(r.end, Position(r.seq, r.last + 1, 0))} (segment {r.seq}, ledger {r.ledger_id})")
            return
        yield from _batches(opts, r, rh)
    finally:
        bk.close()


def _batches(opts: SourceOptions, r: StreamRange, rh: bookkeeper.sync.ReadHandle) -> Iterator[pa.RecordBatch]:
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
