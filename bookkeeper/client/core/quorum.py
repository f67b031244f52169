"""Striping and quorum rules (Reference: Apache BookKeeper, RoundRobinDistributionSchedule).

Entry e of a ledger with ensemble size E and write quorum Qw goes to the write set
[(e + i) % E for i in range(Qw)]. The writer acknowledges e once Qa bookies of its
write set have it durably and every entry before e is acknowledged; the LAC is the
highest entry so acknowledged. The tracker that applies these rules to a writer's
outstanding adds is on the hot path, so it is Cython: bookkeeper._ext.client.AddTracker.
"""
from __future__ import annotations


def write_set(entry_id: int, ensemble_size: int, write_quorum: int) -> list[int]:
    """Ensemble indexes that store entry_id."""
    return [(entry_id + i) % ensemble_size for i in range(write_quorum)]


def fence_covered(responded: set[int], *, ensemble_size: int, write_quorum: int, ack_quorum: int) -> bool:
    """Whether fencing has reached enough bookies that the old writer cannot be acked again.

    Every write set must have fewer than Qa bookies that did not acknowledge the
    fence: then no write set can form an ack quorum of unfenced bookies.
    (Reference: Apache BookKeeper, ledger recovery, "fencing quorum coverage".)
    """
    for start in range(ensemble_size):
        ws = write_set(start, ensemble_size, write_quorum)
        if sum(1 for b in ws if b not in responded) >= ack_quorum:
            return False
    return True


def entry_missing(no_entry_count: int, *, write_quorum: int, ack_quorum: int) -> bool:
    """Whether enough bookies deny an entry that it cannot have been acknowledged.

    An acknowledged entry is on at least Qa bookies of its write set, so once
    Qw - Qa + 1 of them say "no such entry" it was never acknowledged.
    """
    return no_entry_count >= write_quorum - ack_quorum + 1
