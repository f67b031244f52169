"""Ledger handles: the asyncio shell over the sans-I/O quorum core.

Lives in: the client's event loop.

WriteHandle: pipelined adds striped over the ensemble, acknowledged in id order
after Qa durable responses; the LAC rides on every add. ReadHandle: reads from
each entry's write set, trying the next replica on error; every entry's digest is
verified before it is returned.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bookkeeper.client.core import AddTracker, entry_missing, fence_covered, write_set
from bookkeeper.client.digest import HEADER_BYTES, DigestManager
from bookkeeper.errors import (
    BKError,
    DigestMismatchError,
    LedgerClosedError,
    LedgerFencedError,
    MetadataVersionError,
    NoSuchEntryError,
    NoSuchLedgerError,
    TooLargeError,
)
from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState
from bookkeeper.proto import REQUEST_HEADER_BYTES, Flag, Op

if TYPE_CHECKING:
    from bookkeeper.client.client import BookKeeper

log = logging.getLogger(__name__)

READ_WINDOW = 512        # entries in flight per read() call
LONG_POLL_MS = 10_000


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One entry read back: its id and its bytes (digest verified)."""

    entry_id: int
    data: bytes
    ledger_id: int = -1


class ReadHandle:
    """Reads a ledger (closed, or open and read up to its LAC)."""

    def __init__(self, bk: BookKeeper, metadata: LedgerMetadata, password: bytes, lac: int) -> None:
        self._bk = bk
        self.metadata = metadata
        self.ledger_id = metadata.ledger_id
        self._digest = DigestManager(metadata.ledger_id, metadata.digest, password)
        self._key = bk.master_key(password)
        self._lac = lac
        self._length = metadata.length

    @property
    def last_add_confirmed(self) -> int:
        return self._lac

    @property
    def length(self) -> int:
        return self._length

    @property
    def is_closed(self) -> bool:
        return self.metadata.is_closed

    async def _read_one(self, entry_id: int, *, flags: int = 0) -> tuple[bytes, int, int]:
        """(data, lac, length) of one entry from its write set, replica by replica."""
        md = self.metadata
        ensemble = md.ensemble_for(entry_id)
        last_err: BKError | None = None
        for idx in write_set(entry_id, md.ensemble_size, md.write_quorum):
            try:
                resp = await self._bk.pool.call(ensemble[idx], Op.READ_ENTRY, flags, self.ledger_id,
                                                entry_id, self._key)
                return self._digest.verify(resp[6], entry_id)
            except (BKError, DigestMismatchError) as e:
                last_err = e
        if isinstance(last_err, (NoSuchEntryError, NoSuchLedgerError)):
            raise NoSuchEntryError(f"entry {self.ledger_id}:{entry_id} not found on its write set")
        raise last_err or BKError("empty write set")

    async def read(self, first: int, last: int) -> list[LedgerEntry]:
        """Entries first..last inclusive. Past the LAC of an open ledger: NoSuchEntryError."""
        if first < 0 or last < first:
            raise BKError(f"invalid range {first}..{last}")
        lac = self.last_add_confirmed
        if last > lac:
            raise NoSuchEntryError(f"entry {last} is past the last add confirmed ({lac}) of ledger "
                                   f"{self.ledger_id}")
        out: list[LedgerEntry] = []
        for start in range(first, last + 1, READ_WINDOW):
            stop = min(last, start + READ_WINDOW - 1)
            results = await asyncio.gather(*(self._read_one(e) for e in range(start, stop + 1)))
            out.extend(LedgerEntry(e, r[0], self.ledger_id) for e, r in zip(range(start, stop + 1), results))
        return out

    async def read_last_add_confirmed(self) -> int:
        """Ask the last ensemble for the LAC (may lag the writer by one entry); never goes back."""
        if self.metadata.is_closed:
            return self._lac
        ensemble = self.metadata.last_ensemble
        results = await asyncio.gather(
            *(self._bk.pool.call(b, Op.READ_LAC, 0, self.ledger_id, -1, self._key) for b in ensemble),
            return_exceptions=True)
        lacs = [r[5] for r in results if isinstance(r, tuple)]
        if not lacs:
            if all(isinstance(r, NoSuchLedgerError) for r in results):
                return self._lac
            raise next(r for r in results if isinstance(r, BaseException))
        self._lac = max(self._lac, max(lacs))
        return self._lac

    async def tail(self, start: int = 0) -> AsyncIterator[LedgerEntry]:
        """Entries from start on, following the writer (long-poll) until the ledger is closed."""
        nxt = start
        while True:
            if nxt <= self._lac:
                for entry in await self.read(nxt, self._lac):
                    yield entry
                nxt = self._lac + 1
                continue
            md = await self._bk._read_metadata(self.ledger_id)
            self.metadata = md
            if md.is_closed:
                self._lac = md.last_entry_id
                if nxt > self._lac:
                    return
                continue
            try:
                data, lac, _ = await self._long_poll(nxt)
            except (NoSuchEntryError, BKError):
                await self.read_last_add_confirmed()
                continue
            self._lac = max(self._lac, lac, nxt)
            yield LedgerEntry(nxt, data, self.ledger_id)
            nxt += 1

    async def _long_poll(self, entry_id: int) -> tuple[bytes, int, int]:
        """Wait on the first bookie of the write set for entry_id (no busy polling)."""
        ensemble = self.metadata.ensemble_for(entry_id)
        bookie = ensemble[write_set(entry_id, self.metadata.ensemble_size, self.metadata.write_quorum)[0]]
        resp = await self._bk.pool.call(bookie, Op.READ_ENTRY, Flag.LONG_POLL, self.ledger_id, entry_id,
                                        self._key, LONG_POLL_MS)
        return self._digest.verify(resp[6], entry_id)

    async def close(self) -> None:
        """Nothing to release for a read handle."""


class WriteHandle(ReadHandle):
    """The single writer of a ledger: pipelined, in-order, quorum-acknowledged adds."""

    def __init__(self, bk: BookKeeper, metadata: LedgerMetadata, password: bytes) -> None:
        super().__init__(bk, metadata, password, -1)
        self._tracker = AddTracker(ensemble_size=metadata.ensemble_size, write_quorum=metadata.write_quorum,
                                   ack_quorum=metadata.ack_quorum)
        self._next = 0
        self._sent_length = 0  # ledger length after the last entry sent: each entry's length field
        self._frame_overhead = REQUEST_HEADER_BYTES + HEADER_BYTES + self._digest.size
        self._futures: dict[int, asyncio.Future[int]] = {}
        self._error: BKError | None = None
        self._closing = False
        self._loop = asyncio.get_running_loop()

    @property
    def last_add_confirmed(self) -> int:
        return self._tracker.lac

    @property
    def length(self) -> int:
        return self._tracker.length

    def add_entry_async(self, data: bytes) -> asyncio.Future[int]:
        """Send an entry now; the future resolves to its id once acknowledged (in id order)."""
        if self._closing or self.metadata.is_closed:
            raise LedgerClosedError(f"ledger {self.ledger_id} is closed")
        if self._error is not None:
            raise type(self._error)(str(self._error))
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"entry data must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) + self._frame_overhead > self._bk.pool.max_frame_bytes:
            raise TooLargeError(f"entry of {len(data)} bytes does not fit the {self._bk.pool.max_frame_bytes}-byte "
                                f"frame limit")
        entry_id = self._next
        self._next += 1
        fut: asyncio.Future[int] = self._loop.create_future()
        self._futures[entry_id] = fut
        ws = self._tracker.add(entry_id, len(data))
        self._sent_length += len(data)
        payload = self._digest.encode(entry_id, self._tracker.lac, self._sent_length, data)
        ensemble = self.metadata.ensemble_for(entry_id)
        for idx in ws:
            self._bk.pool.send(ensemble[idx], Op.ADD_ENTRY, 0, self.ledger_id, entry_id, self._key, 0, payload,
                               lambda resp, err, e=entry_id, i=idx: self._on_add_response(e, i, err))
        return fut

    async def add_entry(self, data: bytes) -> int:
        """Add one entry and wait for its acknowledgement; returns its id."""
        return await self.add_entry_async(data)

    def _on_add_response(self, entry_id: int, idx: int, err: BKError | None) -> None:
        if err is None:
            for eid, _length in self._tracker.ack(entry_id, idx):
                fut = self._futures.pop(eid)
                if not fut.done():
                    fut.set_result(eid)
            return
        if isinstance(err, LedgerFencedError):
            self._fail(LedgerFencedError(f"ledger {self.ledger_id} was fenced: a recovery open took it over"))
        elif entry_id in self._futures and self._tracker.fail(entry_id, idx):
            self._fail(type(err)(f"add of entry {entry_id} to ledger {self.ledger_id} cannot reach the ack "
                                 f"quorum: {err}"))

    def _fail(self, err: BKError) -> None:
        """The handle is broken: every outstanding and future add fails with err."""
        if self._error is None:
            self._error = err
        for eid in self._tracker.drop_all():
            fut = self._futures.pop(eid, None)
            if fut is not None and not fut.done():
                fut.set_exception(type(err)(str(err)))

    async def close(self) -> None:
        """Wait for outstanding adds, then close the metadata at the LAC (compare-and-set)."""
        if self.metadata.is_closed:
            return
        self._closing = True
        if self._futures:
            await asyncio.gather(*self._futures.values(), return_exceptions=True)
        lac, length = self._tracker.lac, self._tracker.length
        md = self.metadata
        while True:
            try:
                self.metadata = await self._bk._write_metadata(
                    md.replace(state=LedgerState.CLOSED, last_entry_id=lac, length=length))
                break
            except MetadataVersionError:
                md = await self._bk._read_metadata(self.ledger_id)
                if md.is_closed:
                    self.metadata = md
                    if md.last_entry_id != lac:
                        raise LedgerFencedError(
                            f"ledger {self.ledger_id} was recovered by another client and closed at entry "
                            f"{md.last_entry_id}, not {lac}") from None
                    break
                if md.state is LedgerState.IN_RECOVERY:
                    raise LedgerFencedError(f"ledger {self.ledger_id} is being recovered by another client")
        self._lac = lac
        self._length = length
        if self._error is not None and not isinstance(self._error, LedgerFencedError):
            log.warning("ledger %d closed at %d after an add failure: %s", self.ledger_id, lac, self._error)


async def recover(bk: BookKeeper, md: LedgerMetadata, password: bytes) -> LedgerMetadata:
    """Fence an open ledger, recover its tail and close it (Reference: BookKeeper ledger recovery).

    1. metadata -> IN_RECOVERY (CAS); 2. fence on the last ensemble until every write
    set has fewer than Qa unfenced bookies; 3. from the highest LAC seen, recovery-read
    forward: an entry found is rewritten to its whole write set, an entry that Qw-Qa+1
    bookies deny ends the ledger; 4. close the metadata (CAS) at the last entry found.
    """
    while md.state is not LedgerState.CLOSED:
        if md.state is LedgerState.OPEN:
            try:
                md = await bk._write_metadata(md.replace(state=LedgerState.IN_RECOVERY))
            except MetadataVersionError:
                md = await bk._read_metadata(md.ledger_id)
                continue
        handle = ReadHandle(bk, md, password, -1)
        key, e, qw, qa = handle._key, md.ensemble_size, md.write_quorum, md.ack_quorum
        ensemble = md.last_ensemble
        results = await asyncio.gather(
            *(bk.pool.call(b, Op.READ_LAC, Flag.FENCE, md.ledger_id, -1, key) for b in ensemble),
            return_exceptions=True)
        fenced = {i for i, r in enumerate(results) if isinstance(r, tuple)}
        if not fence_covered(fenced, ensemble_size=e, write_quorum=qw, ack_quorum=qa):
            errs = [r for r in results if isinstance(r, BaseException)]
            raise BKError(f"recovery of ledger {md.ledger_id}: could not fence enough bookies: {errs[:3]}")
        lac = max([r[5] for r in results if isinstance(r, tuple)] + [-1])
        last, length = lac, 0
        if lac >= 0:
            _, _, length = await handle._read_one(lac)
        entry_id = lac + 1
        while True:
            found = await _recovery_read(bk, handle, entry_id)
            if found is None:
                break
            payload, length = found
            await _rewrite(bk, md, handle._key, entry_id, payload)
            last = entry_id
            entry_id += 1
        try:
            return await bk._write_metadata(md.replace(state=LedgerState.CLOSED, last_entry_id=last, length=length))
        except MetadataVersionError:
            md = await bk._read_metadata(md.ledger_id)
    return md


async def _recovery_read(bk: BookKeeper, handle: ReadHandle, entry_id: int) -> tuple[bytes, int] | None:
    """(payload, length) of entry_id if any replica has a valid copy; None if it was never acknowledged."""
    md = handle.metadata
    ensemble = md.ensemble_for(entry_id)
    ws = write_set(entry_id, md.ensemble_size, md.write_quorum)
    results = await asyncio.gather(
        *(bk.pool.call(ensemble[i], Op.READ_ENTRY, Flag.FENCE, md.ledger_id, entry_id, handle._key) for i in ws),
        return_exceptions=True)
    denied = 0
    for r in results:
        if isinstance(r, tuple):
            try:
                _, _, length = handle._digest.verify(r[6], entry_id)
                return r[6], length
            except DigestMismatchError:
                continue
        if isinstance(r, (NoSuchEntryError, NoSuchLedgerError)):
            denied += 1
    if entry_missing(denied, write_quorum=md.write_quorum, ack_quorum=md.ack_quorum):
        return None
    raise BKError(f"recovery of ledger {md.ledger_id}: entry {entry_id} is neither readable nor denied by "
                  f"enough bookies: {results}")


async def _rewrite(bk: BookKeeper, md: LedgerMetadata, key: bytes, entry_id: int, payload: bytes) -> None:
    """Recovery add of an entry to its whole write set; waits for Qa acknowledgements."""
    ensemble = md.ensemble_for(entry_id)
    ws = write_set(entry_id, md.ensemble_size, md.write_quorum)
    results = await asyncio.gather(
        *(bk.pool.call(ensemble[i], Op.ADD_ENTRY, Flag.RECOVERY_ADD, md.ledger_id, entry_id, key, 0, payload)
          for i in ws), return_exceptions=True)
    if sum(1 for r in results if isinstance(r, tuple)) < md.ack_quorum:
        raise BKError(f"recovery of ledger {md.ledger_id}: rewrite of entry {entry_id} failed: {results}")
