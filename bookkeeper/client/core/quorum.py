"""Striping and quorum rules (Reference: Apache BookKeeper, RoundRobinDistributionSchedule).

Entry e of a ledger with ensemble size E and write quorum Qw goes to the write set
[(e + i) % E for i in range(Qw)]. The writer acknowledges e once Qa bookies of its
write set have it durably and every entry before e is acknowledged; the LAC is the
highest entry so acknowledged.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def write_set(entry_id: int, ensemble_size: int, write_quorum: int) -> list[int]:
    """Ensemble indexes that store entry_id."""
    return [(entry_id + i) % ensemble_size for i in range(write_quorum)]


@dataclass(slots=True)
class _Pending:
    write_set: list[int]
    size: int
    acked: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)


class AddTracker:
    """Acknowledgement state of a ledger's outstanding adds (one per write handle).

    Feed it bookie responses; it answers which entries became acknowledged, always
    as a contiguous run in id order, and which can no longer reach the ack quorum.
    """

    def __init__(self, *, ensemble_size: int, write_quorum: int, ack_quorum: int, lac: int = -1,
                 length: int = 0) -> None:
        if not (1 <= ack_quorum <= write_quorum <= ensemble_size):
            raise ValueError(f"need 1 <= Qa <= Qw <= E, got E={ensemble_size} Qw={write_quorum} Qa={ack_quorum}")
        self.e, self.qw, self.qa = ensemble_size, write_quorum, ack_quorum
        self.lac = lac
        self.length = length
        self._pending: dict[int, _Pending] = {}

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def add(self, entry_id: int, size: int) -> list[int]:
        """Register a new entry (ids must come in order); returns its write set."""
        ws = write_set(entry_id, self.e, self.qw)
        self._pending[entry_id] = _Pending(ws, size)
        return ws

    def ack(self, entry_id: int, bookie_index: int) -> list[tuple[int, int]]:
        """A bookie stored entry_id durably. Returns newly acknowledged (entry_id, length_after)."""
        p = self._pending.get(entry_id)
        if p is None or bookie_index not in p.write_set:
            return []
        p.acked.add(bookie_index)
        done: list[tuple[int, int]] = []
        nxt = self.lac + 1
        while True:
            head = self._pending.get(nxt)
            if head is None or len(head.acked) < self.qa:
                break
            del self._pending[nxt]
            self.length += head.size
            self.lac = nxt
            done.append((nxt, self.length))
            nxt += 1
        return done

    def fail(self, entry_id: int, bookie_index: int) -> bool:
        """A bookie refused or lost entry_id. True if the entry can no longer reach Qa."""
        p = self._pending.get(entry_id)
        if p is None or bookie_index not in p.write_set:
            return False
        p.failed.add(bookie_index)
        return len(p.write_set) - len(p.failed) < self.qa

    def pending_ids(self) -> list[int]:
        """Outstanding entry ids in order."""
        return sorted(self._pending)

    def reset(self, entry_id: int, bookie_index: int) -> None:
        """The bookie at this ensemble slot was replaced: its ack or failure no longer counts."""
        p = self._pending.get(entry_id)
        if p is not None:
            p.acked.discard(bookie_index)
            p.failed.discard(bookie_index)

    def drop_all(self) -> list[int]:
        """Forget every outstanding entry (the handle failed); returns their ids in order."""
        ids = sorted(self._pending)
        self._pending.clear()
        return ids


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
