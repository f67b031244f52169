"""Whether a bookie takes writes: disk thresholds with hysteresis, and the bookie's state
from everything that can make it read-only. Pure functions (table-tested); the supervisor
feeds them (Reference: Apache BookKeeper LedgerDirsMonitor + BookieStateManager).

Rules:
- A directory turns full at `threshold` and stays full until it is under `lwm` (so a GC
  that frees a little does not flap the bookie between read-only and writable); it is
  warned about from `warn` on.
- The bookie is read-only when the config forces it, an operator is decommissioning it,
  its journal dir is full, every ledger dir is full (while one has room, new entry logs
  go there), or a shard's journal failed (that shard can make nothing durable).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

WRITABLE, READONLY = "writable", "readonly"


@dataclass(frozen=True, slots=True)
class DirState:
    """One directory's standing against the thresholds."""

    path: str
    kind: str  # "journal" | "ledger"
    usage: float = 0.0
    full: bool = False
    warned: bool = False


def next_dir_state(prev: DirState, usage: float, *, warn: float, threshold: float, lwm: float) -> DirState:
    """The directory's state after measuring `usage` (used share of its filesystem)."""
    full = usage >= lwm if prev.full else usage >= threshold
    return DirState(prev.path, prev.kind, usage, full, usage >= warn)


def bookie_state(*, forced: bool, decommissioning: bool, dirs: list[DirState],
                 failed_shards: dict[int, str]) -> tuple[str, str | None]:
    """(WRITABLE | READONLY, why read-only or None): the first reason in the order of the rules."""
    if forced:
        return READONLY, "readonly = true in the configuration"
    if decommissioning:
        return READONLY, "being decommissioned"
    for d in dirs:
        if d.kind == "journal" and d.full:
            return READONLY, f"journal dir {d.path} is {d.usage:.0%} full"
    ledger = [d for d in dirs if d.kind == "ledger"]
    if ledger and all(d.full for d in ledger):
        return READONLY, "every ledger dir is full: " + ", ".join(f"{d.path} {d.usage:.0%}" for d in ledger)
    if failed_shards:
        index = min(failed_shards)
        return READONLY, f"shard {index} failed: {failed_shards[index]}"
    return WRITABLE, None


def disk_usage(path: str | Path) -> tuple[int, int, float]:
    """(total bytes, free bytes, used share) of the filesystem holding path.

    Used share counts what unprivileged writers cannot use as used (as `df` does): the
    root-reserved blocks are not room a bookie can count on.
    """
    u = shutil.disk_usage(path)
    return u.total, u.free, (1.0 - u.free / u.total) if u.total else 1.0
