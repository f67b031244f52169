"""Partition planning for the Spark source: pure functions (no Spark, no I/O), table-tested.

Why here and not in the source: what a read covers (which ids, which entry ranges, how the
work is balanced) decides correctness and scaling, and is worth testing without a
SparkSession or a cluster (tests/test_spark_planning.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from bookkeeper.errors import ConfigError


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


def balance(ranges: list[LedgerRange]) -> list[LedgerRange]:
    """Largest first: Spark hands tasks out in partition order, so the big ones start early
    and small ones fill the gaps at the end (longest-processing-time order)."""
    return sorted(ranges, key=lambda r: (-r.planned_bytes, r.ledger_id, r.first))
