"""Stream decisions as pure functions (no clock, no I/O): when a segment rolls, which
segments retention deletes. Unit-tested as decision tables (tests/test_stream_policy.py).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class RollReason(enum.Enum):
    RECORDS = "records"   # segment_max_records reached
    BYTES = "bytes"       # segment_max_bytes reached
    AGE = "age"           # segment_max_age_s since the segment's first record


def roll_reason(*, records: int, size_bytes: int, age_s: float, max_records: int | None,
                max_bytes: int | None, max_age_s: float | None) -> RollReason | None:
    """Whether the writer closes the current segment and starts the next, and why.

    An empty segment never rolls (a roll costs a ledger and three metadata writes, and
    an idle writer would otherwise mint empty segments at every age tick). A limit of
    None is off. Checked after every sealed record set, so a segment may exceed a limit
    by one set: records never wait for a roll they do not need.
    """
    if records <= 0:
        return None
    if max_records is not None and records >= max_records:
        return RollReason.RECORDS
    if max_bytes is not None and size_bytes >= max_bytes:
        return RollReason.BYTES
    if max_age_s is not None and age_s >= max_age_s:
        return RollReason.AGE
    return None


@dataclass(frozen=True, slots=True)
class SegmentView:
    """What retention needs to know of a segment (oldest first in the lists below)."""

    seq: int
    state: str          # "open" | "closed" | "truncated"
    size_bytes: int
    closed_ms: int      # wall clock of the close; 0 while open


def expired(segments: Sequence[SegmentView], *, now_ms: int, max_age_s: float | None,
            max_bytes: int | None) -> list[int]:
    """Sequence numbers retention deletes: always a prefix of the stream, oldest first.

    Segments already marked truncated (a deletion that was interrupted) always go. Of the
    rest, a closed segment goes while it is older than max_age_s or while the stream is
    larger than max_bytes; the open segment and the newest segment always stay, so a
    stream never loses its last txid (the next writer continues from it) and readers at
    "earliest" always find where to start.
    """
    out = [s.seq for s in segments if s.state == "truncated"]
    live = [s for s in segments if s.state != "truncated"]
    total = sum(s.size_bytes for s in live)
    for s in live[:-1]:
        if s.state != "closed":
            break
        too_old = max_age_s is not None and now_ms - s.closed_ms >= max_age_s * 1000
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            break
        out.append(s.seq)
        total -= s.size_bytes
    return out


def before(segments: Sequence[SegmentView], position_segment: int) -> list[int]:
    """Sequence numbers `truncate(before=pos)` deletes: every closed (or already truncated)
    segment whose sequence is below pos's segment; the segment holding pos stays."""
    return [s.seq for s in segments if s.seq < position_segment and s.state != "open"]
