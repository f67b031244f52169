"""The replication worker: takes one marked ledger at a time, moves it off its missing bookies.

Lives in: the auto-recovery service's event loop; every service runs one (Apache's
ReplicationWorker). Any number of workers share the marks: the ephemeral lock
underreplication/locks/L<id> keeps two off one ledger, and a dead worker's lock goes with
its session.

Loop: pick a marked ledger (buckets and their ledgers in random order, so workers spread
out), lock it, read its mark, replicate (replicator.py), then unmark it with a version check
(a bookie the auditor added to the mark meanwhile is not lost: the mark is read again) and
unlock. A ledger whose open last segment waits for its writer is left until its grace ends
(counted from the mark's `marked_ms`); a ledger that failed is retried after a backoff
that doubles up to RETRY_MAX_S. A missing bookie that is registered again (and was not
named by an operator, `forced`) is not replaced: its copies are back. Nothing is taken
while auto-recovery is disabled; the ledger in hand is finished.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time

from bookkeeper.autorecovery.events import Poke, Switch, wait_any
from bookkeeper.autorecovery.replicator import LedgerReplicator, Outcome, ReplicationStats, UnreplicableError
from bookkeeper.client.client import BookKeeper
from bookkeeper.errors import BKError, InternalError
from bookkeeper.meta.underreplication import Mark, UnderReplicationManager

log = logging.getLogger(__name__)

POLL_S = 1.0           # an idle worker lists the marks this often (and on a new bucket, at once)
RETRY_MIN_S = 2.0      # a ledger that failed is tried again after this, doubling ...
RETRY_MAX_S = 300.0    # ... up to this (also for ledgers that cannot be replicated at all)


class ReplicationWorker:
    """One worker (run() until stop); its counters are in `stats`."""

    def __init__(self, bk: BookKeeper, urm: UnderReplicationManager, *, grace_s: float,
                 stats: ReplicationStats) -> None:
        self.bk = bk
        self.urm = urm
        self.grace_s = grace_s
        self.stats = stats
        self.replicator = LedgerReplicator(bk, stats)
        self.current: int | None = None
        self._not_before: dict[int, float] = {}   # ledger -> monotonic time before which it is skipped
        self._backoff: dict[int, float] = {}
        self._poke = Poke(asyncio.get_running_loop())

    async def run(self, stop: asyncio.Event, enabled: Switch) -> None:
        while not stop.is_set():
            if not enabled.value:
                await wait_any([stop, enabled.changed], None)
                continue
            self._poke.event.clear()
            try:
                ledger_id = await self._claim()
            except BKError as e:
                log.warning("replication worker: cannot list under-replicated ledgers: %s", e)
                await wait_any([stop], POLL_S)
                continue
            if ledger_id is None:
                await wait_any([stop, self._poke.event, enabled.changed], POLL_S)
                continue
            try:
                await self._process(ledger_id)
            except Exception as e:  # a bug must not end the worker for the bookie's lifetime: said, backed off
                log.exception("ledger %d: replication failed unexpectedly", ledger_id)
                self._failed(ledger_id, InternalError(f"{type(e).__name__}: {e}"), RETRY_MAX_S)
            finally:
                self.current = None
                try:
                    await self.bk.metadata_call(self.urm.unlock, ledger_id)
                except BKError as e:  # the session is gone: so is the lock
                    log.warning("ledger %d: unlock failed: %s", ledger_id, e)

    async def _claim(self) -> int | None:
        """Lock some marked ledger that is not waiting; None if there is none."""
        now = time.monotonic()
        for lid in [lid for lid, t in self._not_before.items() if t <= now]:
            del self._not_before[lid]
        buckets = await self.bk.metadata_call(self.urm.buckets, self._poke.callback)
        random.shuffle(buckets)
        for bucket in buckets:
            ids = [lid for lid in await self.bk.metadata_call(self.urm.bucket_ledgers, bucket) if lid not in self._not_before]
            random.shuffle(ids)
            for lid in ids:
                if await self.bk.metadata_call(self.urm.try_lock, lid):
                    return lid
        return None

    async def _returned(self, mark: Mark) -> set[str]:
        """Missing bookies of the mark that are registered again and were not forced out."""
        candidates = set(mark.missing) - set(mark.forced)
        if not candidates:
            return set()
        store = self.bk.store
        registered = await self.bk.metadata_call(store.bookie_ids) | await self.bk.metadata_call(lambda: store.bookie_ids(readonly=True))
        return candidates & registered

    async def _process(self, ledger_id: int) -> None:
        self.current = ledger_id
        try:
            mark = await self.bk.metadata_call(self.urm.get_mark, ledger_id)
            if mark is None:
                return  # done by another worker between listing and locking
            back = await self._returned(mark)
            if back:
                log.info("ledger %d: bookie(s) %s registered again: their copies are not replaced", ledger_id,
                         sorted(back))
            bookies = set(mark.missing) - back
            grace_ends = mark.marked_ms / 1000.0 + self.grace_s
            if bookies:
                result = await self.replicator.replicate(ledger_id, bookies,
                                                         grace_over=lambda: time.time() >= grace_ends)
                if result.outcome is Outcome.DEFERRED:
                    self._backoff.pop(ledger_id, None)
                    self._not_before[ledger_id] = time.monotonic() + max(0.0, grace_ends - time.time())
                    return
            if not await self.bk.metadata_call(self.urm.unmark, mark):
                log.info("ledger %d: its mark changed while it was replicated: looking again", ledger_id)
            self._backoff.pop(ledger_id, None)
        except UnreplicableError as e:
            self._failed(ledger_id, InternalError(f"{type(e).__name__}: {e}"), RETRY_MAX_S)
        except BKError as e:
            self._failed(ledger_id, e, min(RETRY_MAX_S, self._backoff.get(ledger_id, RETRY_MIN_S / 2) * 2))

    def _failed(self, ledger_id: int, err: BKError, retry_s: float) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"ledger {ledger_id}: {err}"
        self._backoff[ledger_id] = retry_s
        self._not_before[ledger_id] = time.monotonic() + retry_s
        log.warning("ledger %d: re-replication failed (%s: %s); retrying in %.0f s", ledger_id, type(err).__name__,
                    err, retry_s)
