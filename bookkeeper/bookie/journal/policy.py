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
