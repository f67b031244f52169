"""Auto-recovery decisions as pure functions and small clocked classes: no I/O, time passed in.

- `AbsenceClock`: when an absent bookie becomes lost (gone for lost_bookie_delay_s; a return
  before that cancels it, at no cost).
- `plan_ledger`: what a worker does next to one ledger (copy a fragment, fence and recover
  it, wait for its writer, or nothing).
- `slot_entries`: which entries of a segment one ensemble slot holds (striping).
- `TokenBucket`: the auditor's bound on ZooKeeper reads and writes per second.

Reference: Apache BookKeeper Auditor (lostBookieRecoveryDelay), ReplicationWorker
(openLedgerRereplicationGracePeriod), RoundRobinDistributionSchedule.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState


class AbsenceClock:
    """Which known bookies are absent, since when, and which of them are lost.

    A bookie is known when it holds a cookie (it started once and was not decommissioned);
    it is absent when it has no registration, writable or read-only. Its clock starts the
    first time it is seen absent (for a bookie already gone when the auditor started: then),
    and stops, forgotten, the moment it is registered again or loses its cookie. Once absent
    for delay_s it is due; the caller scans for its ledgers and hands it over (`handed`), and
    it is not due again unless it returns and goes again.
    """

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._since: dict[str, float] = {}
        self._lost: set[str] = set()
        self.cancelled = 0  # absences that ended before the delay: no work was done for them

    def observe(self, now: float, *, known: set[str], registered: set[str]) -> None:
        for bookie in known - registered:
            self._since.setdefault(bookie, now)
        for bookie in [b for b in self._since if b in registered or b not in known]:
            since = self._since.pop(bookie)
            if bookie not in self._lost and now - since < self.delay_s:
                self.cancelled += 1
            self._lost.discard(bookie)

    def due(self, now: float) -> set[str]:
        """Absent for at least the delay and not yet handed over."""
        return {b for b, since in self._since.items() if b not in self._lost and now - since >= self.delay_s}

    def handed(self, bookies: set[str]) -> None:
        """Their ledgers were scanned and marked: not due again during this absence."""
        self._lost |= bookies & set(self._since)

    def pending(self, now: float) -> dict[str, float]:
        """Absent bookies not yet lost -> seconds until they are."""
        return {b: max(0.0, self.delay_s - (now - since)) for b, since in self._since.items() if b not in self._lost}

    def next_due_in(self, now: float) -> float | None:
        """Seconds until the next absent bookie becomes due (None: none is waiting)."""
        waits = self.pending(now).values()
        return min(waits) if waits else None

    @property
    def lost(self) -> set[str]:
        return set(self._lost)


def ledger_bookies(md: LedgerMetadata) -> set[str]:
    """Every bookie the metadata names: its segments and, during recovery, the writer's."""
    out = {b for ens in md.ensembles.values() for b in ens}
    if md.writer_ensembles:
        out |= {b for ens in md.writer_ensembles.values() for b in ens}
    return out


@dataclass(frozen=True, slots=True)
class Fragment:
    """One segment's entries held by bookies to be replaced (Apache's LedgerFragment)."""

    first_entry_id: int
    last_entry_id: int            # inclusive; below first_entry_id: the segment holds no entry
    ensemble: tuple[str, ...]
    slots: tuple[int, ...]        # ensemble positions to replace


@dataclass(frozen=True, slots=True)
class LedgerPlan:
    """What to do next to one ledger; a worker acts on one step, then reads and plans again."""

    copy: tuple[Fragment, ...] = ()   # fragments to copy now
    recover: bool = False             # fence and close the ledger first (its writer is gone or fenced)
    wait: bool = False                # its open last segment is left to the writer (grace)
    drop_writer_ensembles: bool = False  # closed: only the recovery-time copy still names the bookie

    @property
    def done(self) -> bool:
        return not (self.copy or self.recover or self.wait or self.drop_writer_ensembles)


def segment_last_entry(md: LedgerMetadata, first: int) -> int | None:
    """The last entry of the segment starting at `first`: fixed for every segment but the last
    of a ledger not yet closed (None: it still grows)."""
    later = [k for k in md.ensembles if k > first]
    if later:
        return min(later) - 1
    return md.last_entry_id if md.is_closed else None


def plan_ledger(md: LedgerMetadata, bookies: set[str], *, grace_over: bool) -> LedgerPlan:
    """Decision table (docs/autorecovery.md, "Replication"):

    | state        | segment with a bookie to replace  | step                                  |
    |--------------|-----------------------------------|---------------------------------------|
    | CLOSED       | any                               | copy it                               |
    | OPEN         | not the last                      | copy it (its entries are all acked)   |
    | OPEN         | the last, grace not over          | wait (the writer changes ensemble)    |
    | OPEN         | the last, grace over              | recover (fence + close), plan again   |
    | IN_RECOVERY  | any                               | recover (the writer is fenced already) |
    | CLOSED       | none, writer_ensembles name one   | drop writer_ensembles                 |
    | any          | none                              | done                                  |
    Copies come before waiting: an open ledger's earlier segments need no grace.
    """
    last_first = max(md.ensembles)
    hit = {first: tuple(i for i, b in enumerate(ens) if b in bookies) for first, ens in md.ensembles.items()}
    hit = {first: slots for first, slots in hit.items() if slots}
    if md.state is LedgerState.IN_RECOVERY:
        named = bool(hit) or bool(md.writer_ensembles and bookies & ledger_bookies(md))
        return LedgerPlan(recover=named)
    copy = []
    for first in sorted(hit):
        end = segment_last_entry(md, first)
        if end is None:
            continue  # the open last segment: below
        copy.append(Fragment(first, end, tuple(md.ensembles[first]), hit[first]))
    open_last = md.state is LedgerState.OPEN and last_first in hit
    if copy:
        return LedgerPlan(copy=tuple(copy), wait=open_last and not grace_over)
    if open_last:
        return LedgerPlan(recover=True) if grace_over else LedgerPlan(wait=True)
    stale = bool(md.writer_ensembles) and bool(bookies & ledger_bookies(md))
    return LedgerPlan(drop_writer_ensembles=md.is_closed and stale)


def slot_entries(first: int, last: int, slot: int, *, ensemble_size: int, write_quorum: int) -> Iterator[int]:
    """Entries first..last (inclusive) whose write set includes ensemble position `slot`:
    e is stored at positions (e + i) % E for i < Qw, so slot holds e iff (slot - e) % E < Qw."""
    for e in range(first, last + 1):
        if (slot - e) % ensemble_size < write_quorum:
            yield e


class TokenBucket:
    """At most `rate_per_s` operations per second on average, bursts of `burst` (time passed in)."""

    def __init__(self, rate_per_s: float, burst: float, *, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = burst
        self._at = now

    def take(self, now: float, n: float = 1.0) -> float:
        """Take n tokens; returns 0.0 if they were there, else the seconds to wait before they
        are (they are then owed: the caller sleeps that long and goes ahead)."""
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_per_s
