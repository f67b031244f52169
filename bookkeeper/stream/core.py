"""A stream writer's decisions (sans-I/O; the shell is StreamWriter in bookkeeper.stream.writer).

Events in: records accepted (with or without txids), a segment started, a record set sent
or settled, the writer going idle, ZooKeeper paused or back, a roll begun or done, a
failure. Decisions out: seal now or after the set delay, the next record set and its
payload (or wait for room in flight), whether a sent set rolls the segment, the error a
failed add means for the stream, whether an idle writer sends a control entry, the
segment a close writes. No loop, timer, ledger, ZooKeeper call or clock here (time comes
in as numbers): the shell does what a decision names and feeds the result back. A call's
completion (`Waiter`) is resolved here, as the client core's AddTracker resolves adds.

Why a core: the stream's rules (txids rising without gaps, a segment rolled at its limits
without losing or reordering a record, a takeover ending the old writer with
StreamLockLostError, the in-flight bound, an idle writer's last set made visible) were
decided inline between awaits; as plain calls they are scripted event by event
(tests/data/stream/*.txt, tests/test_core_scripts.py).
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import itertools
import operator
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from bookkeeper.errors import (BKError, InternalError, LedgerFencedError, StreamLockLostError, TooLargeError,
                               TxidOrderError, WriterClosedError)
from bookkeeper.meta.streams import Segment
from bookkeeper.stream import recordset
from bookkeeper.stream.policy import RollReason, roll_reason
from bookkeeper.stream.position import Position

if TYPE_CHECKING:
    import asyncio

MAX_RECORD_BYTES = 4 * 1024 * 1024  # a record set must fit one 5 MiB frame with its headers
_new_position = functools.partial(tuple.__new__, Position)  # Position from a 3-tuple at C speed


class Waiter:
    """One write or write_batch call: a completion (a future) for all its records' positions.

    Why not a future per record: at 100,000 records/s, creating, resolving and gathering
    one future per record was most of the writer's CPU (profiled); a call's records are
    consecutive, so a set acknowledges a run of them at once.
    """

    __slots__ = ("fut", "positions", "remaining")

    def __init__(self, fut: asyncio.Future[list[Position]], count: int) -> None:
        self.fut = fut
        self.positions: list[Position] = []
        self.remaining = count

    def acked(self, seq: int, entry: int, first_slot: int, count: int) -> None:
        self.positions.extend(map(_new_position, zip(repeat(seq), repeat(entry), range(first_slot, first_slot + count))))
        self.remaining -= count
        if self.remaining == 0 and not self.fut.done():
            self.fut.set_result(self.positions)

    def fail(self, err: BKError) -> None:
        if not self.fut.done():
            self.fut.set_exception(type(err)(str(err)))


class RecordSet:
    """Records waiting to be sealed, or sealed into one set, and which calls they belong to
    (`owners`: [waiter, count] runs, in record order)."""

    __slots__ = ("records", "owners", "size")

    def __init__(self) -> None:
        self.records: list[tuple[int, bytes]] = []
        self.owners: list[list[Any]] = []
        self.size = 0

    def acked(self, seq: int, entry: int) -> None:
        """The set is entry `entry` of segment `seq`: each call gets its records' positions."""
        slot = 0
        for waiter, count in self.owners:
            waiter.acked(seq, entry, slot, count)
            slot += count

    def fail(self, err: BKError) -> None:
        for waiter, _ in self.owners:
            waiter.fail(err)


class Seal(enum.Enum):
    """When the records pending after an accept are sealed into a set."""

    NOW = "now"      # a set's worth is pending, or the caller asked (write_batch)
    LATER = "later"  # after record_set_max_delay_ms, unless a set's worth comes first


class Room(enum.Enum):
    """Why next_set gave no set although records are pending."""

    WAIT = "wait"  # the in-flight bound: seal again once a set in flight settles


class StreamWriterCore:
    """The state a stream writer's decisions need, and the decisions.

    `settings` is the writer's WriterSettings. `rolling`, `suspended` (ZooKeeper
    unreachable: no set is sent, the session may be expiring) and `closed` are set by the
    shell as those happen; `error` once the writer failed (every later call fails with it).
    """

    def __init__(self, name: str, settings: Any, *, last_txid: int = -1) -> None:
        self.name = name
        self.settings = settings
        self.codec = recordset.CODECS[settings.compression]
        self.pending = RecordSet()
        self.last_txid = last_txid     # of the last record accepted (sent or pending)
        self.segment: Segment | None = None
        self.seg_started = 0.0         # the shell's clock when the segment started
        self.seg_records = 0           # records sealed into the current segment
        self.seg_first_txid = -1
        self.seg_last_txid = -1
        self.inflight = 0              # sets and control entries sent, not settled
        self.inflight_bytes = 0
        self.control_due = False       # a data set was sent after the last control entry
        self.rolling = False
        self.suspended = False
        self.closed = False
        self.error: BKError | None = None

    # -- accepting records ---------------------------------------------------------
    def check_usable(self) -> None:
        if self.error is not None:
            raise type(self.error)(str(self.error))
        if self.closed:
            raise WriterClosedError(f"the writer of stream {self.name!r} is closed")

    def accept(self, records: Sequence[bytes], txids: Sequence[int] | None, waiter: Waiter) -> Seal:
        """Queue records for waiter (its count is len(records)). Everything is checked first:
        bad input raises, loses nothing and leaves the writer as it was. Automatic txids
        follow the last one; given ones must rise strictly above it."""
        self.check_usable()
        if txids is not None and len(txids) != len(records):
            raise ValueError(f"{len(txids)} txids for {len(records)} records")
        last, limit = self.last_txid, MAX_RECORD_BYTES - recordset.RECORD_OVERHEAD - recordset.HEADER_BYTES
        if not set(map(type, records)) <= {bytes}:  # the common case checked at C speed
            for data in records:
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    raise TypeError(f"record data must be bytes, not {type(data).__name__}")
            records = [bytes(d) for d in records]
        lengths = list(map(len, records))
        if max(lengths) > limit:
            raise TooLargeError(f"record of {max(lengths)} bytes is over the {limit}-byte record limit")
        if txids is None:
            chosen: Sequence[int] = range(last + 1, last + 1 + len(records))
        else:
            chosen = list(txids)
            for t in chosen:
                if not isinstance(t, int) or t <= last:
                    raise TxidOrderError(f"txid {t!r} is not above the stream's last txid {last}: "
                                         f"txids increase strictly")
                last = t
        p = self.pending
        p.records.extend(zip(chosen, records))
        p.owners.append([waiter, len(records)])
        p.size += sum(lengths) + recordset.RECORD_OVERHEAD * len(records)
        self.last_txid = chosen[-1]
        return Seal.NOW if p.size >= self.settings.record_set_max_bytes else Seal.LATER

    # -- sealing and sending ---------------------------------------------------------
    def next_set(self, ledger_length: int) -> tuple[RecordSet, bytes] | Room | None:
        """The next set to send and its payload; Room.WAIT when the in-flight bound holds it;
        None when nothing is to be sent now (nothing pending, a roll, a ZooKeeper pause, a
        failure: pending records stay, in order). ledger_length: the segment ledger's
        acknowledged bytes."""
        if not self.pending.records or self.rolling or self.suspended or self.error is not None:
            return None
        if self.full:
            return Room.WAIT
        batch = self._take(ledger_length)
        return batch, recordset.encode(batch.records, records_before=self.seg_records, codec=self.codec)

    @property
    def full(self) -> bool:
        """max_inflight_bytes are in flight: no set is sent until one settles."""
        return bool(self.inflight_bytes >= self.settings.max_inflight_bytes)

    def _take(self, ledger_length: int) -> RecordSet:
        """The longest prefix of the pending records (at least one) within record_set_max_bytes
        and within what the segment may still take, so a large batch rolls at its limits."""
        pending, s = self.pending, self.settings
        limit, max_n = s.record_set_max_bytes, len(pending.records)
        if s.segment_max_bytes is not None:
            limit = min(limit, s.segment_max_bytes - ledger_length - self.inflight_bytes)
        if s.segment_max_records is not None:
            max_n = min(max_n, s.segment_max_records - self.seg_records)
        n = max_n
        if pending.size > limit:  # the longest prefix whose running size (with overheads) fits
            sized = map(operator.add, map(len, map(itemgetter(1), pending.records[:max_n])),
                        repeat(recordset.RECORD_OVERHEAD))
            n = max(1, bisect.bisect_right(list(itertools.accumulate(sized)), limit))
        if n == len(pending.records):
            self.pending = RecordSet()
            return pending
        size = sum(map(len, map(itemgetter(1), pending.records[:n]))) + recordset.RECORD_OVERHEAD * n
        out = RecordSet()
        out.records, pending.records = pending.records[:n], pending.records[n:]
        out.size, pending.size = size, pending.size - size
        need = n
        while need:
            waiter, count = pending.owners[0]
            take = min(count, need)
            out.owners.append([waiter, take])
            if take == count:
                pending.owners.pop(0)
            else:
                pending.owners[0][1] = count - take
            need -= take
        return out

    def sent(self, batch: RecordSet, payload_bytes: int, *, now: float, ledger_length: int) -> RollReason | None:
        """A set went out as the segment's next entry: whether the segment rolls now."""
        if self.seg_records == 0:
            self.seg_first_txid = batch.records[0][0]
        self.seg_last_txid = batch.records[-1][0]
        self.seg_records += len(batch.records)
        self.control_due = True
        self.inflight += 1
        self.inflight_bytes += payload_bytes
        s = self.settings
        return roll_reason(records=self.seg_records, size_bytes=ledger_length + self.inflight_bytes,
                           age_s=now - self.seg_started, max_records=s.segment_max_records,
                           max_bytes=s.segment_max_bytes, max_age_s=s.segment_max_age_s)

    def settled(self, payload_bytes: int, exc: BaseException | None) -> BKError | None:
        """An entry sent (a set or a control entry) settled: exc is its failure (None: it was
        acknowledged), and the error the writer fails with is returned. A fenced ledger means
        another writer took the stream over (its recovery open fenced this segment)."""
        self.inflight -= 1
        self.inflight_bytes -= payload_bytes
        if exc is None:
            return None
        if isinstance(exc, LedgerFencedError) and not isinstance(exc, StreamLockLostError):
            return StreamLockLostError(f"stream {self.name!r}: its segment was fenced by another writer "
                                       f"(takeover); this writer writes no more")
        return exc if isinstance(exc, BKError) else InternalError(f"a stream add failed: {exc!r}")

    def set_failed(self, exc: BaseException | None) -> BKError:
        """What a set's calls fail with when its add did not happen (exc: its error; None:
        cancelled as the writer closed)."""
        return (self.error or (exc if isinstance(exc, BKError) else None)
                or WriterClosedError(f"the record set was not added: {exc!r}" if exc else
                                     "the writer closed before the record set was added"))

    # -- an idle writer's LAC ---------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing in flight or pending, and a set went out since the last control entry: the
        shell arms the control timer (lac_idle_flush_ms)."""
        return not self.inflight and self.control_due and not self.pending.records

    def control(self) -> bytes | None:
        """The control timer fired: the control entry to send (it carries the last set's LAC
        to the bookies, so tailing readers see an idle writer's last records; DistributedLog
        writes control records for the same reason), or None if the writer is busy again,
        has sent one since, or cannot write."""
        if not self.idle or self.rolling or self.suspended or self.error is not None or self.closed:
            return None
        self.control_due = False
        return recordset.encode_control(records_before=self.seg_records, last_txid=self.seg_last_txid)

    def control_sent(self, payload_bytes: int) -> None:
        """The control entry went out: in flight like a set (settled the same way)."""
        self.inflight += 1
        self.inflight_bytes += payload_bytes

    # -- segments and failure ---------------------------------------------------------
    def segment_started(self, segment: Segment, now: float) -> None:
        self.segment = segment
        self.seg_started, self.seg_records = now, 0
        self.seg_first_txid = self.seg_last_txid = -1
        self.control_due = False

    def segment_closed(self, last_entry: int, size_bytes: int, now_ms: int) -> Segment | None:
        """The segment as its close writes it (its ledger closed at last_entry); None when
        the ledger holds no entry: the segment is retired instead of closed."""
        assert self.segment is not None
        if last_entry < 0:
            return None
        return dataclasses.replace(self.segment, state="closed", first_txid=self.seg_first_txid,
                                   last_txid=self.seg_last_txid, last_entry=last_entry, records=self.seg_records,
                                   size_bytes=size_bytes, closed_ms=now_ms)

    def fail(self, err: BKError) -> RecordSet:
        """The writer is done: the pending records are returned (the shell fails their calls
        with err); later calls fail with the first error. Sets in flight settle as the
        bookies answer (an acknowledged one is durable and reported so)."""
        if self.error is None:
            self.error = err
        pending, self.pending = self.pending, RecordSet()
        return pending
