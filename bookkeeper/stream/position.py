"""A record's place in a stream: (segment sequence, entry id, slot), totally ordered.

Why three parts: a segment is one ledger, a record set is one entry of it, and a slot is
the record's index inside its set. Comparing the tuple orders records exactly as a reader
meets them, across rolls; a control entry (no records) takes an entry id and no position.
`str(pos)` is "SEQ:ENTRY:SLOT" (e.g. "3:17:0"), what the CLI prints and `parse` reads back.
"""
from __future__ import annotations

from typing import NamedTuple

from bookkeeper.errors import InvalidPositionError


class Position(NamedTuple):
    """(segment, entry, slot); ordering and hashing are the tuple's."""

    segment: int
    entry: int
    slot: int

    def __str__(self) -> str:
        return f"{self.segment}:{self.entry}:{self.slot}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """Inverse of str(): "SEQ:ENTRY:SLOT", three non-negative integers."""
        parts = text.strip().split(":")
        if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
            raise InvalidPositionError(f"not a stream position: {text!r} (expected SEQ:ENTRY:SLOT, "
                                       f"three non-negative integers, e.g. 3:17:0)")
        return cls(int(parts[0]), int(parts[1]), int(parts[2]))

