"""Group-commit flush policy: a pure function, no clock, no I/O (unit-tested exhaustively).

Why adaptive: a batch is flushed as soon as the previous fdatasync returned, so a
lone add waits for one sync only (low latency at low load), while under load the
batch fills during the sync in flight (throughput rises with load).
"""
from __future__ import annotations

import enum


class FlushReason(enum.Enum):
    IDLE = "idle"          # no sync in flight: flush now
    FULL = "full"          # bytes or entries bound reached (only acted on when no sync is in flight)
    WAITED = "waited"      # the configured group wait elapsed


def flush_reason(*, batch_count: int, batch_bytes: int, oldest_wait_us: int,
                 sync_in_flight: bool, group_wait_us_max: int,
                 batch_bytes_max: int, batch_entries_max: int) -> FlushReason | None:
    """Whether to seal and write the current batch now, and why; None means keep filling.

    One sync is in flight at a time (blocks are written strictly in order, so a torn
    block can only be the last one). With group_wait_us_max > 0 a small batch waits
    up to that long for company, as Apache BookKeeper's journalMaxGroupWaitMSec.
    The bounds also cap a batch filling behind a sync in flight: the server stops
    reading from senders while the batch is full (journal.Journal.full).
    """
    if batch_count == 0 or sync_in_flight:
        return None
    if batch_bytes >= batch_bytes_max or batch_count >= batch_entries_max:
        return FlushReason.FULL
    if group_wait_us_max <= 0:
        return FlushReason.IDLE
    if oldest_wait_us >= group_wait_us_max:
        return FlushReason.WAITED
    return None


class FileHeader(enum.Enum):
    """What a journal file's header says, read before any block."""

    SHORT = "short"  # shorter than its header: created, never written
    BAD = "bad"      # wrong magic or file id: no block was ever acknowledged from it
    NEWER = "newer"  # a format version this code does not know
    OK = "ok"


class BlockScan(enum.Enum):
    """How the scan of a file's blocks ended (scan_blocks)."""

    CLEAN = "clean"                    # zeros, the end of the file, or another use's valid block
    TORN = "torn"                      # an invalid block with nothing valid after it
    CORRUPT_MIDDLE = "corrupt middle"  # an invalid block with a valid block of this file after it


class ReplayStep(enum.Enum):
    """What replay does with one journal file."""

    SKIP = "skip"                      # nothing in it was ever acknowledged
    APPLY = "apply"                    # every record
    APPLY_TORN = "apply torn"          # the records before a torn last block (never acknowledged)
    APPLY_REUSED_END = "apply reused"  # the records before an earlier use's bytes (or a torn block)
    REFUSE_NEWER = "refuse newer"      # the shard does not start: the file is of a newer format
    REFUSE_CORRUPT = "refuse corrupt"  # the shard does not start: acknowledged records would be lost


def replay_step(header: FileHeader, scan: BlockScan | None, *, reused: bool) -> ReplayStep:
    """The verdict on one journal file, from its header, the end of its block scan (None when
    the header stopped replay before any scan) and whether the file is a reused one (format 2,
    FLAG_REUSED). A pure function, beside flush_reason, so that the whole table is tested.

    Why a torn end is safe to drop but a corrupt middle is not: blocks are written one at a
    time and acknowledged only once synced, so only a file's last block can be a torn write;
    an invalid block with a valid one after it was damaged after it was acknowledged. In a
    reused file a torn last write and the middle of an earlier use's block look alike, and
    neither was acknowledged."""
    if header in (FileHeader.SHORT, FileHeader.BAD):
        return ReplayStep.SKIP
    if header is FileHeader.NEWER:
        return ReplayStep.REFUSE_NEWER
    if scan is None:
        raise ValueError("a file with a good header is judged on its scan")
    if scan is BlockScan.CORRUPT_MIDDLE:
        return ReplayStep.REFUSE_CORRUPT
    if scan is BlockScan.TORN:
        return ReplayStep.APPLY_REUSED_END if reused else ReplayStep.APPLY_TORN
    return ReplayStep.APPLY
