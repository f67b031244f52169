"""Whether a bookie takes writes: disk thresholds with hysteresis, and the bookie's state
from everything that can make it read-only. Pure functions (table-tested); the supervisor
feeds them (Reference: Apache BookKeeper LedgerDirsMonitor + BookieStateManager).

Rules:
- A directory turns full at `threshold` and stays full until it is under `lwm` (so a GC
  that frees a little does not flap the bookie between read-only and writable); it is
  warned about from `warn` on.
- The bookie is read-only when the config forces it, an operator switched it read-only
  (the maintenance switch, PUT /api/v1/bookie/state/readonly), an operator is
  decommissioning it, its journal dir is full, every ledger dir is full (while one has
  room, new entry logs go there), or a shard's journal failed (that shard can make nothing
  durable). Writable only when none of these holds.
- The journal's reuse pool (trimmed files kept for reuse, and the zero-filled spare) is room
  the bookie can give back at will: the thresholds count it as free, and from `warn` on
  the shards give it back (journal_space).
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bookkeeper.bookie.journal.journal import journal_pool_bytes

WRITABLE, READONLY = "writable", "readonly"
MANUAL_REASON = "switched read-only by an operator (PUT /api/v1/bookie/state/readonly)"


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


@dataclass(frozen=True, slots=True)
class JournalSpace:
    """What one measure of the journal's filesystem means for the bookie."""

    usage: float               # the used share the thresholds see: every pooled byte counted as free
    release: tuple[str, ...]   # the caller's pooled files to give back now, oldest first
    pooling: bool              # whether trimmed files may go to the pool (and a spare be made)


def journal_space(*, total_bytes: int, free_bytes: int, pool_bytes: int, own_pool: Sequence[tuple[str, int]] = (),
                  pooling: bool = True, warn: float, lwm: float) -> JournalSpace:
    """The journal disk's used share as the thresholds see it, and which pooled files to give back.

    pool_bytes: every pooled byte on this filesystem (all shards' reuse files and spares);
    own_pool: the caller's own pooled files as (name, bytes), oldest first (only a shard
    may delete its own: its journal takes them at a roll).

    | raw share (used/total)    | release                                   | pooling      |
    |---------------------------|-------------------------------------------|--------------|
    | >= warn                   | own files, oldest first, until raw < warn  | off          |
    | lwm <= raw < warn         | nothing                                   | as it was    |
    | < lwm                     | nothing                                   | on           |

    Why count the pool as free: it must never hold a bookie read-only (a full journal disk
    whose other files went stays read-only for good otherwise: issue 22). Why release from
    warn, and on the raw share: ENOSPC follows the raw share, and the room is worth more
    than the reuse. Why pooling waits for lwm: trims that pool again right after a release
    would push the disk back over warn, to be released again.
    """
    if total_bytes <= 0:
        return JournalSpace(1.0, (), False)
    used = total_bytes - free_bytes
    release = []
    for name, size in own_pool:
        if used < warn * total_bytes:
            break
        release.append(name)
        used -= size
    raw = (total_bytes - free_bytes) / total_bytes
    if raw >= warn:
        pooling = False
    elif raw < lwm:
        pooling = True
    usage = min(1.0, max(0.0, (total_bytes - free_bytes - pool_bytes) / total_bytes))
    return JournalSpace(usage, tuple(release), pooling)


def bookie_state(*, forced: bool, decommissioning: bool, dirs: list[DirState],
                 failed_shards: dict[int, str], manual: bool = False) -> tuple[str, str | None]:
    """(WRITABLE | READONLY, why read-only or None): the first reason in the order of the rules.

    manual: the operator's maintenance switch (PUT /api/v1/bookie/state/readonly) is on.
    """
    if forced:
        return READONLY, "readonly = true in the configuration"
    if manual:
        return READONLY, MANUAL_REASON
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


@dataclass(frozen=True, slots=True)
class DirUsage:
    """One measure of a bookie directory's filesystem."""

    total_bytes: int
    free_bytes: int
    pool_bytes: int  # the journal's pool in this dir (0 for a ledger dir): counted as free
    usage: float     # the used share the thresholds see


def measure_dir(path: str | Path, kind: str, *, warn: float, lwm: float) -> DirUsage:
    """Measure a journal or ledger dir; a journal dir's pool counts as free (journal_space)."""
    total, free, raw = disk_usage(path)
    if kind != "journal":
        return DirUsage(total, free, 0, raw)
    pool = journal_pool_bytes(path)
    space = journal_space(total_bytes=total, free_bytes=free, pool_bytes=pool, warn=warn, lwm=lwm)
    return DirUsage(total, free, pool, space.usage)
