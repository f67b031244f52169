"""A ledger writer's decisions (sans-I/O; the shell is WriteHandle in bookkeeper.client.ledger).

Events in: a failed add (an error status, a timeout, a lost connection: OK responses are
counted in C by the AddTracker), a metadata result (a new version, a conflict with the fresh
metadata, an error), a tick of the client's LAC wheel. Decisions out: ignore, fail the handle,
or replace a bookie; the next ensemble change (the start, the ensemble it changes, its failed
slots), the metadata it proposes, the entries to resend; what a close writes and whether a
conflict ends it; whether an explicit LAC is due, and how many a tick may send. No loop,
socket, clock, sleep or future made here: the shell does each thing a decision names and
feeds the result back.

Why a core: these rules keep acknowledged entries safe, and each defect found in them was
found late under real processes and timing luck (a hung bookie kept after a late failure, a
once-failed bookie never taken back). As plain calls they are scripted event by event
(tests/data/writer/*.txt, tests/test_core_scripts.py) and driven by the simulator.
"""
from __future__ import annotations

import enum
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from bookkeeper._ext.client import LAC_NOTHING, LAC_REARM, LAC_SEND, lac_step_code
from bookkeeper.client.core.quorum import write_set
from bookkeeper.errors import BKError, LedgerFencedError
from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState

CHANGE_BACKOFF_FIRST_S = 0.05
CHANGE_BACKOFF_MAX_S = 5.0  # a retriable metadata error past this backoff fails the handle
# The explicit-LAC budget of one tick of a client's LAC wheel (explicit_lac_budget says why).
LAC_HANDLES_PER_TICK = 32   # handles told per tick whatever the load: ~3,200 a second at 10 ms
ADDS_PER_EXPLICIT_LAC = 64  # ... and one more per this many entries acknowledged since the last tick


class Verdict(enum.Enum):
    """What a failed add means for the handle."""

    IGNORE = "ignore"    # settled already, or from a bookie replaced since (resent elsewhere)
    REPLACE = "replace"  # the bookie is failed: an ensemble change replaces it
    FAIL = "fail"        # the handle is broken (fenced, or an error no retry mends)


@dataclass(frozen=True, slots=True)
class Change:
    """One step of an ensemble change: from entry `start` on, `base` with `slots` replaced."""

    start: int
    base: list[str]
    slots: list[int]


@dataclass(frozen=True, slots=True)
class Resend:
    """An outstanding entry's slot whose bookie changed: send it again to `bookie`."""

    entry_id: int
    idx: int
    bookie: str


class CloseStep(enum.Enum):
    """What a close does after a conflict."""

    DONE = "done"    # another writer closed it at the same entry: the close is done
    RETRY = "retry"  # the metadata moved (an ensemble change landed): write the close again


class LacStep(enum.Enum):
    """What the client's LAC wheel does with a handle whose LAC moved, at its visit."""

    NOTHING = "nothing"  # the bookies know the LAC, or the handle no longer writes
    REARM = "rearm"      # adds were sent since: the next one piggybacks the LAC
    SEND = "send"        # idle: send WRITE_LAC to the last acknowledged entry's write set


class WriterCore:
    """The state a writer's decisions need, and the decisions.

    `tracker` is the AddTracker (Cython, the add hot path: outstanding entries, their acks,
    the LAC, and the bookies being replaced, whose OK responses its AckSink ignores in C).
    `recovery`: a recovery's rewrites (the metadata IN_RECOVERY is the state it writes in).
    """

    __slots__ = ("metadata", "tracker", "error", "closing", "writable_state")

    def __init__(self, metadata: LedgerMetadata, tracker: Any, *, recovery: bool = False) -> None:
        self.metadata = metadata
        self.tracker = tracker
        self.error: BKError | None = None
        self.closing = False
        self.writable_state = LedgerState.IN_RECOVERY if recovery else LedgerState.OPEN

    @property
    def failed(self) -> Set[str]:
        """The bookies being replaced: the tracker's, an empty frozenset while there are none
        (an empty set per handle was a tenth of what an open handle costs)."""
        failed: Set[str] = self.tracker.failed_bookies
        return failed

    def _mark_failed(self, bookie: str) -> None:
        failed = self.tracker.failed_bookies
        if not isinstance(failed, set):
            failed = self.tracker.failed_bookies = set()
        failed.add(bookie)

    @property
    def writing(self) -> bool:
        """The handle still sends adds: not failed, not closing, its ledger in the state it
        writes in (OPEN, or IN_RECOVERY for a recovery's rewrites)."""
        return self.error is None and not self.closing and self.metadata.state is self.writable_state

    # -- failed adds ---------------------------------------------------------
    def on_failure(self, entry_id: int, idx: int, bookie: str, err: BKError) -> tuple[Verdict, BKError | None]:
        """A failed add of entry_id at ensemble slot idx, sent to bookie. REPLACE adds bookie to
        the failed set; FAIL comes with the handle's error (the shell calls fail() with it)."""
        ledger_id = self.metadata.ledger_id
        if not self.tracker.is_current(entry_id, idx, bookie):
            if err.retriable and self.still_writing_to(entry_id, bookie):
                self._mark_failed(bookie)
                return Verdict.REPLACE, None
            return Verdict.IGNORE, None
        if isinstance(err, LedgerFencedError):
            return Verdict.FAIL, LedgerFencedError(f"ledger {ledger_id} was fenced: a recovery open took it over")
        if err.retriable:
            self.tracker.fail(entry_id, idx)
            self._mark_failed(bookie)
            return Verdict.REPLACE, None
        return Verdict.FAIL, type(err)(f"add of entry {entry_id} to ledger {ledger_id} failed: {err}")

    def still_writing_to(self, entry_id: int, bookie: str) -> bool:
        """Whether a failure of an entry acknowledged without this bookie (Qa < Qw) must still
        replace it: the bookie has been in every segment from the failed entry's to the last,
        so new entries still go to it. An ensemble change that replaced another bookie keeps
        it (the simulator, seed 9 at 18ac14b: a failure of an entry of the segment before such
        a change was ignored, and a hung bookie stayed for another whole add timeout); a
        segment without it in between means it was replaced and taken back later, and the
        failure is of the old stay.

        Why: Apache BookKeeper replaces a bookie at its first failed write, acknowledged or not.
        Ignoring it leaves a dead or hung bookie in the ensemble, every later entry with Qw - 1
        copies, and its replacement for the day a second bookie fails too, when one spare is
        no longer enough for both.
        """
        if not self.writing:
            return False
        segments = self.metadata.ensembles
        firsts = sorted(segments)
        since = max((f for f in firsts if f <= entry_id), default=firsts[0])
        return all(bookie in segments[f] for f in firsts if f >= since)

    # -- ensemble change -----------------------------------------------------
    def next_change(self) -> Change | None:
        """The next step of an ensemble change, or None when no failed bookie is left where
        new or outstanding entries go (the failed set is then forgotten: the client's
        quarantine still keeps them out of new placements for a while, and a handle that
        lives through many restarts does not run out of bookies).

        The new segment starts at LAC + 1 and replaces, from there on, whatever segments the
        metadata had: every entry from there is unacknowledged. Its ensemble is the one of
        the segment holding LAC + 1 with the failed bookies' slots replaced.
        """
        tracker = self.tracker
        start = tracker.lac + 1
        base = self.metadata.ensemble_for(start)
        failed = self.failed
        pending = [(e, tracker.sent_to(e)) for e in tracker.pending_ids()]
        if failed.isdisjoint(base) and not any(b in failed for _e, sent in pending for b in sent):
            tracker.failed_bookies = frozenset()
            return None
        self.forget_failed_copies(pending)
        return Change(start, base, [i for i, b in enumerate(base) if b in failed])

    def forget_failed_copies(self, pending: list[tuple[int, list[str | None]]]) -> None:
        """An OK a failed bookie gave an outstanding entry (pending: each with where it was
        sent) before it failed no longer counts (Apache's removeBookieAndCheck): the change's
        segment does not name that bookie, and the entry is resent to its replacement. Kept,
        it could make the entry acknowledged while the change's metadata write is in flight;
        nothing would resend it then, and the metadata would name fewer than Qa of its copies
        (the simulator, seed 37 of session 19's workload: one copy left, lost with its disk)."""
        for eid, sent in pending:
            for idx, bookie in enumerate(sent):
                if bookie in self.failed:
                    self.tracker.reset(eid, idx)

    def proposal(self, change: Change, ensemble: list[str]) -> LedgerMetadata | None:
        """The metadata that puts `ensemble` in from change.start (None: it is there already,
        as when a write whose reply was lost is retried)."""
        md = self.metadata
        segments = {k: v for k, v in md.ensembles.items() if k < change.start}
        segments[change.start] = ensemble
        return None if segments == md.ensembles else md.replace(ensembles=segments)

    def changed(self, metadata: LedgerMetadata | None = None) -> list[Resend]:
        """The change is in the metadata (`metadata`: the version written; None: it was there
        already): each outstanding entry goes again to every slot whose bookie now differs
        from the one it was sent to, its old answer forgotten. Comparing with where each was
        sent, not with the old ensemble, resends after a retried write too."""
        if metadata is not None:
            self.metadata = metadata
        md = self.metadata
        out: list[Resend] = []
        for eid in self.tracker.pending_ids():
            sent = self.tracker.sent_to(eid)
            if not sent:
                continue  # acknowledged meanwhile
            ensemble = md.ensemble_for(eid)
            for idx in write_set(eid, md.ensemble_size, md.write_quorum):
                if sent[idx] != ensemble[idx]:
                    self.tracker.reset(eid, idx)
                    out.append(Resend(eid, idx, ensemble[idx]))
        return out

    def on_conflict(self, fresh: LedgerMetadata) -> BKError | None:
        """A compare-and-set lost to another writer of the metadata: the fresh version is read.
        A recovery that took the ledger over fails the handle (the error returned); anything
        else (an auto-recovery's re-replication) is the base of the next try.

        A recovery's own handle never builds on a fresh version: another recovery (concurrent,
        or an interrupted one whose write landed late) may have put its segments there, and a
        recovery trusts only the writer's (recovery.writer_view). Taking them on would map
        entries it already rewrote, and the fenced ones before them, to bookies that never
        had them. It fails with LedgerFencedError instead, and recover() starts over from the
        writer's view on the new version (found in review of the sans-I/O core: the scripts
        made the sequence a few commands)."""
        if fresh.state is not self.writable_state:
            return LedgerFencedError(f"ledger {fresh.ledger_id} was fenced during an ensemble change: a "
                                     f"recovery open took it over")
        if self.writable_state is LedgerState.IN_RECOVERY:
            return LedgerFencedError(f"ledger {fresh.ledger_id}: another recovery changed its metadata during "
                                     f"this recovery's ensemble change")
        self.metadata = fresh
        return None

    def change_failed(self, err: BKError, backoff_s: float) -> BKError | None:
        """An ensemble change step failed with err after backing off backoff_s so far: None to
        try again after backoff_s (ZooKeeper unreachable for a moment), else the handle's error."""
        if err.retriable and backoff_s <= CHANGE_BACKOFF_MAX_S:
            return None
        return type(err)(f"ledger {self.metadata.ledger_id}: ensemble change failed: {err}")

    def fail(self, err: BKError) -> list[tuple[int, Any]]:
        """The handle is broken: the first error stays its error; every outstanding entry is
        dropped and returned (entry id, what settles it) for the shell to fail."""
        if self.error is None:
            self.error = err
        dropped: list[tuple[int, Any]] = self.tracker.drop_all()
        return dropped

    # -- close ---------------------------------------------------------------
    def close_proposal(self, md: LedgerMetadata | None = None) -> LedgerMetadata:
        """The metadata that closes the ledger at the LAC (on `md`, default the handle's)."""
        return (md or self.metadata).replace(state=LedgerState.CLOSED, last_entry_id=self.tracker.lac,
                                              length=self.tracker.length)

    def on_close_conflict(self, fresh: LedgerMetadata) -> CloseStep:
        """The close's compare-and-set lost; fresh is the metadata now. Closed at the same entry
        by someone else: done. Closed elsewhere or being recovered: LedgerFencedError (the
        writer's view of the ledger's end is not the ledger's). Else write the close again."""
        lac = self.tracker.lac
        if fresh.is_closed:
            self.metadata = fresh  # the ledger's end, whoever wrote it: the handle is closed
            if fresh.last_entry_id != lac:
                raise LedgerFencedError(f"ledger {fresh.ledger_id} was recovered by another client and closed "
                                        f"at entry {fresh.last_entry_id}, not {lac}")
            return CloseStep.DONE
        if fresh.state is LedgerState.IN_RECOVERY:
            raise LedgerFencedError(f"ledger {fresh.ledger_id} is being recovered by another client")
        return CloseStep.RETRY


_LAC_STEPS = {LAC_NOTHING: LacStep.NOTHING, LAC_REARM: LacStep.REARM, LAC_SEND: LacStep.SEND}


def lac_step(*, writing: bool, lac: int, lac_told: int, adds_sent: int, adds_at_arm: int) -> LacStep:
    """A handle whose LAC moved is visited by the client's LAC wheel, one to two ticks
    (explicit_lac_interval_ms each) after it joined (adds_at_arm: the adds sent by then).

    Why: a bookie learns the LAC only from the next add, which piggybacks it; a writer that
    pauses would leave its last entries invisible to tailers until it writes again or
    closes. While adds flow the piggyback does the job and the handle only joins again.
    (Apache BookKeeper's WRITE_LAC / explicitLacInterval.)

    The rule runs in C (client.pyx, lac_step_code: the LacQueue applies it to every handle
    it visits, a visit per add when handles are written less often than the interval);
    this is its face for the shell's readers and the writer scripts.
    """
    return _LAC_STEPS[lac_step_code(writing, lac, lac_told, adds_sent, adds_at_arm)]


def explicit_lac_budget(acked: int) -> int:
    """How many handles one tick of the LAC wheel may send WRITE_LAC for, `acked` entries
    having been acknowledged on the client's handles since the last tick.

    Why a budget: WRITE_LAC names one ledger (docs/protocol.md), so nothing coalesces them,
    and a handle written less often than the interval would cost Qw of them per add: over
    10^4 such handles, as many WRITE_LAC requests and answers as add requests and answers.
    The budget is LAC_HANDLES_PER_TICK whatever the load (a few paused writers are told
    within the interval, as before), plus one per ADDS_PER_EXPLICIT_LAC entries acknowledged
    (at most Qw/64 WRITE_LACs per add on top). Handles past it wait their turn in order; an
    add meanwhile piggybacks the LAC, and the handle is dropped when visited.

    | acked since the last tick | budget (handles) |
    |---------------------------|------------------|
    | 0                         | 32               |
    | 63                        | 32               |
    | 64                        | 33               |
    | 640                       | 42               |
    """
    return LAC_HANDLES_PER_TICK + acked // ADDS_PER_EXPLICIT_LAC


__all__ = ["ADDS_PER_EXPLICIT_LAC", "CHANGE_BACKOFF_FIRST_S", "LAC_HANDLES_PER_TICK", "Change", "CloseStep", "LacStep",
           "Resend", "Verdict", "WriterCore", "explicit_lac_budget", "lac_step"]
