"""What the simulator knows that no node does, and the invariants it checks with it.

The oracle reads every frame a bookie receives and every frame it answers (taps on the
bookie's end of each simulated connection, parsed by the production parsers), and what
the workload was told (acknowledged adds, closes, reads). From that, checked as each
event happens:

- `ack-quorum`: an add the writer saw acknowledged was answered OK by at least Qa bookies
  before the acknowledgement (AllAckedEntriesAreReadable needs it; the mutation
  "ack before Qa" breaks it);
- `lac-ahead`: a LAC a writer tells a bookie (piggybacked on an add, or WRITE_LAC) never
  covers an entry fewer than Qa bookies answered OK (NoDirtyReads: tailers trust it);
- `fenced-add`: a bookie that answered a fencing read for a ledger never answers OK to a
  plain (non-recovery) add of it afterwards, across its restarts;
- `acked-after-close`: no add is acknowledged past the entry the ledger was closed at
  (Apache BookKeeper's #2614);
- `closed-diverged`: every close of a ledger names the same last entry
  (NoDivergenceBetweenClientAndMetaData);
- `lost-on-restart`: a restarted bookie holds every entry it answered OK for;
- `dirty-read`: a read returns what the writer wrote for that entry, and a reader's LAC
  never passes what Qa bookies hold;
- `lost-entry`: at the end (faults healed), every ledger closes and every acknowledged
  entry up to its end reads back with the writer's bytes;
- `kept-failed-bookie`: a writer whose adds to a bookie go unanswered (its answers held)
  stops sending it new adds once that is past the add timeout and an ensemble change's
  time (the add timeout and half a second, or `KEEP_LIMIT_ZK_TROUBLE_S` when ZooKeeper was in trouble): it replaces the bookie or fails (Apache BookKeeper replaces
  a bookie at its first failed write, acknowledged elsewhere or not);
- `stuck`: once faults heal, a writer's add or a recovery finishes within the time
  allowed;
- `stream-order`: a stream reader sees each record once, txids rising; once faults heal the
  stream reads back with automatic txids without a gap;
- `stream-lost`: every record a stream writer saw acknowledged is in the stream, with its
  bytes, and every reader agrees on which record holds a txid.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from bookkeeper.client.core.quorum import write_set
from bookkeeper.meta.ledger_metadata import LedgerMetadata
from bookkeeper.proto import Flag, Op, Status, parse_requests, parse_responses

MAX_FRAME = 5 << 20
_FENCE, _RECOVERY_ADD = int(Flag.FENCE), int(Flag.RECOVERY_ADD)
_ADD, _READ, _READ_LAC, _WRITE_LAC = int(Op.ADD_ENTRY), int(Op.READ_ENTRY), int(Op.READ_LAC), int(Op.WRITE_LAC)
_OK, _NO_SUCH_ENTRY = int(Status.OK), int(Status.NO_SUCH_ENTRY)
# How long a writer may keep sending to a bookie whose answers stopped, when ZooKeeper was in
# trouble meanwhile (partitioned from the writer for up to 3 s, or losing requests): the add
# timeout, the ensemble change's retries and back-off (~6.4 s in all), with room to spare.
# Without ZooKeeper trouble the world allows the add timeout and half a second (the client's
# deadline sweep runs every 0.1 s; an ensemble change takes milliseconds, a few retries after
# ZooKeeper's background losses well under 0.4 s).
KEEP_LIMIT_ZK_TROUBLE_S = 12.0
# A writer that keeps a bookie sends it adds at its pace (milliseconds apart); a gap this long
# means it stopped (replaced the bookie) and took it back later, when no healthy one was left.
REJOIN_GAP_S = 0.25


class Violation(Exception):
    """An invariant does not hold: the seed that shows it is a bug (or a caught mutation)."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


@dataclass
class LedgerTruth:
    """One ledger as the simulator knows it."""

    ledger_id: int
    ack_quorum: int
    data: list[bytes] = field(default_factory=list)  # what the writer added, by entry id
    acked: int = -1  # the highest entry the writer saw acknowledged
    closed_at: int | None = None  # the last entry of its first close
    ok: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))  # entry -> bookies that said OK
    prefix: int = -1  # every entry up to here was answered OK by >= Qa bookies
    deleted: bool = False  # the workload deleted it (or tried: a lost reply hides the outcome)


class _Tap:
    """One bookie connection's frames: requests by id (their flags), responses matched to them."""

    __slots__ = ("bookie", "client", "rx", "tx", "requests", "answers", "clock", "limit", "unanswered", "hold")

    def __init__(self, bookie: str, answers: Any = None, clock: Any = None, limit: Any = None,
                 client: str = "") -> None:
        self.bookie = bookie
        self.client = client  # the node at the other end
        self.answers = answers  # the link carrying this bookie's answers to the client (net.Link)
        self.clock = clock
        self.limit = limit  # limit(since) -> how long a writer may keep a bookie whose answers stopped then
        self.hold = -1.0  # the start of the hold `unanswered` is about
        # ledger -> (first, last) adds of it that arrived during that hold, without a gap
        self.unanswered: dict[int, tuple[float, float]] = {}
        self.rx = bytearray()
        self.tx = bytearray()
        self.requests: dict[int, tuple[int, int, int, int]] = {}  # id -> op, flags, ledger, entry


class Oracle:
    """The invariants, checked as frames and workload events happen."""

    def __init__(self) -> None:
        self.ledgers: dict[int, LedgerTruth] = {}
        self.fenced: set[tuple[str, int]] = set()  # (bookie, ledger) that answered a fence
        # bookie -> (ledger, entry) it answered OK for since its last start (checked at its next)
        self.said_ok: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.violation: Violation | None = None
        self.on_violation: Any = lambda: None  # called once, as the first violation is found
        self.checks = 0
        self.on_recovery_add: Any = lambda _bookie, _ledger: False  # a ledger's first rewrite at a bookie: True loses it
        self.on_fence: Any = lambda _bookie, _ledger: False  # a fence arrives: True loses it
        self.on_read: Any = lambda _bookie, _ledger, _entry, _client: None  # an entry read arrives
        self.on_add: Any = lambda _bookie, _ledger: None  # a plain add of a ledger in `watched` arrives
        self.watched: set[int] = set()
        self._rewritten: set[tuple[str, int]] = set()
        self._last_ensembles: dict[int, list[str]] = {}  # ledger -> its last segment's bookies, as written
        self._left: dict[tuple[int, str], float] = {}  # (ledger, bookie) -> when a write took it out of that
        self.stream_records: set[bytes] = set()  # every record a stream writer accepted
        self.stream_acks: set[bytes] = set()     # ... and saw acknowledged
        self.stream_txids: dict[int, bytes] = {}  # txid -> the record readers found there

    # -- streams ---------------------------------------------------------------------------
    def stream_written(self, records: list[bytes]) -> None:
        """A stream writer accepted records (their bytes are unique in a run)."""
        self.stream_records.update(records)

    def stream_acked(self, records: list[bytes]) -> None:
        self.stream_acks.update(records)

    def stream_read(self, txid: int, data: bytes, previous: int, by: str) -> None:
        """A stream reader read record txid after txid `previous` (-1: its first)."""
        self.checks += 1
        if data not in self.stream_records:
            self.fail("stream-lost", f"{by} read txid {txid} as {data[:16]!r}, which no writer wrote")
        elif txid <= previous:
            self.fail("stream-order", f"{by} read txid {txid} after txid {previous}")
        elif self.stream_txids.setdefault(txid, data) != data:
            self.fail("stream-lost", f"{by} read txid {txid} as {data[:16]!r}, another reader as "
                      f"{self.stream_txids[txid][:16]!r}")

    def stream_final(self, records: list[tuple[int, bytes]]) -> None:
        """The whole stream read back once faults healed."""
        self.checks += 1
        txids = [t for t, _ in records]
        gap = next((i for i in range(1, len(txids)) if txids[i] != txids[i - 1] + 1), None)
        if gap is not None:
            self.fail("stream-order", f"the stream reads back with txid {txids[gap]} after {txids[gap - 1]}")
            return
        missing = self.stream_acks - {d for _, d in records}
        if missing:
            self.fail("stream-lost", f"{len(missing)} acknowledged record(s) not in the stream, e.g. "
                      f"{sorted(missing)[0][:16]!r}")

    def fail(self, invariant: str, detail: str) -> None:
        if self.violation is None:
            self.violation = Violation(invariant, detail)
            self.on_violation()

    def ledger(self, ledger_id: int, ack_quorum: int) -> LedgerTruth:
        truth = self.ledgers.get(ledger_id)
        if truth is None:
            truth = self.ledgers[ledger_id] = LedgerTruth(ledger_id, ack_quorum)
        return truth

    # -- frames ----------------------------------------------------------------------
    def tap(self, bookie: str, answers: Any = None, clock: Any = None, limit: Any = None, client: str = "") -> _Tap:
        return _Tap(bookie, answers, clock, limit, client)

    def requests_in(self, tap: _Tap, data: bytes) -> bool:
        """Bytes a bookie received: record each request; check the LACs writers tell. True if
        the simulation loses these bytes instead (on_fence or on_recovery_add asked for it)."""
        tap.rx += data
        frames, used = parse_requests(tap.rx, MAX_FRAME)  # the buffer itself, no copy
        del tap.rx[:used]
        lose = False
        for op, flags, rid, ledger_id, entry_id, _key, _aux, _payload, blob_lac in frames:
            tap.requests[rid] = (op, flags, ledger_id, entry_id)
            if flags & _FENCE and self.on_fence(tap.bookie, ledger_id):
                lose = True
            if op == _READ:
                self.on_read(tap.bookie, ledger_id, entry_id, tap.client)
            elif op == _ADD and ledger_id in self.watched:
                self.on_add(tap.bookie, ledger_id)
            if op == _ADD and flags & _RECOVERY_ADD and (tap.bookie, ledger_id) not in self._rewritten:
                self._rewritten.add((tap.bookie, ledger_id))
                if self.on_recovery_add(tap.bookie, ledger_id):
                    lose = True
            truth = self.ledgers.get(ledger_id)
            if truth is None:
                continue
            told = blob_lac if op == _ADD else entry_id if op == _WRITE_LAC else -1
            self.checks += 1
            if op == _ADD and tap.answers is not None:
                self._kept(tap, ledger_id, entry_id)
            if told > truth.prefix:
                self.fail("lac-ahead", f"ledger {ledger_id}: {tap.bookie} told LAC {told} "
                          f"({Op(op).name}) while only entries up to {truth.prefix} were on Qa bookies")
        return lose

    def ensemble_written(self, ledger_id: int, last_ensemble: list[str], now: float) -> None:
        """A metadata write of the ledger: the bookies its last segment no longer has left it
        now (replaced; a later write may take one back)."""
        before = self._last_ensembles.get(ledger_id, ())
        for bookie in before:
            if bookie not in last_ensemble:
                self._left[(ledger_id, bookie)] = now
        self._last_ensembles[ledger_id] = list(last_ensemble)

    def _kept(self, tap: _Tap, ledger_id: int, entry_id: int) -> None:
        """An add reached a bookie: fail if the writer has had no answer from it (they are
        held) for longer than it may take to replace it, counted from the first add of this
        ledger it sent while they were held, or since it took the bookie back (a placement or an
        ensemble change takes a failed bookie when no other is left: it only prefers the healthy),
        seen as a pause in its adds or as a metadata write that had replaced it."""
        if not tap.answers.held:
            return
        now = tap.clock()
        if tap.hold != tap.answers.since:
            tap.hold, tap.unanswered = tap.answers.since, {}
        first, last = tap.unanswered.get(ledger_id, (now, now))
        taken_back = (self._left.get((ledger_id, tap.bookie), -1.0) >= first
                      and tap.bookie in self._last_ensembles.get(ledger_id, ()))
        if now - last > REJOIN_GAP_S or taken_back:
            first = now  # the writer had replaced it (its adds stopped, or the metadata says so), then took it back
        tap.unanswered[ledger_id] = (first, now)
        if now - first > tap.limit(first):
            self.fail("kept-failed-bookie", f"ledger {ledger_id}: entry {entry_id} sent to {tap.bookie}, which has "
                      f"answered none of this ledger's adds for {now - first:.1f} s")

    def responses_out(self, tap: _Tap, data: bytes) -> None:
        """Bytes a bookie answered: fences, OK adds (and the fenced-add invariant)."""
        tap.tx += data
        frames, used = parse_responses(tap.tx, MAX_FRAME)
        del tap.tx[:used]
        for op, status, rid, ledger_id, entry_id, _lac, _payload in frames:
            req = tap.requests.pop(rid, None)
            if req is None:
                continue
            _op, flags, _l, _e = req
            if flags & _FENCE and op in (_READ, _READ_LAC) and status in (_OK, _NO_SUCH_ENTRY):
                self.fenced.add((tap.bookie, ledger_id))
            elif op == _ADD and status == _OK:
                self.checks += 1
                if not flags & _RECOVERY_ADD and (tap.bookie, ledger_id) in self.fenced:
                    self.fail("fenced-add", f"{tap.bookie} answered OK to a plain add of entry {entry_id} of "
                              f"ledger {ledger_id} after it answered a fence for it")
                self.said_ok[tap.bookie].append((ledger_id, entry_id))
                truth = self.ledgers.get(ledger_id)
                if truth is not None:
                    truth.ok[entry_id].add(tap.bookie)
                    while len(truth.ok.get(truth.prefix + 1, ())) >= truth.ack_quorum:
                        truth.prefix += 1

    # -- workload events -----------------------------------------------------------
    def acked(self, truth: LedgerTruth, first: int, last: int) -> None:
        """The writer saw entries first..last acknowledged (in order, so every one before too):
        each must have been answered OK by Qa bookies, which `prefix` already says for all up
        to it; only the entries past it are looked at one by one."""
        self.checks += 1
        for entry_id in range(max(first, truth.prefix + 1), last + 1):
            n = len(truth.ok.get(entry_id, ()))
            if n < truth.ack_quorum:
                self.fail("ack-quorum", f"ledger {truth.ledger_id}: entry {entry_id} acknowledged with OK from {n} "
                          f"bookie(s), Qa is {truth.ack_quorum}")
                break
        if truth.closed_at is not None and last > truth.closed_at:
            self.fail("acked-after-close", f"ledger {truth.ledger_id}: entry {max(first, truth.closed_at + 1)} "
                      f"acknowledged after the ledger was closed at {truth.closed_at}")
        truth.acked = max(truth.acked, last)

    def closed(self, truth: LedgerTruth, last: int, by: str) -> None:
        self.checks += 1
        if truth.closed_at is None:
            truth.closed_at = last
        elif truth.closed_at != last:
            self.fail("closed-diverged", f"ledger {truth.ledger_id}: closed at {truth.closed_at}, then {by} says "
                      f"{last}")
        if truth.acked > last:
            self.fail("acked-after-close", f"ledger {truth.ledger_id}: entry {truth.acked} was acknowledged but "
                      f"{by} closed it at {last}")

    def replicated(self, truth: LedgerTruth, metadata: LedgerMetadata) -> None:
        """A closed ledger's metadata names, for each entry up to its end, Qa bookies that
        answered OK for it (the write set the metadata gives the entry, not any bookie that
        once had it: a copy on a bookie the metadata no longer names is not read)."""
        for entry_id in range(metadata.last_entry_id + 1):
            self.checks += 1
            ensemble = metadata.ensemble_for(entry_id)
            named = {ensemble[i] for i in write_set(entry_id, metadata.ensemble_size, metadata.write_quorum)}
            have = len(named & truth.ok.get(entry_id, set()))
            if have < metadata.ack_quorum:
                self.fail("under-replicated", f"ledger {truth.ledger_id}: entry {entry_id}'s write set in the closed "
                          f"metadata ({sorted(named)}) has {have} bookie(s) that answered OK for it, Qa is "
                          f"{metadata.ack_quorum}")
                return

    def read(self, truth: LedgerTruth, entry_id: int, data: bytes, lac: int) -> None:
        self.checks += 1
        if entry_id >= len(truth.data) or truth.data[entry_id] != data:
            self.fail("dirty-read", f"ledger {truth.ledger_id}: entry {entry_id} read back as {data[:16]!r}..., "
                      f"not what the writer added")
        if lac > truth.prefix and (truth.closed_at is None or lac > truth.closed_at):
            self.fail("dirty-read", f"ledger {truth.ledger_id}: a reader saw LAC {lac}, but only entries up to "
                      f"{truth.prefix} were on Qa bookies")

    def restarted(self, bookie: str, holds: Any) -> None:
        """holds(ledger, entry) -> bool: what the bookie's storage has after its replay. Only
        what it answered OK for since its last start is looked up: what it held then was
        checked at that start, and the start's checkpoint put it in storage, which a crash
        here does not tear (disk.py)."""
        for ledger_id, entry_id in self.said_ok.pop(bookie, []):
            self.checks += 1
            if not holds(ledger_id, entry_id):
                self.fail("lost-on-restart", f"{bookie} answered OK for entry {entry_id} of ledger {ledger_id} "
                          f"but does not hold it after its restart")
                return
