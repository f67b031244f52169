"""Operator actions on one bookie: `bk recover` and `bk decommission` (Apache's
BookKeeperAdmin.recoverBookieData and decommissionBookie), done by the command itself:
they need no auto-recovery service to run.

Lives in: the `bk` command's event loop.

recover_bookie: scan every ledger's metadata for the bookie, mark each such ledger
(`forced`: workers elsewhere may help, and will not skip the bookie because it is up),
replicate each one under its lock (waiting while another worker holds it), take the
bookie off its mark, and scan again until no ledger names the bookie (a writer may have
been between ensembles during the first scan).

decommission_bookie: set the decommissioning marker (the live bookie's supervisor turns it
read-only: writers move off it, and no placement picks it), wait until it is registered
read-only, recover it as above, delete its cookie. The marker is cleared only if the bookie
is no longer registered: a running bookie whose marker went would turn writable again,
take new ledgers, and could not restart (its cookie is gone). Stop it, then run the
command again: it finds nothing to move and clears the marker.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from bookkeeper.autorecovery.replicator import (
    LedgerReplicator,
    LedgerResult,
    Outcome,
    ReplicationError,
    UnreplicableError,
)
from bookkeeper.autorecovery.scan import ledgers_on
from bookkeeper.client.client import BookKeeper
from bookkeeper.errors import AuthorizationError, BKError
from bookkeeper.meta.underreplication import UnderReplicationManager

RETRY_S = 0.5        # between passes over ledgers that wait (locked elsewhere, open in grace, failed)
MAX_PASSES = 5       # scans that each still found the bookie named: then give up, say so

OnLedger = Callable[[LedgerResult], None]
OnNote = Callable[[str], None]


class UnknownBookieError(BKError):
    """No cookie, registration, marker or ledger names this bookie id."""


@dataclass(frozen=True, slots=True)
class RecoverySummary:
    """What a recover_bookie() did, for the command's last line."""

    ledgers: int
    fragments: int
    entries: int
    seconds: float


async def bookie_known(bk: BookKeeper, bookie_id: str) -> bool:
    """Whether the cluster knows the bookie id: a cookie, a registration, or a decommission
    marker (a ledger naming it is checked by the scan)."""
    store = bk.store

    def look() -> bool:
        return (store.get_cookie(bookie_id) is not None or bookie_id in store.bookie_ids()
                or bookie_id in store.bookie_ids(readonly=True)
                or store.zk.exists(store.decommissioning_path(bookie_id)) is not None)
    return await bk.metadata_call(look)


async def _take_off_mark(bk: BookKeeper, urm: UnderReplicationManager, ledger_id: int, bookie_id: str) -> None:
    while True:
        mark = await bk.metadata_call(urm.get_mark, ledger_id)
        if mark is None or bookie_id not in mark.missing or await bk.metadata_call(urm.unmark, mark, [bookie_id]):
            return


async def require_admin(bk: BookKeeper, what: str) -> None:
    """Moving every copy of a bookie, or retiring it, is the `admin` role's (docs/security.md):
    the bookies say whether this client has it (WHOAMI); AuthorizationError before anything is
    written otherwise."""
    principal, roles = await bk.whoami(fresh=True)
    if "admin" not in roles:
        raise AuthorizationError(f"principal {principal!r} lacks role 'admin' (needed to {what})")


async def recover_bookie(bk: BookKeeper, bookie_id: str, *, grace_s: float, timeout_s: float,
                         on_ledger: OnLedger, on_note: OnNote) -> RecoverySummary:
    """Move every copy the bookie holds elsewhere; raises ReplicationError (or
    UnknownBookieError, before anything is written) if that cannot be done in timeout_s."""
    await require_admin(bk, f"recover {bookie_id}")
    t0 = time.monotonic()
    started = time.time()
    deadline = t0 + timeout_s
    urm = UnderReplicationManager(bk.store)
    replicator = LedgerReplicator(bk)
    known = await bookie_known(bk, bookie_id)
    pending = await ledgers_on(bk, bookie_id)
    if not known and not pending:
        raise UnknownBookieError(f"unknown bookie {bookie_id!r}: no cookie, registration, decommission marker or "
                                 f"ledger names it")
    await bk.metadata_call(urm.ensure_layout)
    ledgers = fragments = entries = 0
    said: dict[int, str] = {}  # ledger -> the last note printed about it: a retry loop says each once

    def note_once(ledger_id: int, message: str) -> None:
        if said.get(ledger_id) != message:
            said[ledger_id] = message
            on_note(message)

    for _ in range(MAX_PASSES):
        if not pending:
            return RecoverySummary(ledgers, fragments, entries, time.monotonic() - t0)
        on_note(f"{len(pending)} ledger(s) name {bookie_id}")
        for lid in pending:
            await bk.metadata_call(functools.partial(urm.mark, lid, [bookie_id], forced=True))
        while pending:
            waiting = []
            for lid in pending:
                result = await _one(bk, urm, replicator, lid, bookie_id, lambda: time.time() >= started + grace_s,
                                    note_once)
                if result is None or result.outcome is Outcome.DEFERRED:
                    if result is not None:
                        note_once(lid, f"ledger {lid}: open: its writer has {grace_s:.0f} s to move off "
                                       f"{bookie_id}, then it is fenced and recovered")
                    waiting.append(lid)
                    continue
                await _take_off_mark(bk, urm, lid, bookie_id)
                ledgers += 1
                fragments += result.fragments
                entries += result.entries
                on_ledger(result)
            pending = waiting
            if pending:
                if time.monotonic() > deadline:
                    raise ReplicationError(f"{len(pending)} ledger(s) still name {bookie_id} after {timeout_s:.0f} s: "
                                           f"{pending[:10]}")
                await asyncio.sleep(RETRY_S)
        pending = await ledgers_on(bk, bookie_id)
    raise ReplicationError(f"{len(pending)} ledger(s) still name {bookie_id} after {MAX_PASSES} scans: {pending[:10]}")


async def _one(bk: BookKeeper, urm: UnderReplicationManager, replicator: LedgerReplicator, ledger_id: int,
               bookie_id: str, grace_over: Callable[[], bool],
               note: Callable[[int, str], None]) -> LedgerResult | None:
    """Replicate one ledger under its lock; None if it must be tried again (locked elsewhere,
    or a failure worth retrying)."""
    if not await bk.metadata_call(urm.try_lock, ledger_id):
        note(ledger_id, f"ledger {ledger_id}: another worker is replicating it: waiting")
        return None
    try:
        return await replicator.replicate(ledger_id, {bookie_id}, grace_over=grace_over)
    except UnreplicableError:
        raise
    except ReplicationError as e:
        note(ledger_id, f"{e}; retrying")
        return None
    finally:
        await bk.metadata_call(urm.unlock, ledger_id)


async def decommission_bookie(bk: BookKeeper, bookie_id: str, *, grace_s: float, readonly_timeout_s: float,
                              timeout_s: float, on_ledger: OnLedger, on_note: OnNote) -> bool:
    """Decommission a live or stopped bookie; returns whether its marker was cleared (False:
    it is still registered, and stays read-only until it is stopped)."""
    await require_admin(bk, f"decommission {bookie_id}")
    store = bk.store
    if not await bookie_known(bk, bookie_id) and not await ledgers_on(bk, bookie_id):
        raise UnknownBookieError(f"unknown bookie {bookie_id!r}: no cookie, registration, decommission marker or "
                                 f"ledger names it")
    await bk.metadata_call(store.set_decommissioning, bookie_id)
    if bookie_id in await bk.metadata_call(store.bookie_ids):
        on_note(f"waiting for {bookie_id} to turn read-only")
        deadline = time.monotonic() + readonly_timeout_s
        while bookie_id in await bk.metadata_call(store.bookie_ids) or \
                bookie_id not in await bk.metadata_call(lambda: store.bookie_ids(readonly=True)):
            if time.monotonic() > deadline:
                await bk.metadata_call(store.clear_decommissioning, bookie_id)  # undo: nothing else was changed
                raise ReplicationError(f"bookie {bookie_id} did not turn read-only within {readonly_timeout_s:.0f} s "
                                       f"(is it running a version that watches the decommissioning marker?)")
            await asyncio.sleep(0.2)
        on_note(f"{bookie_id} is read-only")
    await recover_bookie(bk, bookie_id, grace_s=grace_s, timeout_s=timeout_s, on_ledger=on_ledger, on_note=on_note)
    await bk.metadata_call(store.delete_cookie, bookie_id)
    registered = bookie_id in await bk.metadata_call(store.bookie_ids) | await bk.metadata_call(lambda: store.bookie_ids(readonly=True))
    if not registered:
        await bk.metadata_call(store.clear_decommissioning, bookie_id)
    return not registered
