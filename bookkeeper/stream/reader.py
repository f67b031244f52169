"""A stream reader: records in position order across segments, tailing the open one.

Why a cursor and not a segment index: the reader keeps the position of the next record
it may return and asks, at every step, for the first live segment at or after the
cursor's segment. Rolls, retention deleting segments under it, empty segments retired
by a new writer and gaps in sequence numbers are all the same case, and a record is
never returned twice because nothing below the cursor is ever returned.

Why the segment list is kept and not re-read at every step: a listing reads every segment
node, so a reader catching up over S segments that re-listed at each one made O(S^2) reads.
It lists once, with a children watch on the stream's segments znode, and lists again only
after that watch fires (a roll added a segment, retention or a new writer removed one), or
when a segment it was reading vanished. What a kept listing can get wrong is harmless: an
open segment since closed is read through its ledger's own metadata, a segment since deleted
is skipped when its ledger is missing. A reader waiting at the end checks every _RESCAN_S
that the list did not change without its watch firing: one stat, not a listing.

A reader reads only up to a segment's LAC (acknowledged records), takes no lock and
writes nothing: any number of readers can follow a stream.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bookkeeper.client.ledger import LedgerEntry, ReadHandle
from bookkeeper.errors import NoSuchLedgerError
from bookkeeper.meta.streams import Segment
from bookkeeper.stream import recordset
from bookkeeper.stream.position import Position

if TYPE_CHECKING:
    from bookkeeper.stream.namespace import Namespace

log = logging.getLogger(__name__)
_RESCAN_S = 5.0  # a lost segment watch costs at most this much latency (and one stat per period)


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """One record read back: where it is, its txid and its bytes."""

    position: Position
    txid: int
    data: bytes


class StreamReader:
    """Async iterator of StreamRecord; `await ns.open_reader(name, start=...)` makes one."""

    def __init__(self, ns: Namespace, name: str, *, follow: bool) -> None:
        self._ns = ns
        self.name = name
        self._follow = follow
        self._loop = asyncio.get_running_loop()
        self._cursor = Position(0, 0, 0)
        self._min_txid = -1
        self._changed = asyncio.Event()  # the segments' children watch fired since the last listing
        self._segs: list[Segment] | None = None  # segments as last listed (None: not yet)
        self._listed_version: int | None = None  # the segment list's version (pzxid) at that listing
        self._gen: AsyncIterator[StreamRecord] | None = None

    @property
    def position(self) -> Position:
        """Where the next record returned will be (at or after)."""
        return self._cursor

    # -- where to start ---------------------------------------------------------------------
    async def _seek(self, start: str | Position, txid: int | None) -> None:
        meta = await self._ns.stream_meta(self.name)
        segs = await self._segments()
        if txid is not None:
            if not isinstance(txid, int):
                raise TypeError(f"txid must be an int, not {type(txid).__name__}")
            self._min_txid = txid
            self._cursor = await self._txid_cursor(segs, txid, meta.next_seq)
        elif isinstance(start, Position):
            self._cursor = start
        elif start == "earliest":
            self._cursor = Position(segs[0].seq if segs else meta.next_seq, 0, 0)
        elif start == "latest":
            self._cursor = await self._latest_cursor(segs, meta.next_seq)
        else:
            raise ValueError(f"start must be 'earliest', 'latest' or a Position, not {start!r}")

    async def _latest_cursor(self, segs: list[Segment], next_seq: int) -> Position:
        if not segs:
            return Position(next_seq, 0, 0)
        last = segs[-1]
        if last.state != "open":
            return Position(last.seq + 1, 0, 0)
        rh = await self._handle(last)
        return Position(last.seq, (rh.last_add_confirmed + 1) if rh else 0, 0)

    async def _txid_cursor(self, segs: list[Segment], txid: int, next_seq: int) -> Position:
        """The first entry that may hold txid >= `txid`: a segment by its metadata, then a
        binary search over entry headers (each set's last txid grows with the entry id)."""
        for seg in segs:
            if seg.state == "closed" and seg.last_txid < txid:
                continue
            rh = await self._handle(seg)
            if rh is None:
                continue
            lo, hi = 0, rh.last_add_confirmed + 1   # answer in [lo, hi]; hi: past the last entry
            while lo < hi:
                mid = (lo + hi) // 2
                _, _, last_txid, _ = recordset.decode_header((await rh.read(mid, mid))[0].data)
                if last_txid >= txid:
                    hi = mid
                else:
                    lo = mid + 1
            return Position(seg.seq, lo, 0)
        return Position(segs[-1].seq + 1 if segs else next_seq, 0, 0)

    # -- reading ------------------------------------------------------------------------
    def __aiter__(self) -> StreamReader:
        return self

    async def __anext__(self) -> StreamRecord:
        if self._gen is None:
            self._gen = self._records()
        return await self._gen.__anext__()

    async def _records(self) -> AsyncIterator[StreamRecord]:
        while True:
            segs = await self._segments()
            seg = next((s for s in segs if s.seq >= self._cursor.segment), None)
            if seg is None:
                if not self._follow:
                    return
                await self._wait_for_segments()
                continue
            if seg.seq > self._cursor.segment:
                self._cursor = Position(seg.seq, 0, 0)
            try:
                async for rec in self._segment_records(seg):
                    yield rec
            except NoSuchLedgerError:
                self._changed.set()  # deleted by retention under us: re-list, go on from the cursor
                continue
            if seg.state == "open" and not self._follow:
                return
            self._cursor = Position(seg.seq + 1, 0, 0)

    async def _segments(self) -> list[Segment]:
        """The live segments: the kept listing, or a new one (with the watch set again) when the
        watch fired since or the kept one was dropped (see the module's note). A new listing
        reads only the segments not closed when last read: a roll costs a tailing reader the
        new segment and the one it closed, not every segment again."""
        if self._segs is not None and not self._changed.is_set():
            return self._live(self._segs)
        ns = self._ns
        self._changed.clear()  # before the listing: a change after it fires the new watch
        version, listed = await ns.bk.metadata_call(
            functools.partial(ns.store.list_segments, ns.name, self.name, self._watch_fired, known=self._segs or ()))
        self._listed_version, self._segs = version, listed
        return self._live(listed)

    def _watch_fired(self, _event: object) -> None:
        """The segments' children watch (kazoo's thread). One bound method per reader: kazoo
        keeps a path's watchers in a set, so listing again before it fires adds none."""
        self._loop.call_soon_threadsafe(self._changed.set)

    async def _wait_for_segments(self) -> None:
        """At the end of the stream: until the watch fires, or _RESCAN_S passed and one stat
        says the list changed anyway (a watch lost; a vanished stream is reported by the
        listing that follows)."""
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancellation (Ctrl-C)
            async with asyncio.timeout(_RESCAN_S):  # that lands as the event is set
                await self._changed.wait()
        except TimeoutError:
            ns = self._ns
            if await ns.bk.metadata_call(ns.store.segments_version, ns.name, self.name) != self._listed_version:
                self._changed.set()

    async def _segment_records(self, seg: Segment) -> AsyncIterator[StreamRecord]:
        """Records of one segment from the cursor: a closed one read in windows, an open one
        tailed (long-poll) until its writer or a recovery closes it."""
        rh = await self._handle(seg)
        if rh is None:
            return
        start = self._cursor.entry
        if rh.is_closed or not self._follow:
            last = rh.last_add_confirmed
            window = self._ns.bk.config.read_window
            for first in range(start, last + 1, window):
                for entry in await rh.read(first, min(last, first + window - 1)):
                    for rec in self._unpack(seg.seq, entry):
                        yield rec
            return
        async for entry in rh.tail(start):
            for rec in self._unpack(seg.seq, entry):
                yield rec

    def _unpack(self, seq: int, entry: LedgerEntry) -> list[StreamRecord]:
        rs = recordset.decode(entry.data)
        out = []
        for slot, (txid, data) in enumerate(rs.records):
            pos = Position(seq, entry.entry_id, slot)
            if pos >= self._cursor and txid >= self._min_txid:
                out.append(StreamRecord(pos, txid, data))
        self._cursor = max(self._cursor, Position(seq, entry.entry_id + 1, 0))
        return out

    async def _handle(self, seg: Segment) -> ReadHandle | None:
        """A read handle on the segment's ledger (never a recovery: readers do not fence)."""
        try:
            return await self._ns.bk.open_ledger(seg.ledger_id, password=self._ns.password, recovery=False)
        except NoSuchLedgerError:
            return None

    @staticmethod
    def _live(segs: list[Segment]) -> list[Segment]:
        return [s for s in segs if s.state != "truncated"]

    async def close(self) -> None:
        """Stop reading (a reader holds nothing in ZooKeeper or on the bookies)."""
        if self._gen is not None:
            await self._gen.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> StreamReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

