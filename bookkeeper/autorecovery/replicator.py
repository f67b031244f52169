"""Re-replication of one ledger off a set of bookies (Apache's ReplicationWorker.rereplicate +
LedgerFragmentReplicator), on the asyncio client.

Lives in: the caller's event loop (the auto-recovery service's thread, or a `bk` command).

One step per round, each from freshly read metadata (policy.plan_ledger): copy one fragment,
or fence and close the ledger, or stop (done, or waiting for an open ledger's writer). A copy:
1. pick a replacement per slot with the client's placement (`replacement_ensemble`: writable
   bookies only, the rack rule kept where possible, bookies that failed lately avoided);
2. read every entry the slot holds (policy.slot_entries) from the other bookies of its write
   set (and, last, from the replaced bookie itself: a decommissioned one still serves reads),
   verify its digest with the ledger's password, write the stored bytes unchanged to the
   replacement with RECOVERY_ADD and the ledger's master key, COPY_WINDOW entries in flight;
3. compare-and-set the metadata with the slot replaced, only if the segment is still what was
   copied (same first entry, same bookies, same last entry); a lost race re-reads and checks
   again, a changed segment is planned again (the copy may be redone: never lost).

Uses the client's handle context on purpose (`ledger_metadata`, `write_metadata`, `pool`,
`quarantine`, `replacement_ensemble`): a replication is a metadata writer and a bookie
client of its own kind, like recovery, and the client package is not ours to change here.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bookkeeper.autorecovery.policy import Fragment, plan_ledger, segment_last_entry, slot_entries
from bookkeeper.client.client import BookKeeper
from bookkeeper.client.digest import DigestManager, master_key
from bookkeeper.client.core import write_set
from bookkeeper.errors import (
    BKError,
    DigestMismatchError,
    MetadataVersionError,
    NoSuchEntryError,
    NoSuchLedgerError,
)
from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState, check_password
from bookkeeper.meta.sealing import SealError
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.proto import Flag, Op

log = logging.getLogger(__name__)

COPY_WINDOW = 64          # entries in flight per fragment copy: bounded memory, pipelined bookies
MAX_ROUNDS = 1000         # steps per call: each copies a fragment or loses a race; a bound, not a goal
MAX_TARGET_FAILURES = 3   # replacements that fail a write, per call, before the ledger is retried later


class Outcome(enum.Enum):
    DONE = "done"            # no segment names the bookies any more
    DEFERRED = "deferred"    # the open last segment waits for its writer (grace)
    GONE = "gone"            # the ledger was deleted


class ReplicationError(BKError):
    """A ledger could not be re-replicated now (retried later)."""


class TargetError(ReplicationError):
    """The replacement bookie refused or failed a write: another one is picked."""


class UnreplicableError(ReplicationError):
    """A ledger that can never be re-replicated as it stands (no stored password)."""


@dataclass(slots=True)
class ReplicationStats:
    """Counters of one replicator's work (one event loop; read from other threads as ints)."""

    ledgers_replicated: int = 0
    fragments_replicated: int = 0
    entries_copied: int = 0
    bytes_copied: int = 0
    ledgers_recovered: int = 0     # open ledgers fenced and closed after their grace
    failures: int = 0
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class LedgerResult:
    """What one replicate() call did to one ledger (`bk recover` prints it)."""

    ledger_id: int
    outcome: Outcome
    fragments: int
    entries: int
    seconds: float


class LedgerReplicator:
    """Moves ledgers' copies off given bookies (the caller's event loop)."""

    def __init__(self, bk: BookKeeper, stats: ReplicationStats | None = None, *,
                 window: int = COPY_WINDOW) -> None:
        self.bk = bk
        self.stats = stats or ReplicationStats()
        self.window = window

    async def replicate(self, ledger_id: int, bookies: set[str], *,
                        grace_over: Callable[[], bool]) -> LedgerResult:
        """Replace `bookies` in every segment of the ledger that names them, as far as the
        ledger's state allows now (grace_over: whether an open ledger's writer had its time)."""
        t0 = time.monotonic()
        fragments = entries = steps = target_failures = 0
        for _ in range(MAX_ROUNDS):
            try:
                md = await self.bk.ledger_metadata(ledger_id)
            except NoSuchLedgerError:
                return LedgerResult(ledger_id, Outcome.GONE, fragments, entries, time.monotonic() - t0)
            plan = plan_ledger(md, bookies, grace_over=grace_over())
            if plan.done or (plan.wait and not plan.copy):
                self.stats.ledgers_replicated += bool(plan.done and steps)
                outcome = Outcome.DONE if plan.done else Outcome.DEFERRED
                return LedgerResult(ledger_id, outcome, fragments, entries, time.monotonic() - t0)
            steps += 1
            if plan.recover:
                await self._recover(md)
            elif plan.copy:
                try:
                    copied = await self._copy(md, plan.copy[0], bookies)
                except TargetError:
                    target_failures += 1
                    if target_failures >= MAX_TARGET_FAILURES:
                        raise
                    continue
                if copied is not None:
                    fragments += 1
                    entries += copied
            else:
                await self._drop_writer_ensembles(md)
        raise ReplicationError(f"ledger {ledger_id}: no progress after {MAX_ROUNDS} rounds")

    async def _recover(self, md: LedgerMetadata) -> None:
        """Fence and close an open ledger whose writer did not move off the bookie in time."""
        password = _password(md, self.bk.store)
        log.info("ledger %d: fencing and recovering it (its last segment names a bookie to replace)",
                 md.ledger_id)
        try:
            await self.bk.open_ledger(md.ledger_id, password=password, recovery=True)
        except NoSuchLedgerError:
            return  # deleted meanwhile: the next read says so
        self.stats.ledgers_recovered += 1

    async def _drop_writer_ensembles(self, md: LedgerMetadata) -> None:
        """A closed ledger keeps the fenced writer's segments only as history: drop them once
        they are all that still names a replaced bookie (no reader of a closed ledger uses them)."""
        try:
            await self.bk.write_metadata(md.replace(writer_ensembles=None))
        except MetadataVersionError:
            pass  # planned again from a fresh read

    async def _copy(self, md: LedgerMetadata, frag: Fragment, bookies: set[str]) -> int | None:
        """Copy one fragment to replacements and switch the metadata; the entries copied, or
        None if the segment changed meanwhile (planned again)."""
        password = _password(md, self.bk.store)
        new = await self.bk.replacement_ensemble(md, list(frag.ensemble), list(frag.slots), set(bookies))
        key = master_key(password)
        digest = DigestManager(md.ledger_id, md.digest, password)
        copied = 0
        for slot in frag.slots:
            entries = slot_entries(frag.first_entry_id, frag.last_entry_id, slot, ensemble_size=md.ensemble_size,
                                   write_quorum=md.write_quorum)
            copied += await self._copy_slot(md, frag, slot, new[slot], entries, key, digest, bookies)
        if not await self._switch(md.ledger_id, frag, new):
            return None
        self.stats.fragments_replicated += 1
        log.info("ledger %d: entries %d..%d moved from %s to %s (%d copied)", md.ledger_id, frag.first_entry_id,
                 frag.last_entry_id, [frag.ensemble[s] for s in frag.slots], [new[s] for s in frag.slots], copied)
        return copied

    async def _copy_slot(self, md: LedgerMetadata, frag: Fragment, slot: int, target: str, entries: Iterable[int],
                         key: bytes, digest: DigestManager, bookies: set[str]) -> int:
        """Copy a slot's entries, `window` at a time (ids drawn lazily: a fragment may be huge)."""
        copied = 0
        it = iter(entries)
        while batch := list(itertools.islice(it, self.window)):
            sizes = await asyncio.gather(*(self._copy_entry(md, frag, slot, target, eid, key, digest, bookies)
                                           for eid in batch))
            copied += len(batch)
            self.stats.entries_copied += len(batch)
            self.stats.bytes_copied += sum(sizes)
        return copied

    async def _copy_entry(self, md: LedgerMetadata, frag: Fragment, slot: int, target: str, entry_id: int,
                          key: bytes, digest: DigestManager, bookies: set[str]) -> int:
        """One entry: a verified copy from a replica, written unchanged to the target."""
        payload = await self._read_verified(md, frag, slot, entry_id, key, digest, bookies)
        try:
            await self.bk.pool.call(target, Op.ADD_ENTRY, Flag.RECOVERY_ADD, md.ledger_id, entry_id, key, 0, payload,
                                    timeout_s=self.bk.config.add_timeout_s)
        except BKError as e:
            self.bk.quarantine.penalize(target)  # the next plan picks another replacement
            raise TargetError(f"ledger {md.ledger_id}: write of entry {entry_id} to {target} failed: {e}") from e
        return len(payload)

    async def _read_verified(self, md: LedgerMetadata, frag: Fragment, slot: int, entry_id: int, key: bytes,
                             digest: DigestManager, bookies: set[str]) -> bytes:
        """The stored bytes of an entry from the first replica whose copy passes its digest:
        the surviving bookies of its write set first, then the replaced ones (maybe alive)."""
        ws = [frag.ensemble[i] for i in write_set(entry_id, md.ensemble_size, md.write_quorum) if i != slot]
        sources = self.bk.health.order([b for b in ws if b not in bookies]) + [b for b in ws if b in bookies]
        sources.append(frag.ensemble[slot])
        errors: list[str] = []
        for bookie in sources:
            try:
                resp = await self.bk.pool.call(bookie, Op.READ_ENTRY, 0, md.ledger_id, entry_id, key,
                                               timeout_s=self.bk.config.read_timeout_s)
                digest.verify(resp[6], entry_id)
                return bytes(resp[6])
            except DigestMismatchError as e:
                log.warning("ledger %d entry %d: bad copy on %s: %s", md.ledger_id, entry_id, bookie, e)
                errors.append(f"{bookie}: digest mismatch")
            except (NoSuchEntryError, NoSuchLedgerError):
                errors.append(f"{bookie}: no such entry")
            except BKError as e:
                errors.append(f"{bookie}: {type(e).__name__}")
        raise ReplicationError(f"ledger {md.ledger_id}: entry {entry_id} has no readable copy ({'; '.join(errors)})")

    async def _switch(self, ledger_id: int, frag: Fragment, new: list[str]) -> bool:
        """CAS the replacement into the segment, if it is still the one copied; closed ledgers
        also lose writer_ensembles (history that would otherwise still name the bookie)."""
        while True:
            try:
                md = await self.bk.ledger_metadata(ledger_id)
            except NoSuchLedgerError:
                return False
            if md.state is LedgerState.IN_RECOVERY or md.ensembles.get(frag.first_entry_id) != list(frag.ensemble) \
                    or segment_last_entry(md, frag.first_entry_id) != frag.last_entry_id:
                return False  # a recovery began (it reads the writer's segments: leave them be) or the segment moved
            segments = dict(md.ensembles)
            segments[frag.first_entry_id] = list(new)
            changes: dict[str, object] = {"ensembles": segments}
            if md.is_closed:
                changes["writer_ensembles"] = None
            try:
                await self.bk.write_metadata(md.replace(**changes))
                return True
            except MetadataVersionError:
                continue


def _password(md: LedgerMetadata, store: ZkMetadataStore) -> bytes:
    """The ledger's stored password (unsealed with the store's private key), checked against its
    digest: without it nothing can be verified (MAC) nor written (master key)."""
    try:
        password = store.ledger_password(md)
    except SealError as e:
        raise UnreplicableError(f"{e}: it cannot be re-replicated here") from None
    if not check_password(password, md.password_digest):
        raise UnreplicableError(f"ledger {md.ledger_id}: its stored password does not match its password digest")
    return password
