"""A ledger recovery's decisions (sans-I/O; the shell is `recover()` in bookkeeper.client.ledger).

Recovery (Reference: Apache BookKeeper's ledger recovery; why it is safe: docs/architecture.md,
"Recovery"): 1. the metadata goes OPEN -> IN_RECOVERY (compare-and-set), noting the writer's
segments; 2. the last ensemble is fenced (READ_LAC with FENCE) until every write set has
fewer than Qa unfenced bookies; 3. from the highest LAC the fences returned, each next entry
is read from its write set (READ_ENTRY with FENCE): a valid copy is rewritten, Qw - Qa + 1
denials end the ledger; 4. the metadata is closed at the last entry found.

Events in: the metadata read, each fence's answer, each recovery read's answer. Decisions out:
the IN_RECOVERY metadata to write, where to fence and read (the writer's view), whether the
answers so far settle a fence or a read, and what they settle it to. The shell sends, waits,
verifies digests, and rewrites through a recovery write handle (WriterCore again).
"""
from __future__ import annotations

from bookkeeper.client.core.quorum import entry_missing, fence_covered, write_set
from bookkeeper.client.core.reads import DENIALS
from bookkeeper.errors import RecoveryError
from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState
from bookkeeper.proto import Flag

def recovery_proposal(md: LedgerMetadata) -> LedgerMetadata | None:
    """The metadata that starts a recovery of an OPEN ledger: IN_RECOVERY, with the writer's
    segments as it left them (None: already IN_RECOVERY or CLOSED, nothing to write)."""
    if md.state is not LedgerState.OPEN:
        return None
    return md.replace(state=LedgerState.IN_RECOVERY, writer_ensembles=dict(md.ensembles))


def writer_view(md: LedgerMetadata) -> LedgerMetadata:
    """What recovery fences and reads: the fenced writer's segments as they were when recovery
    began. Segments a recovery rewrote since (an interrupted or concurrent one) must not be read
    as the writer's: a replacement bookie's "no such entry" is no evidence that the writer's
    entry was never acknowledged. It is also where the rewrites start from: the entries up to
    the fenced LAC live there, and this recovery may see a higher LAC than an interrupted one
    did, so a replacement segment may begin at or below it."""
    return md.replace(ensembles=dict(md.writer_ensembles or md.ensembles))


def acknowledged_floor(view: LedgerMetadata) -> int:
    """An entry the writer's segments alone prove acknowledged: the one before its last
    segment. A segment starts at the writer's LAC + 1 at its ensemble change, so every entry
    before it was acknowledged, whatever the fenced bookies say (a new segment's bookies
    answer LAC -1 until an add reaches them)."""
    return max(view.ensembles) - 1


class FenceVote:
    """The answers to a recovery's fences, one per bookie of the writer's last ensemble."""

    flags = Flag.FENCE  # READ_LAC with FENCE: the bookie takes no plain add of the ledger again
    __slots__ = ("ledger_id", "bookies", "e", "qw", "qa", "lacs", "errors", "floor")

    def __init__(self, view: LedgerMetadata) -> None:
        self.ledger_id = view.ledger_id
        self.bookies: list[str] = list(view.last_ensemble)
        self.floor = acknowledged_floor(view)
        self.e, self.qw, self.qa = view.ensemble_size, view.write_quorum, view.ack_quorum
        self.lacs: dict[int, int] = {}
        self.errors: dict[int, BaseException] = {}

    def answer(self, idx: int, lac: int | None, err: BaseException | None = None) -> bool:
        """Bookie idx answered its fence (its LAC) or failed (err); True once it is decided."""
        if err is None:
            assert lac is not None
            self.lacs[idx] = lac
        else:
            self.errors[idx] = err
        return self.decided

    @property
    def covered(self) -> bool:
        """Every write set has fewer than Qa unfenced bookies: the old writer can no longer be
        acknowledged (a hung bookie need not answer once the rest settle it)."""
        return fence_covered(set(self.lacs), ensemble_size=self.e, write_quorum=self.qw, ack_quorum=self.qa)

    @property
    def decided(self) -> bool:
        return self.covered or len(self.lacs) + len(self.errors) == len(self.bookies)

    def outcome(self) -> int:
        """Where recovery reads on from: the highest LAC the fenced bookies know, and never
        below the writer's last segment (apache/bookkeeper#2615: read from the LAC -1 of a
        fresh segment, recovery rewrote every earlier segment, and an ensemble change during
        those rewrites started a segment below the last one). RecoveryError if too few fences
        landed."""
        if not self.covered:
            errs = [self.errors[i] for i in sorted(self.errors)]
            raise RecoveryError(f"recovery of ledger {self.ledger_id}: could not fence enough bookies: {errs[:3]}")
        return max(max(self.lacs.values(), default=-1), self.floor)


class EntryVote:
    """The answers to a recovery read of one entry from its write set (in the writer's view)."""

    # READ_ENTRY with FENCE too: a bookie whose fence was lost or slow is fenced by the read,
    # so no write set keeps Qa bookies that could still acknowledge the old writer's next
    # entry after recovery read past it (apache/bookkeeper#2614).
    flags = Flag.FENCE
    __slots__ = ("ledger_id", "entry_id", "bookies", "qw", "qa", "found", "denied", "errors")

    def __init__(self, view: LedgerMetadata, entry_id: int) -> None:
        ensemble = view.ensemble_for(entry_id)
        self.ledger_id = view.ledger_id
        self.entry_id = entry_id
        self.bookies = [ensemble[i] for i in write_set(entry_id, view.ensemble_size, view.write_quorum)]
        self.qw, self.qa = view.write_quorum, view.ack_quorum
        self.found: bytes | None = None
        self.denied = 0
        self.errors: list[BaseException] = []

    def answer(self, data: bytes | None, err: BaseException | None = None) -> bool:
        """A replica answered: a copy whose digest held (data), or err (a denial is
        NoSuchEntry/NoSuchLedger; a bad copy is a DigestMismatchError). True once decided."""
        if err is None:
            assert data is not None
            if self.found is None:
                self.found = data
        elif isinstance(err, DENIALS):
            self.denied += 1
        else:
            self.errors.append(err)
        return self.decided

    @property
    def missing(self) -> bool:
        """Qw - Qa + 1 replicas deny it: an acknowledged entry is on Qa of them, so it never was."""
        return entry_missing(self.denied, write_quorum=self.qw, ack_quorum=self.qa)

    @property
    def decided(self) -> bool:
        return self.found is not None or self.missing

    def outcome(self) -> bytes | None:
        """The entry's data (to rewrite), None when it was never acknowledged (the ledger ends
        before it); RecoveryError when the answers settle neither."""
        if self.found is not None:
            return self.found
        if self.missing:
            return None
        raise RecoveryError(f"recovery of ledger {self.ledger_id}: entry {self.entry_id} is neither readable nor "
                            f"denied by enough bookies: {self.denied} denied, errors {self.errors[:3]}")
