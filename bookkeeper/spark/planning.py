"""Partition planning for the Spark source: pure functions (no Spark, no I/O), table-tested.

Why here and not in the source: what a read covers (which ids, which entry ranges, which
ledgers it skips, how the work is balanced, whether a stream read starts in deleted records)
decides correctness and scaling, and is worth testing without a SparkSession or a cluster
(tests/test_spark_planning.py).
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from bookkeeper.errors import ConfigError
from bookkeeper.meta.streams import Segment
from bookkeeper.stream.position import Position


@dataclass(frozen=True, slots=True)
class LedgerSpec:
    """Parsed `ledgers` option: single ids (must exist) and inclusive ranges (absent ids skipped)."""

    singles: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    def wants(self, ledger_id: int) -> bool:
        return ledger_id in self.singles or any(lo <= ledger_id <= hi for lo, hi in self.ranges)


def parse_ledgers(text: str) -> LedgerSpec:
    """"1,2,10-20" -> singles (1, 2), ranges ((10, 20),). Whitespace around items is ignored."""
    singles: list[int] = []
    ranges: list[tuple[int, int]] = []
    for raw in text.split(","):
        item = raw.strip()
        lo, sep, hi = item.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ConfigError(f"ledgers: {item!r} is not an id or an inclusive range A-B "
                              f"(the option is e.g. '1,2,10-20')") from None
        if a < 0 or b < a:
            raise ConfigError(f"ledgers: {item!r} is not a non-negative id or a range A-B with A <= B")
        if sep:
            ranges.append((a, b))
        else:
            singles.append(a)
    return LedgerSpec(tuple(singles), tuple(ranges))


@dataclass(frozen=True, slots=True)
class Bounds:
    """Inclusive ledger_id and entry_id bounds from pushed-down filters (no filter: everything)."""

    ledger_lo: int = 0
    ledger_hi: int = 2**63 - 1
    entry_lo: int = 0
    entry_hi: int = 2**63 - 1

    def narrow(self, column: str, op: str, value: int) -> Bounds:
        """These bounds and `column op value` (op: = > >= < <=): the conjunction, still a box."""
        lo, hi = (self.ledger_lo, self.ledger_hi) if column == "ledger_id" else (self.entry_lo, self.entry_hi)
        if op in ("=", ">="):
            lo = max(lo, value)
        if op in ("=", "<="):
            hi = min(hi, value)
        if op == ">":
            lo = max(lo, value + 1)
        if op == "<":
            hi = min(hi, value - 1)
        if column == "ledger_id":
            return Bounds(lo, hi, self.entry_lo, self.entry_hi)
        return Bounds(self.ledger_lo, self.ledger_hi, lo, hi)

    def has_ledger(self, ledger_id: int) -> bool:
        return self.ledger_lo <= ledger_id <= self.ledger_hi


@dataclass(frozen=True, slots=True)
class LedgerRange:
    """One partition of a ledger read: entries first..last inclusive (planned_bytes: a guess)."""

    ledger_id: int
    first: int
    last: int
    planned_bytes: int


def split_ledger(ledger_id: int, last_entry: int, length: int, max_entries: int, *,
                 bounds: Bounds | None = None) -> list[LedgerRange]:
    """A ledger of entries 0..last_entry (clipped to `bounds`' entry range) as ceil(n / max_entries)
    ranges of equal entry counts (within one), so a 10 GB ledger is many tasks and no task holds
    more than max_entries. Bytes per range are the ledger's length shared by entry count: the
    metadata knows no finer."""
    b = bounds or Bounds()
    first, last = max(0, b.entry_lo), min(last_entry, b.entry_hi)
    n = last - first + 1
    if n <= 0:
        return []
    parts = math.ceil(n / max_entries)
    base, extra = divmod(n, parts)
    out = []
    for i in range(parts):
        count = base + (i < extra)
        out.append(LedgerRange(ledger_id, first, first + count - 1, length * count // (last_entry + 1)))
        first += count
    return out


class Access(enum.Enum):
    """What a ledgers read does with one ledger it wants (decide_access)."""

    READ = "read"
    SKIP = "skip"   # left out, named in one WARNING line with the others skipped
    FAIL = "fail"   # the read fails with an error naming the ledger


def decide_access(*, unreadable: bool, named: bool, skip_unreadable: bool) -> Access:
    """Read, skip or fail on a ledger the `ledgers` option wants. `unreadable`: the read's
    password or digest option is not the ledger's (its metadata says so: the driver knows before
    any entry is read); `named`: the option names it by its id, not only by a range.

    A range is a net cast over ids that other applications' ledgers share, so with
    skipUnreadable=true a ledger a range caught that cannot be opened is left out. A ledger named
    by its id is one the user asked for: reading around it would return a silently short result,
    so it fails whatever the option says. Without the option every unreadable ledger fails, as
    before the option existed.

    | unreadable | named by id | skipUnreadable | access |
    |------------|-------------|----------------|--------|
    | no         | any         | any            | READ   |
    | yes        | yes         | any            | FAIL   |
    | yes        | no          | false          | FAIL   |
    | yes        | no          | true           | SKIP   |
    """
    if not unreadable:
        return Access.READ
    return Access.SKIP if skip_unreadable and not named else Access.FAIL


SKIPPED_NAMED_MAX = 10  # ledgers a skip warning names; the rest are counted


def describe_skipped(skipped: Sequence[tuple[int, str]], looked_at: int) -> str:
    """The one WARNING line of a ledgers read that skipped ledgers: how many of the ledgers its
    ranges found, and which with why (the first SKIPPED_NAMED_MAX; a range over a busy cluster
    may skip thousands)."""
    named = ", ".join(f"{lid} ({why})" for lid, why in skipped[:SKIPPED_NAMED_MAX])
    more = len(skipped) - SKIPPED_NAMED_MAX
    return (f"skipped {len(skipped)} of {looked_at} ledgers that cannot be opened with this read's password "
            f"and digest (skipUnreadable=true): {named}" + (f" and {more} more" if more > 0 else ""))


def balance(ranges: list[LedgerRange]) -> list[LedgerRange]:
    """Largest first: Spark hands tasks out in partition order, so the big ones start early
    and small ones fill the gaps at the end (longest-processing-time order)."""
    return sorted(ranges, key=lambda r: (-r.planned_bytes, r.ledger_id, r.first))


class Verdict(enum.Enum):
    """Whether a stream read that starts in a removed segment lost records (judge)."""

    NONE = "none"   # nothing lost
    LOST = "lost"   # records may have been deleted before the query read them
    WAIT = "wait"   # undecided until the first surviving segment holds a record


@dataclass(frozen=True, slots=True)
class Gap:
    """Segments removed at or after a start position that may have held records not yet read."""

    start: Position
    resume: Position                # the first position that survives at or after start
    segments: tuple[int, ...]       # the removed segments' sequence numbers
    ledgers: tuple[int, ...]        # their ledger ids, where their metadata still names them
    resume_seq: int | None          # the first surviving segment past start (None: none yet)


def find_gap(start: Position, segments: Sequence[Segment], next_seq: int) -> Gap | None:
    """The removed segments a read from `start` jumps over that may have held records.

    `segments` are the stream's segment nodes (those marked truncated included, whose figures
    are still known); `next_seq` the sequence number the next segment will take. No gap when
    start's segment survives or is not made yet, or when a surviving segment lies below start:
    retention and truncation only ever remove a stream's oldest segments, so a hole above a
    survivor is an empty segment a writer retired. A marked segment is left out when it held
    no record at or after start.
    """
    live = [s.seq for s in segments if s.state != "truncated"]
    if start.segment in live or start.segment >= next_seq or any(q < start.segment for q in live):
        return None
    resume_seq = next((q for q in live if q > start.segment), None)
    stop = next_seq if resume_seq is None else resume_seq
    marked = {s.seq: s for s in segments if s.state == "truncated"}
    gone = [q for q in range(start.segment, stop) if not _held_nothing_from(marked.get(q), start)]
    if not gone:
        return None
    return Gap(start, Position(stop, 0, 0), tuple(gone),
               tuple(marked[q].ledger_id for q in gone if q in marked), resume_seq)


def _held_nothing_from(seg: Segment | None, start: Position) -> bool:
    if seg is None:
        return False  # its node is gone with its figures: it may have held records
    return seg.records == 0 or (seg.seq == start.segment and start.entry > seg.last_entry)


def judge(gap: Gap | None, after_txid: int | None, first_txid: int | None) -> Verdict:
    """Whether records were lost in `gap`, given the txid of the last record before its start
    (`after_txid`, from the query's offset; None: unknown) and the txid of the first record
    after it (`first_txid`, of the first surviving segment; None: it holds none yet).

    Txids increase strictly along a stream, so when the first surviving record's txid follows
    the last one read, nothing lay between: a query that had read a segment to its end, which
    retention then deleted, or a start in an empty segment a writer retired. Otherwise records
    may have been lost. With nothing after the gap yet the answer waits for the next record.

    | gap  | after_txid | resume segment | first_txid     | verdict |
    |------|------------|----------------|----------------|---------|
    | none | any        | any            | any            | NONE    |
    | yes  | None       | any            | any            | LOST    |
    | yes  | T          | none           | -              | LOST    |
    | yes  | T          | yes            | None           | WAIT    |
    | yes  | T          | yes            | T + 1          | NONE    |
    | yes  | T          | yes            | other          | LOST    |
    """
    if gap is None:
        return Verdict.NONE
    if after_txid is None or gap.resume_seq is None:
        return Verdict.LOST
    if first_txid is None:
        return Verdict.WAIT
    return Verdict.NONE if first_txid == after_txid + 1 else Verdict.LOST


def describe_gap(gap: Gap, after_txid: int | None, first_txid: int | None) -> str:
    """"positions 1:0:5 up to 3:0:0 (segments 1..2, ledgers 7, 9; txids 5..19)": the range a
    read jumps over, with what is known of it (ledger ids while the nodes exist, txids when
    both ends are known)."""
    text = f"positions {gap.start} up to {gap.resume} ({_counted('segment', gap.segments)}"
    if gap.ledgers:
        text += f", {_counted('ledger', gap.ledgers)}"
    if after_txid is not None and first_txid is not None and first_txid > after_txid + 1:
        text += f"; txids {after_txid + 1}..{first_txid - 1}"
    return text + ")"


def _counted(noun: str, ids: tuple[int, ...]) -> str:
    """"segment 4", "segments 1..3" (consecutive), "ledgers 7, 9"."""
    if len(ids) == 1:
        return f"{noun} {ids[0]}"
    if noun == "segment" and ids == tuple(range(ids[0], ids[-1] + 1)):
        return f"{noun}s {ids[0]}..{ids[-1]}"
    return f"{noun}s {', '.join(map(str, ids))}"
