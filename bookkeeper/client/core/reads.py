"""An entry read's decisions (sans-I/O; the shell is `_EntryRead` in bookkeeper.client.ledger).

An entry is read from its write set, replicas in the order health gives them (penalized,
slow or failing bookies last). One replica is asked; the next when it errs, or when it has
not answered after `speculative_read_timeout_ms` (a speculative read, as Apache BookKeeper's
`SpeculativeRequestExecutionPolicy`). The first copy whose digest holds wins. A denial
(NO_SUCH_ENTRY / NO_SUCH_LEDGER) is an answer, not a fault: it does not mark the bookie slow,
and a read every replica denies fails with NoSuchEntryError; otherwise the last fault's class.

Events in: a copy (verified), an error, the speculative timer. Decisions out: the next
replica to ask (or none), whether to arm the timer, whether to penalize the bookie, the
read's failure. The shell subclasses this, so one object per entry read holds both.
"""
from __future__ import annotations

from bookkeeper.errors import BKError, NoSuchEntryError, NoSuchLedgerError

DENIALS = (NoSuchEntryError, NoSuchLedgerError)


class ReplicaRead:
    """One entry's read over its replicas (ledger_id and entry_id only name it in errors)."""

    __slots__ = ("ledger_id", "entry_id", "replicas", "next", "outstanding", "errors", "settled")

    def __init__(self, ledger_id: int, entry_id: int, replicas: list[str]) -> None:
        self.ledger_id = ledger_id
        self.entry_id = entry_id
        self.replicas = replicas
        self.next = 0          # replicas[next] is the next one to ask
        self.outstanding = 0   # asked, not answered
        self.errors: list[BKError] = []
        self.settled = False   # a copy arrived, or the read failed

    def take_next(self) -> str | None:
        """The next replica to ask (counted as asked), or None: every one was, or it is settled."""
        if self.settled or self.next >= len(self.replicas):
            return None
        bookie = self.replicas[self.next]
        self.next += 1
        self.outstanding += 1
        return bookie

    @property
    def can_speculate(self) -> bool:
        """Whether a speculative timer has a replica to ask when it fires."""
        return not self.settled and self.next < len(self.replicas)

    def copy_arrived(self) -> bool:
        """A replica's copy passed its digest: True if it settles the read (the first one)."""
        self.outstanding -= 1
        if self.settled:
            return False
        self.settled = True
        return True

    def error_arrived(self, err: BKError) -> bool:
        """A replica failed or denied: whether to penalize it (a fault, not a denial). A late
        fault after the read settled still marks the bookie slow."""
        self.outstanding -= 1
        if not self.settled:
            self.errors.append(err)
        return not isinstance(err, DENIALS)

    @property
    def exhausted(self) -> bool:
        """Unsettled, every replica asked and every answer in: the read failed."""
        return not self.settled and self.next >= len(self.replicas) and self.outstanding == 0

    def failure(self) -> BKError:
        """The read's error once exhausted (it is then settled): NoSuchEntryError if every
        replica denied the entry, else the last fault's class, naming the entry."""
        self.settled = True
        if all(isinstance(e, DENIALS) for e in self.errors):
            return NoSuchEntryError(f"entry {self.ledger_id}:{self.entry_id} not found on its write set")
        last = next(e for e in reversed(self.errors) if not isinstance(e, DENIALS))
        return type(last)(f"entry {self.ledger_id}:{self.entry_id}: every replica failed: {last}")
