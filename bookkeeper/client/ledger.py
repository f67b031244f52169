"""Ledger handles: the asyncio shell over the sans-I/O quorum core.

Lives in: the client's event loop.

WriteHandle: pipelined adds striped over the ensemble, acknowledged in id order
after Qa durable responses; the LAC rides on every add. A bookie that fails or
times out is replaced (ensemble change: a new metadata segment from LAC + 1,
compare-and-set), and the unacknowledged entries are resent to its replacement:
the application sees latency, not an error. Outstanding adds are bounded.

ReadHandle: every entry is read from its write set, penalized bookies last, with a
speculative request to the next replica after a delay; the first copy that passes
its digest wins. Tailing waits at the head with long-poll reads (speculative ones to
every bookie of the next entry's ensemble) and a ZooKeeper watch on the ledger's metadata.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bookkeeper.client.context import LedgerContext
from bookkeeper.client.core import AckSink, AddTracker, write_set
from bookkeeper.client.core import recovery as recovery_core
from bookkeeper.client.core.reads import DENIALS, ReplicaRead
from bookkeeper.client.core.recovery import EntryVote, FenceVote
from bookkeeper.client.core.tailing import PollAnswer, head_outcome, judge_poll_answer, unheld_pause_s
from bookkeeper.client.core.writer import CHANGE_BACKOFF_FIRST_S, CloseStep, Verdict, WriterCore
from bookkeeper.client.digest import HEADER_BYTES, DigestManager
from bookkeeper.clock import system_monotonic
from bookkeeper.errors import (
    BKError,
    BookieUnavailableError,
    DigestMismatchError,
    InternalError,
    InvalidArgumentError,
    LedgerClosedError,
    LedgerFencedError,
    MetadataVersionError,
    NoSuchEntryError,
    NoSuchLedgerError,
    NotEnoughBookiesError,
    TooLargeError,
    TooManyOutstandingAddsError,
)
from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState
from bookkeeper.proto import REQUEST_HEADER_BYTES, Flag, Op

if TYPE_CHECKING:
    from bookkeeper.client.bookie_client import Segment

log = logging.getLogger(__name__)

ReadResult = tuple[bytes, int, int]  # data, lac piggybacked, ledger length after the entry


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One entry read back: its id and its bytes (digest verified)."""

    entry_id: int
    data: bytes
    ledger_id: int = -1
    length: int = -1    # the ledger's length in bytes after this entry (-1: not known)


class _EntryRead(ReplicaRead):
    """The read of one entry (client loop only): its decisions are ReplicaRead's
    (bookkeeper/client/core/reads.py); this sends, arms the speculative timer and settles
    the future. A slotted object, not closures: a range read makes one per entry. Its
    outcome goes to the client's metrics: the latency of a success, or one read error."""

    __slots__ = ("h", "flags", "fut", "timer", "started")

    def __init__(self, handle: ReadHandle, entry_id: int, flags: int, replicas: list[str]) -> None:
        super().__init__(handle.ledger_id, entry_id, replicas)
        self.h = handle
        self.flags = flags
        self.fut: asyncio.Future[ReadResult] = handle._loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.started = handle._ctx.clock()
        self.send_next()

    def send_next(self) -> bool:
        if self.fut.done():
            self.settled = True  # answered, or cancelled by its caller
        bookie = self.take_next()
        if bookie is None:
            return False
        h = self.h
        cfg = h._ctx.config
        h._ctx.pool.send(bookie, Op.READ_ENTRY, self.flags, h.ledger_id, self.entry_id, h._key, 0, b"",
                         self.on_response, bookie, cfg.read_timeout_s, borrow=True)
        if cfg.speculative_read_timeout_ms and self.can_speculate:
            self.timer = h._loop.call_later(cfg.speculative_read_timeout_ms / 1000.0, self.speculate)
        return True

    def speculate(self) -> None:
        self.timer = None
        if not self.fut.done() and self.can_speculate:
            self.h._ctx.stats["speculative_reads"] += 1
            self.send_next()

    def on_response(self, bookie: str, resp: tuple[Any, ...] | None, err: BKError | None) -> None:
        h = self.h
        if self.fut.done():
            self.settled = True
        if err is None:
            assert resp is not None
            if self.settled:
                self.copy_arrived()  # a later copy: the read is over
                return
            try:
                result = h._digest.verify(resp[6], self.entry_id)
            except DigestMismatchError as e:
                err = e
            else:
                self.copy_arrived()
                if self.timer is not None:
                    self.timer.cancel()
                h._ctx.read_latency.observe(h._ctx.clock() - self.started)
                self.fut.set_result(result)
                return
        if self.error_arrived(err):
            h._ctx.health.penalize(bookie)  # a fault, even a late one, marks the bookie slow
        if self.settled:
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.send_next() and self.exhausted:
            h._ctx.stats["read_errors"] += 1
            self.fut.set_exception(self.failure())


_HeadResult = tuple[PollAnswer | None, bytes | None, int]  # outcome (None: the metadata changed), entry, LAC


class _HeadWait:
    """One wait at a ledger's head (client loop only): a LONG_POLL read of entry_id to the
    first bookie, and to the rest (every other bookie of the entry's ensemble) once the first
    has not answered after speculative_read_timeout_ms or failed (bookkeeper/client/core/
    tailing.py says why). The first answer that settles the wait wins (head_outcome); of the
    others' answers only the LAC counts (_TailHead.learned). The metadata watch ends it early
    with outcome None."""

    __slots__ = ("h", "head", "entry_id", "rest", "asked", "answers", "lac", "error", "timer", "fut")

    def __init__(self, head: _TailHead, entry_id: int, first: str, rest: list[str]) -> None:
        handle = self.h = head.h
        self.head = head
        self.entry_id = entry_id
        self.rest = rest
        self.asked = 0
        self.answers: list[PollAnswer] = []
        self.lac = -1
        self.error: BKError | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.fut: asyncio.Future[_HeadResult] = handle._loop.create_future()
        self.ask([first])
        delay_ms = handle._ctx.config.speculative_read_timeout_ms
        if rest and delay_ms:
            self.timer = handle._loop.call_later(delay_ms / 1000.0, self.widen)

    def ask(self, bookies: list[str]) -> None:
        h = self.h
        cfg = h._ctx.config
        wait_ms = cfg.long_poll_timeout_ms
        self.asked += len(bookies)
        for bookie in bookies:
            h._ctx.pool.send(bookie, Op.READ_ENTRY, Flag.LONG_POLL, h.ledger_id, self.entry_id, h._key, wait_ms,
                            b"", self.on_response, bookie, wait_ms / 1000.0 + cfg.read_timeout_s, borrow=True)

    def widen(self) -> None:
        """Ask the rest: the first bookie is slow to hear of a LAC covering the entry, or failed."""
        self.timer = None
        if self.rest and not self.fut.done():
            rest, self.rest = self.rest, []
            self.ask(rest)

    def on_response(self, bookie: str, resp: tuple[Any, ...] | None, err: BKError | None) -> None:
        lac = -1 if resp is None else resp[5]
        if self.fut.done():  # settled: a later answer's LAC may still cover the next wait's entry
            self.head.learned(lac)
            return
        data: bytes | None = None
        if err is None:
            assert resp is not None
            try:
                data = self.h._digest.verify(resp[6], self.entry_id)[0]
            except DigestMismatchError as e:
                err = e
        answer = judge_poll_answer(self.entry_id, ok=err is None, absent=isinstance(err, DENIALS), lac=lac,
                                   unheld=isinstance(err, NoSuchLedgerError))
        if answer is PollAnswer.FAILED:
            self.error = err
            self.h._ctx.health.penalize(bookie)
            self.widen()  # before judging: the wait is not over while the rest may answer
        self.lac = max(self.lac, lac)
        self.answers.append(answer)
        outcome = head_outcome(self.answers, self.asked)
        if outcome is not None:  # settled by this answer, or the last one in
            self.settle((outcome, data, self.lac))

    def metadata_changed(self) -> None:
        self.settle((None, None, self.lac))

    def settle(self, result: _HeadResult) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.fut.done():
            self.fut.set_result(result)


class _TailHead:
    """A tail's state at the ledger's head (client loop; `_fired` runs on kazoo's thread): the
    wait in progress, and a ZooKeeper watch on the ledger's metadata.

    Why the watch: a close, a new segment or a recovery changes nothing a bookie's long poll
    waits for (a closed ledger's last entries may never be covered by any bookie's LAC), so
    without it a tailer learns of them only when its polls expire. Apache BookKeeper's
    read-only handles register a metadata listener for the same reason. It is one-shot, as
    ZooKeeper's watches are: armed at the head, re-armed after it fires. Arming reads the
    node's version, so a change between the handle's last metadata read and the arming is
    seen too. kazoo fires every watch when its session is lost, so a lost session re-arms as
    well. A watch or an answer that comes after its tail ended finds nothing waiting."""

    __slots__ = ("h", "armed", "waiting", "unheld_s", "resume")

    def __init__(self, handle: ReadHandle) -> None:
        self.h = handle
        self.armed = False
        self.waiting: _HeadWait | None = None
        self.unheld_s = 0.0  # the last pause while no bookie held the ledger (0: none since an entry)
        self.resume: asyncio.Future[None] | None = None  # set while pausing: the watch ends the pause

    async def arm(self) -> bool:
        """Set the watch unless it is set: True when the metadata is no longer the version the
        handle holds. NoSuchLedgerError if the ledger is gone."""
        if self.armed:
            return False
        self.armed = True  # before the call: a fire during it clears this again
        h = self.h
        try:
            version = await h._ctx.watch_metadata(h.ledger_id, self._fired)
        except BaseException:
            self.armed = False  # no watch was set: the next round tries again
            raise
        if version is None:
            raise NoSuchLedgerError(f"ledger {h.ledger_id} does not exist")
        return version != h.metadata.version

    def learned(self, lac: int) -> None:
        """A bookie's LAC from an answer to an earlier wait (any bookie's LAC is acknowledged):
        it may cover the entry the tail now waits for, on a bookie not yet told."""
        h = self.h
        h._lac = max(h._lac, lac)
        if self.waiting is not None and self.waiting.entry_id <= lac:
            self.waiting.settle((PollAnswer.COVERED, None, lac))

    def _fired(self, _event: Any) -> None:
        try:
            self.h._loop.call_soon_threadsafe(self._changed)
        except RuntimeError:  # the loop is closed: nobody tails any more
            pass

    async def pause(self) -> None:
        """No bookie holds the ledger yet (no add has reached one; each answered at once):
        wait before the next round (tailing.unheld_pause_s), or until the metadata changes."""
        self.unheld_s = unheld_pause_s(self.unheld_s)
        self.resume = self.h._loop.create_future()
        try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation (a
            async with asyncio.timeout(self.unheld_s):  # tail's Ctrl-C) that lands as resume is set
                await asyncio.shield(self.resume)
        except TimeoutError:
            pass
        finally:
            self.resume = None

    def _changed(self) -> None:
        self.armed = False
        if self.waiting is not None:
            self.waiting.metadata_changed()
        if self.resume is not None and not self.resume.done():
            self.resume.set_result(None)


class ReadHandle:
    """Reads a ledger (closed, or open and read up to its LAC).

    Slotted, as its subclasses: a client may hold 10^4 open handles (issue 26)."""

    __slots__ = ("_ctx", "_loop", "metadata", "ledger_id", "_digest", "_key", "_lac", "_length")

    def __init__(self, ctx: LedgerContext, metadata: LedgerMetadata, password: bytes, lac: int) -> None:
        self._ctx = ctx
        self._loop = asyncio.get_running_loop()
        self.metadata = metadata
        self.ledger_id = metadata.ledger_id
        self._digest = DigestManager(metadata.ledger_id, metadata.digest, password)
        self._key = ctx.master_key(password)
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

    # -- reads -------------------------------------------------------------
    def _replicas(self, entry_id: int) -> list[str]:
        """The bookies of entry_id's write set, penalized ones last."""
        md = self.metadata
        ensemble = md.ensemble_for(entry_id)
        return self._ctx.health.order([ensemble[i] for i in write_set(entry_id, md.ensemble_size, md.write_quorum)])

    def _read_entry(self, entry_id: int, *, flags: int = 0) -> asyncio.Future[ReadResult]:
        """One entry from its write set: penalized replicas last, speculative retries."""
        return _EntryRead(self, entry_id, flags, self._replicas(entry_id)).fut

    async def read(self, first: int, last: int) -> list[LedgerEntry]:
        """Entries first..last inclusive (pipelined, read_window in flight).

        Past the LAC of an open ledger, or past the end of a closed one: NoSuchEntryError.
        """
        if first < 0 or last < first:
            raise InvalidArgumentError(f"invalid range {first}..{last}")
        lac = self.last_add_confirmed
        if last > lac:
            raise NoSuchEntryError(f"entry {last} is past the last add confirmed ({lac}) of ledger "
                                   f"{self.ledger_id}")
        await self._ctx.bookies_for(self.metadata.ensembles.values())
        window = self._ctx.config.read_window
        out: list[LedgerEntry] = []
        for start in range(first, last + 1, window):
            stop = min(last, start + window - 1)
            futs = [self._read_entry(e) for e in range(start, stop + 1)]
            try:
                results = await asyncio.gather(*futs)
            except BaseException:
                for f in futs:
                    if f.done() and not f.cancelled():
                        f.exception()  # consumed: one failure is reported, not a log line per entry
                raise
            out.extend(LedgerEntry(e, r[0], self.ledger_id, r[2]) for e, r in zip(range(start, stop + 1), results))
        return out

    async def read_last_add_confirmed(self) -> int:
        """Ask the last ensemble for the LAC (may lag the writer by one entry); never goes back."""
        if self.metadata.is_closed:
            return self._lac
        ensemble = self.metadata.last_ensemble
        timeout = self._ctx.config.read_timeout_s
        results = await asyncio.gather(
            *(self._ctx.pool.call(b, Op.READ_LAC, 0, self.ledger_id, -1, self._key, timeout_s=timeout)
              for b in ensemble), return_exceptions=True)
        lacs = [r[5] for r in results if isinstance(r, tuple)]
        if not lacs:
            if all(isinstance(r, NoSuchLedgerError) for r in results):
                return self._lac
            raise next(r for r in results if isinstance(r, BaseException))
        self._lac = max(self._lac, max(lacs))
        return self._lac

    # -- tailing -----------------------------------------------------------
    async def tail(self, start: int = 0) -> AsyncIterator[LedgerEntry]:
        """Entries from start on as they are acknowledged, until the ledger is closed
        (NoSuchLedgerError if it is deleted meanwhile; every other error is retried).

        At the head, a long-poll read waits on the first replica of the next entry until
        its LAC covers the entry (no busy polling), joined by every other bookie of the
        entry's ensemble after speculative_read_timeout_ms; a ZooKeeper watch on the
        ledger's metadata ends the wait as soon as the metadata changes (a close, a new
        segment, a recovery). Neither waits for a long poll to expire.
        """
        head = _TailHead(self)
        nxt = start
        pause_s = 0.0
        while True:
            if pause_s:
                await asyncio.sleep(pause_s)  # a failure above: back off, never spin
            try:
                if nxt <= self.last_add_confirmed:
                    last = min(self.last_add_confirmed, nxt + self._ctx.config.read_window - 1)
                    entries = await self.read(nxt, last)
                    pause_s = 0.0
                    for entry in entries:
                        yield entry
                    nxt = last + 1
                    continue
                if self.metadata.is_closed:
                    return
                data = await self._wait_at_head(nxt, head)
            except BKError as e:
                # A segment the writer added since (ensemble change) or a bookie or ZooKeeper
                # hiccup: refresh what we know and try again.
                log.debug("tail of ledger %d at entry %d: %s; retrying", self.ledger_id, nxt, e)
                pause_s = min(1.0, pause_s * 2 or 0.05)
                try:
                    await self._refresh()
                except NoSuchLedgerError:  # its metadata is gone: deleted, nothing more will come
                    raise NoSuchLedgerError(f"ledger {self.ledger_id} was deleted while being tailed "
                                            f"(at entry {nxt})") from e
                except BKError:
                    pass
                continue
            pause_s = 0.0
            if data is not None:
                yield LedgerEntry(nxt, data, self.ledger_id)
                nxt += 1

    async def _wait_at_head(self, entry_id: int, head: _TailHead) -> bytes | None:
        """Wait until entry_id is acknowledged or the metadata changes: the entry's bytes if a
        long poll brought them, else None once the handle's LAC or metadata moved (or a poll
        round expired with nothing new). Raises the last error if every bookie failed."""
        if await head.arm():  # the metadata changed since this handle read it
            await self._refresh()
            return None
        replicas = self._replicas(entry_id)
        others = [b for b in self.metadata.ensemble_for(entry_id) if b not in replicas]
        wait = _HeadWait(head, entry_id, replicas[0], replicas[1:] + others)
        head.waiting = wait
        try:
            outcome, data, lac = await wait.fut
        finally:
            head.waiting = None
        if outcome is None:  # the watch fired: read the metadata again (arm() does, next round)
            return None
        self._lac = max(self._lac, lac)
        if outcome is not PollAnswer.UNHELD:
            head.unheld_s = 0.0
        if outcome is PollAnswer.ENTRY:
            self._lac = max(self._lac, entry_id)
            return data
        if outcome is PollAnswer.UNHELD:  # a new ledger no add has reached yet: pause, ask again
            await head.pause()
        elif outcome is PollAnswer.EXPIRED:  # idle: what a missed watch event would hide shows here
            await self._refresh()
        elif outcome is PollAnswer.FAILED:
            raise wait.error or BookieUnavailableError(f"every long poll of {self.ledger_id}:{entry_id} failed")
        return None

    async def _refresh(self) -> None:
        """Re-read the metadata (closed? new segments?) and, while open, the LAC."""
        md = await self._ctx.ledger_metadata(self.ledger_id)
        self.metadata = md
        if md.is_closed:
            self._lac = md.last_entry_id
            self._length = md.length
        else:
            await self.read_last_add_confirmed()

    async def close(self) -> None:
        """Nothing to release for a read handle."""


class _RecoveryReader(ReadHandle):
    """Recovery's reads on the fenced writer's view (recover() only: they fence, so they are
    steps of a recovery that has claimed the ledger IN_RECOVERY, not a way to stop a writer;
    core/recovery.py decides what the answers mean)."""

    __slots__ = ()

    async def fence(self) -> tuple[int, int]:
        """Fence the last ensemble (READ_LAC with FENCE) until no write set has Qa unfenced
        bookies: where recovery starts, the highest LAC the fenced bookies know (which this
        handle then knows too) and the ledger's length after it (RecoveryError if too few
        fences land). A hung bookie is not waited for once the answers in hand settle it."""
        vote = FenceVote(self.metadata)

        def answered(idx: int, resp: tuple[Any, ...] | None, err: BKError | None) -> bool:
            return vote.answer(idx, None if err is not None else resp[5], err)  # type: ignore[index]
        await self._ask(vote.bookies, Op.READ_LAC, vote.flags, -1, answered)
        lac = vote.outcome()
        self._lac = max(self._lac, lac)
        return lac, (await self._read_entry(lac))[2] if lac >= 0 else 0

    async def recovery_read(self, entry_id: int) -> bytes | None:
        """entry_id read from its write set with FENCE: its data if a replica has a valid copy,
        None if enough replicas deny it that it was never acknowledged (RecoveryError if the
        answers settle neither)."""
        vote = EntryVote(self.metadata, entry_id)

        def answered(_idx: int, resp: tuple[Any, ...] | None, err: BKError | None) -> bool:
            if err is not None:
                return vote.answer(None, err)
            try:
                data = self._digest.verify(resp[6], entry_id)[0]  # type: ignore[index]
            except DigestMismatchError as e:
                return vote.answer(None, e)
            return vote.answer(data)
        await self._ask(vote.bookies, Op.READ_ENTRY, vote.flags, entry_id, answered)
        return vote.outcome()

    async def _ask(self, bookies: list[str], op: int, flags: int, entry_id: int,
                   answered: Callable[[int, tuple[Any, ...] | None, BKError | None], bool]) -> None:
        """Send op to every bookie at once and feed each answer as it comes to
        answered(index, response, error) (its vote) until it says they settle the question, or
        every bookie has answered.

        Why not wait for them all: a hung bookie must not hold recovery back once the answers
        in hand settle it. Why callbacks (the pool's, as adds use): a task per request and an
        asyncio.wait per wake-up were the largest part of a recovery's client CPU with 64
        recoveries in flight. The order answers are fed in is the order they arrive."""
        decided: asyncio.Future[None] = self._loop.create_future()
        left = len(bookies)

        def on_answer(idx: int, resp: tuple[Any, ...] | None, err: BKError | None) -> None:
            nonlocal left
            left -= 1
            if decided.done():
                return
            try:
                if answered(idx, resp, err) or not left:
                    decided.set_result(None)
            except BaseException as e:  # noqa: BLE001 - a broken vote fails the recovery, not the pipe
                decided.set_exception(e)
        timeout = self._ctx.config.read_timeout_s
        for idx, bookie in enumerate(bookies):
            self._ctx.pool.send(bookie, op, flags, self.ledger_id, entry_id, self._key, 0, b"", on_answer, idx,
                                timeout)
        if bookies:
            await decided


class WriteHandle(ReadHandle):
    """The single writer of a ledger: pipelined, in-order, quorum-acknowledged adds.

    The decisions (what a failed add means, each ensemble change step, a close after a
    conflict, the explicit LAC) are WriterCore's (bookkeeper/client/core/writer.py); this
    shell sends frames, keeps futures, and calls ZooKeeper. Its explicit LAC is the client's
    LAC wheel's to send (bookkeeper/client/lac_wheel.py).

    What an open handle holds (issue 26: <= 2 KB with its metadata, over 10^4 handles): its
    tracker (a ring of 4 entries to start), its core, its sink, and a Segment shared with
    every handle of the same ensemble and shards. No reference cycle: its sink holds it by a
    weak reference, so a dropped handle is freed at once, frozen (gc.freeze) or not."""

    __slots__ = ("_tracker", "_core", "_sink", "_recovery", "_lac_floor", "_add_flags", "_frame_overhead",
                 "_changing", "_segment", "_segment_md", "_kind", "_mac_key", "__weakref__")

    def __init__(self, ctx: LedgerContext, metadata: LedgerMetadata, password: bytes, *,
                 recovery: bool = False, lac: int = -1, length: int = 0) -> None:
        """recovery=True: the handle a recovery rewrites with (RECOVERY_ADD, metadata IN_RECOVERY),
        continuing after entry `lac` of a ledger of `length` bytes."""
        # The tracker and the core first: ReadHandle.__init__ sets self.metadata, the core's.
        # A recovery's rewrites are not recorded: they are the fenced writer's entries again.
        self._tracker = AddTracker(ensemble_size=metadata.ensemble_size, write_quorum=metadata.write_quorum,
                                   ack_quorum=metadata.ack_quorum, lac=lac, length=length,
                                   latency=None if recovery else ctx.add_latency,
                                   clock=None if ctx.clock is system_monotonic else ctx.clock)
        self._core = WriterCore(metadata, self._tracker, recovery=recovery)
        super().__init__(ctx, metadata, password, lac)
        self._recovery = recovery
        self._lac_floor = lac
        self._add_flags = Flag.RECOVERY_ADD if recovery else 0
        self._frame_overhead = REQUEST_HEADER_BYTES + HEADER_BYTES + self._digest.size
        # The digest's kind and key, read by every add: kept here, one object fewer to touch an
        # add (with 10^4 handles, each add's objects are out of the CPU's caches).
        self._kind, self._mac_key = self._digest.kind, self._digest.mac_key
        self._changing: asyncio.Task[None] | None = None
        self._segment: Segment | None = None  # where new entries go, routed from _segment_md
        self._segment_md: LedgerMetadata | None = None
        # One callback for every add sent: the pipes count its OK responses in C (AckSink), which
        # also wakes a waiter for room and joins the LAC wheel's queue when the LAC moves.
        explicit = not recovery and ctx.config.explicit_lac_interval_ms > 0
        self._sink = AckSink(self._tracker, None, WriteHandle._on_add_response, owner=weakref.ref(self),
                             core=self._core, lacs=ctx.lac_wheel.queue if explicit else None)

    @property
    def metadata(self) -> LedgerMetadata:
        """The ledger's metadata as this writer last wrote or read it (the core's)."""
        return self._core.metadata

    @metadata.setter
    def metadata(self, md: LedgerMetadata) -> None:
        self._core.metadata = md

    @property
    def last_add_confirmed(self) -> int:
        lac: int = self._tracker.lac
        return lac

    @property
    def length(self) -> int:
        length: int = self._tracker.length
        return length

    @property
    def outstanding(self) -> int:
        outstanding: int = self._tracker.outstanding
        return outstanding

    # -- adds --------------------------------------------------------------
    def add_entry_async(self, data: bytes) -> asyncio.Future[int]:
        """Send an entry now; the future resolves to its id once acknowledged (in id order).

        Raises TooManyOutstandingAddsError at the max_outstanding_adds bound: use
        `await add_entry(...)`, which waits for room, to be paced instead.
        """
        self._check_room(1)
        fut: asyncio.Future[int] = self._loop.create_future()
        self._send_entries([self._checked(data)], fut)
        return fut

    def add_entries_async(self, datas: Sequence[bytes]) -> asyncio.Future[list[int]]:
        """Send a batch of entries now, with consecutive ids; one future for the batch.

        It resolves to the ids, in order, once the last is acknowledged (acks are in id order,
        so all are). If the handle fails meanwhile, it fails with the handle's error, whose
        `acknowledged` attribute lists the ids of the batch acknowledged before the failure:
        a prefix, exactly the entries single adds would have seen succeed. Every entry is
        checked before any is sent, so a bad one sends nothing.
        """
        self._check_room(len(datas))
        items = [self._checked(d) for d in datas]
        out: asyncio.Future[list[int]] = self._loop.create_future()
        if not items:
            out.set_result([])
            return out
        first: int = self._tracker.next_id
        last_fut: asyncio.Future[int] = self._loop.create_future()
        self._send_entries(items, last_fut)

        def settle(f: asyncio.Future[int]) -> None:
            if out.done():
                return
            err = f.exception()
            if err is None:
                out.set_result(list(range(first, f.result() + 1)))
            else:
                err.acknowledged = list(range(first, min(self._tracker.lac, first + len(items) - 1) + 1))  # type: ignore[attr-defined]
                out.set_exception(err)
        last_fut.add_done_callback(settle)
        return out

    async def add_entries(self, datas: Sequence[bytes]) -> list[int]:
        """add_entries_async, waiting for room first (a batch larger than max_outstanding_adds
        is refused: split it)."""
        if len(datas) > self._ctx.config.max_outstanding_adds:
            raise TooManyOutstandingAddsError(f"a batch of {len(datas)} entries exceeds max_outstanding_adds "
                                              f"({self._ctx.config.max_outstanding_adds})")
        await self.wait_for_room(len(datas))
        return await self.add_entries_async(datas)

    def add_entry_callback(self, data: bytes, callback: Callable[[int, BKError | None], None]) -> None:
        """Send an entry; callback(entry_id, None) runs on the client loop once it is acknowledged
        (in id order), or callback(entry_id, error) if the handle fails first. For services that
        do not want a future per entry; an exception from the callback is logged, not raised."""
        self._check_room(1)
        self._send_entries([self._checked(data)], _AddCallback(callback, self._tracker.next_id))

    def _check_room(self, n: int) -> None:
        core = self._core
        if core.closing or core.metadata.state is not core.writable_state:
            raise LedgerClosedError(f"ledger {self.ledger_id} is closed")
        if core.error is not None:
            raise type(core.error)(str(core.error))
        if self._tracker.outstanding + n > self._ctx.config.max_outstanding_adds:
            raise TooManyOutstandingAddsError(f"ledger {self.ledger_id}: {self._tracker.outstanding} adds "
                                              f"outstanding, {n} more would pass max_outstanding_adds")

    def _checked(self, data: bytes) -> bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"entry data must be bytes, not {type(data).__name__}")
        if len(data) + self._frame_overhead > self._ctx.pool.max_frame_bytes:
            raise TooLargeError(f"entry of {len(data)} bytes does not fit the {self._ctx.pool.max_frame_bytes}-byte "
                                f"frame limit")
        return bytes(data)

    def _send_entries(self, items: list[bytes], last: Any) -> None:
        """Give the next ids to items and send each to its write set; last (a future, an
        _AddCallback or None) is settled with the last one. The common case (a writer, every
        slot routable) runs in one C loop (AddTracker.send_entries); else entry by entry."""
        segment = self._current_segment()
        if self._recovery or segment.pipes is None:
            for data in items[:-1]:
                self._send_entry(data, None)
            self._send_entry(items[-1], last)
            return
        tracker = self._tracker
        unconnected = tracker.send_entries(items, tracker.next_id, tracker.lac, self._kind, self._mac_key,
                                           self.ledger_id, self._key, self._add_flags, segment.ensemble, segment.pipes,
                                           self._sink, self._ctx.config.add_timeout_s, last)
        for idx in unconnected:
            segment.conns[idx].ensure_connecting()

    def _send_entry(self, data: bytes, fut: Any) -> None:
        """Give the next entry id to data and send it to its write set; fut (a future, an
        _AddCallback or None) is settled when it is acknowledged or the handle fails."""
        entry_id = self._tracker.next_id
        # A recovery rewrite piggybacks the LAC recovery started from, never its own progress:
        # a concurrent recovery may still close the ledger earlier, and tailers trust the LAC.
        piggyback = self._lac_floor if self._recovery else self._tracker.lac
        self._tracker.lac_told = piggyback
        payload = self._digest.encode(entry_id, piggyback, self._tracker.sent_length + len(data), data)
        segment = self._current_segment()
        ensemble = segment.ensemble
        timeout_s = self._ctx.config.add_timeout_s
        write_set = self._tracker.add(entry_id, len(data), fut, payload, ensemble)
        self._sink.pin()  # held while the add is outstanding, though the application drops the handle
        for idx in write_set:
            conn = segment.conns[idx]
            if conn is None:
                self._send_add(entry_id, idx, ensemble[idx], payload)  # unroutable: fails through the pool
            elif conn.pipe.send(Op.ADD_ENTRY, self._add_flags, self.ledger_id, entry_id, self._key, 0, payload,
                                self._sink, (entry_id, idx, ensemble[idx]), timeout_s):
                conn.ensure_connecting()

    def _current_segment(self) -> Segment:
        """The last segment's ensemble, each slot's shard connection and their pipes (the
        pool's Segment, shared with other handles), kept until the metadata or the pool's
        routes change.

        Every new entry belongs to the last segment: a writer's (a new segment starts at its
        LAC + 1), and a recovery's rewrites too (recovery starts no lower than the fenced
        writer's last segment: core/recovery.py, FenceVote.outcome).
        """
        md, segment = self._core.metadata, self._segment
        if md is not self._segment_md or segment is None or segment.epoch != self._ctx.pool.routes_epoch:
            segment = self._segment = self._ctx.pool.segment(md.ensembles[max(md.ensembles)], self.ledger_id)
            self._segment_md = md
        return segment

    async def add_entry(self, data: bytes) -> int:
        """Add one entry and wait for its acknowledgement; waits for room at the outstanding bound."""
        await self.wait_for_room()
        return await self.add_entry_async(data)

    async def wait_for_room(self, n: int = 1) -> None:
        """Until n more adds fit under max_outstanding_adds (or the handle failed): then, unless
        another caller takes the room first, add_entry_async/add_entries_async of n entries is
        not refused for room."""
        while self._tracker.outstanding + n > self._ctx.config.max_outstanding_adds and self._core.error is None:
            await asyncio.shield(self._room())

    def _room(self) -> asyncio.Future[None]:
        """A future the sink sets when entries are acknowledged next (or _fail sets)."""
        room: asyncio.Future[None] | None = self._sink.room
        if room is None or room.done():
            room = self._sink.room = self._loop.create_future()
        return room

    def _send_add(self, entry_id: int, idx: int, bookie: str, payload: bytes) -> None:
        self._tracker.mark_sent(entry_id, idx, bookie)
        self._ctx.pool.send(bookie, Op.ADD_ENTRY, self._add_flags, self.ledger_id, entry_id, self._key, 0, payload,
                           self._sink, (entry_id, idx, bookie), self._ctx.config.add_timeout_s)

    def _on_add_response(self, ctx: tuple[int, int, str], resp: tuple[Any, ...] | None, err: BKError) -> None:
        """A failed add (an error status, a timeout, a lost connection): its AckSink acknowledges
        OK responses itself."""
        entry_id, idx, bookie = ctx
        core = self._core
        new = bookie not in core.failed
        verdict, error = core.on_failure(entry_id, idx, bookie, err)
        if verdict is Verdict.REPLACE:
            self._replace_bookie(bookie, entry_id, err, new)
        elif verdict is Verdict.FAIL:
            assert error is not None
            self._fail(error)

    def _replace_bookie(self, bookie: str, entry_id: int, err: BKError, new: bool) -> None:
        """Count bookie failed (health, quarantine) and start an ensemble change unless one runs."""
        self._ctx.health.penalize(bookie)
        self._ctx.quarantine.penalize(bookie)
        if new:
            log.info("ledger %d: bookie %s failed on entry %d (%s): replacing it", self.ledger_id, bookie,
                     entry_id, err)
        if self._changing is None or self._changing.done():
            self._changing = self._loop.create_task(self._change_ensemble())
            self._changing.add_done_callback(self._change_done)

    # -- explicit LAC ------------------------------------------------------
    def send_lac(self, lac: int) -> None:
        """Tell the write set of entry `lac` that the entries up to it are acknowledged
        (WRITE_LAC, one request per bookie: docs/protocol.md). The client's LAC wheel calls
        this for a handle that sent no add since its LAC moved (bookkeeper/client/lac_wheel.py)."""
        md = self.metadata
        ensemble = md.ensemble_for(lac)
        timeout_s = self._ctx.config.add_timeout_s
        for idx in write_set(lac, md.ensemble_size, md.write_quorum):
            self._ctx.pool.send(ensemble[idx], Op.WRITE_LAC, 0, self.ledger_id, lac, self._key, 0, b"",
                                _lac_answered, (self.ledger_id, ensemble[idx]), timeout_s)
        self._ctx.stats["write_lacs"] += md.write_quorum

    async def _change_ensemble(self) -> None:
        """Move the unacknowledged entries off failed bookies (ensemble change): the core names
        each step (writer.WriterCore.next_change), this asks for replacements, writes the
        metadata and resends what the core says."""
        core = self._core
        backoff_s = CHANGE_BACKOFF_FIRST_S
        while core.error is None:
            change = core.next_change()
            if change is None:
                return
            try:
                ensemble = await self._ctx.replacement_ensemble(core.metadata, change.base, change.slots,
                                                                set(core.failed))
                proposal = core.proposal(change, ensemble)
                written = None if proposal is None else await self._ctx.write_metadata(proposal)
            except MetadataVersionError:
                fenced = core.on_conflict(await self._ctx.ledger_metadata(self.ledger_id))
                if fenced is not None:
                    self._fail(fenced)
                    return
                continue
            except NotEnoughBookiesError as e:
                self._fail(NotEnoughBookiesError(f"ledger {self.ledger_id}: no replacement bookie: {e}"))
                return
            except BKError as e:
                error = core.change_failed(e, backoff_s)
                if error is not None:
                    self._fail(error)
                    return
                await asyncio.sleep(backoff_s)  # ZooKeeper unreachable for a moment: try again
                backoff_s *= 2
                continue
            if written is not None:
                self._ctx.stats["ensemble_changes"] += 1
                log.info("ledger %d: ensemble changed from entry %d: %s -> %s", self.ledger_id, change.start,
                         change.base, ensemble)
            for resend in core.changed(written):
                self._send_add(resend.entry_id, resend.idx, resend.bookie, self._tracker.payload(resend.entry_id))

    def _change_done(self, task: asyncio.Task[None]) -> None:
        """Whatever escapes an ensemble change fails the handle: a writer never stalls silently."""
        if not task.cancelled() and task.exception() is not None:
            err = task.exception()
            self._fail(err if isinstance(err, BKError) else InternalError(f"ensemble change failed: {err!r}"))

    def _fail(self, err: BKError) -> None:
        """The handle is broken: every outstanding and future add fails with its first error
        (the LAC wheel drops it: its core no longer writes)."""
        dropped = self._core.fail(err)
        if not self._recovery:
            self._ctx.stats["add_errors"] += len(dropped)
        for _eid, fut in dropped:
            if fut is not None and not fut.done():
                fut.set_exception(type(err)(str(err)))
        self._sink.unpin()  # every add is settled: nothing left that needs the handle
        room = self._sink.room
        if room is not None and not room.done():
            room.set_result(None)

    async def drain(self) -> None:
        """Wait until every add sent is acknowledged and no ensemble change runs; raises the
        handle's error if it has failed (a recovery waits so for its rewrites)."""
        while self._tracker.outstanding and self._core.error is None:  # settled in order: the last ack ends it
            await asyncio.shield(self._room())
        if self._changing is not None:
            await asyncio.gather(self._changing, return_exceptions=True)
        if self._core.error is not None:
            raise self._core.error

    async def close(self) -> None:
        """Wait for outstanding adds, then close the metadata at the LAC (compare-and-set)."""
        if self.metadata.is_closed:
            return
        core = self._core
        core.closing = True  # no explicit LAC from here: the close itself tells tailers where the ledger ends
        try:
            await self.drain()
        except BKError:
            pass  # a failed handle still closes at the LAC it reached: those entries are acknowledged
        proposal = core.close_proposal()
        while True:
            try:
                core.metadata = await self._ctx.write_metadata(proposal)
                break
            except MetadataVersionError:
                fresh = await self._ctx.ledger_metadata(self.ledger_id)
                if core.on_close_conflict(fresh) is CloseStep.DONE:
                    break
                proposal = core.close_proposal(fresh)
        self._lac = self._tracker.lac
        self._length = self._tracker.length


class _AddCallback:
    """add_entry_callback's stand-in for a future in the add tracker (which calls done(),
    set_result(entry id) and set_exception(error) on whatever it holds per entry)."""

    __slots__ = ("fn", "entry_id", "called")

    def __init__(self, fn: Callable[[int, BKError | None], None], entry_id: int) -> None:
        self.fn = fn
        self.entry_id = entry_id
        self.called = False

    def done(self) -> bool:
        return self.called

    def set_result(self, entry_id: int) -> None:
        self._call(None)

    def set_exception(self, err: BaseException) -> None:
        self._call(err)  # type: ignore[arg-type]

    def _call(self, err: BKError | None) -> None:
        self.called = True
        try:
            self.fn(self.entry_id, err)
        except Exception:
            log.exception("add callback for entry %d failed", self.entry_id)


def _lac_answered(ctx: tuple[int, str], resp: tuple[Any, ...] | None, err: BKError | None) -> None:
    """An explicit LAC is advisory: a bookie that refuses it or is gone changes nothing for the
    writer (its adds find out for themselves); logged for the operator at debug level."""
    if err is not None:
        log.debug("ledger %d: explicit LAC not taken by %s: %s", ctx[0], ctx[1], err)


# -- recovery -------------------------------------------------------------------
async def recover(ctx: LedgerContext, md: LedgerMetadata, password: bytes) -> LedgerMetadata:
    """Fence an open ledger, recover its tail and close it; the closed metadata.

    The steps and why they are safe: bookkeeper/client/core/recovery.py (which decides each
    one) and docs/architecture.md, "Recovery". Concurrent recoveries converge: a conflict
    re-reads the metadata, and a closed ledger is final.
    """
    while md.state is not LedgerState.CLOSED:
        proposal = recovery_core.recovery_proposal(md)
        if proposal is not None:
            try:
                md = await ctx.write_metadata(proposal)
            except MetadataVersionError:
                md = await ctx.ledger_metadata(md.ledger_id)
                continue
        view = recovery_core.writer_view(md)
        reader = _RecoveryReader(ctx, view, password, -1)
        lac, length = await reader.fence()
        # The rewrites go through a recovery write handle: RECOVERY_ADD (accepted on fenced
        # bookies), a dead bookie replaced by an ensemble change as for any writer, the
        # metadata IN_RECOVERY meanwhile; it starts from the writer's view too.
        writer = WriteHandle(ctx, view, password, recovery=True, lac=lac, length=length)
        try:
            entry_id = lac + 1
            while (found := await reader.recovery_read(entry_id)) is not None:
                await writer.wait_for_room()
                writer.add_entry_async(found).add_done_callback(_consumed)
                entry_id += 1
            await writer.drain()  # raises the handle's error: a rewrite failed
            await writer.close()
            return writer.metadata
        except (MetadataVersionError, LedgerFencedError, LedgerClosedError):
            # Another recovery changed the metadata first: if it closed the ledger, its
            # result is the result (every reader agrees); otherwise go round again.
            md = await ctx.ledger_metadata(md.ledger_id)
    return md


def _consumed(fut: asyncio.Future[Any]) -> None:
    """A rewrite's own outcome: its failure is the handle's, raised by drain()."""
    if not fut.cancelled():
        fut.exception()
