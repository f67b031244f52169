"""The auditor: one per cluster, elected through ZooKeeper, marks the ledgers of lost bookies.

Lives in: the auto-recovery service's event loop (a bookie with `autorecovery = true`, or
`bk autorecovery run`). ZooKeeper calls run in the loop's executor.

Election (Apache's AuditorElector, without its herd): every candidate creates an ephemeral
sequential node under underreplication/auditorelection; the lowest sequence is the auditor;
every other candidate watches only its predecessor, and looks again when it goes (or every
audit_interval_s, in case a watch was lost with a session).

Audit cycle, on every registration change (a one-shot watch re-armed by each cycle's
reads) and at least every audit_interval_s: read the registrations (writable and read-only)
and the cookies (the bookies that should be there), feed them to the AbsenceClock, and for
bookies absent for lost_bookie_delay_s scan every ledger's metadata (scan.py) and mark each
ledger that names one (UnderReplicationManager.mark). A bookie that returns before the
delay costs nothing: no scan, no write. While auto-recovery is disabled nothing is marked
(the clocks keep running; marking happens once it is enabled again), as in Apache.

Bounds (constants, documented in docs/autorecovery.md): scan reads at most
SCAN_READS_PER_S, marks at most MARK_WRITES_PER_S (bursts of MARK_WRITES_BURST): a rack
that dies at once does not turn into a write storm on ZooKeeper.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bookkeeper.autorecovery.events import Poke, Switch, wait_any
from bookkeeper.autorecovery.policy import AbsenceClock, TokenBucket, ledger_bookies
from bookkeeper.autorecovery.scan import scan_metadata
from bookkeeper.client.client import BookKeeper
from bookkeeper.errors import BKError
from bookkeeper.meta.underreplication import UnderReplicationManager

log = logging.getLogger(__name__)

SCAN_READS_PER_S = 5000.0   # metadata reads per second while scanning (10^6 ledgers: ~200 s)
MARK_WRITES_PER_S = 100.0   # under-replication writes per second
MARK_WRITES_BURST = 20.0
RETRY_S = 1.0               # after a ZooKeeper error, before trying again


@dataclass(slots=True)
class AuditorStats:
    """What the auditor did (written on the service's loop, read as plain values elsewhere)."""

    is_auditor: bool = False
    terms: int = 0                 # times this candidate was elected
    audits: int = 0                # audit cycles run
    last_audit_ms: int | None = None
    scans: int = 0
    ledgers_scanned: int = 0
    ledgers_marked: int = 0
    zk_reads: int = 0              # reads made as auditor (cycles and scans)
    zk_writes: int = 0             # creates and sets made as auditor (marks and their buckets)
    absences_cancelled: int = 0    # bookies back before the delay: no work done
    pending: dict[str, float] = field(default_factory=dict)   # absent bookie -> seconds until lost
    lost: list[str] = field(default_factory=list)             # lost bookies whose ledgers were marked
    last_scan: dict[str, Any] | None = None


class Auditor:
    """A candidate for auditor; audits while elected (run() until stop)."""

    def __init__(self, bk: BookKeeper, urm: UnderReplicationManager, *, lost_bookie_delay_s: float,
                 audit_interval_s: float, stats: AuditorStats,
                 clock: Callable[[], float] = time.monotonic, bookie_id: str | None = None) -> None:
        self.bk = bk
        self.bookie_id = bookie_id  # the bookie this candidate runs in, named in its election node
        self.urm = urm
        self.delay_s = lost_bookie_delay_s
        self.interval_s = audit_interval_s
        self.stats = stats
        self.clock = clock
        self.node: str | None = None
        loop = asyncio.get_running_loop()
        self._poke = Poke(loop)
        self._reads = TokenBucket(SCAN_READS_PER_S, SCAN_READS_PER_S, now=clock())
        self._writes = TokenBucket(MARK_WRITES_PER_S, MARK_WRITES_BURST, now=clock())

    def session_lost(self) -> None:
        """The ZooKeeper session expired (loop thread): the election node went with it."""
        self._poke.event.set()

    async def run(self, stop: asyncio.Event, enabled: Switch) -> None:
        try:
            while not stop.is_set():
                try:
                    await self._stand(stop, enabled)
                except BKError as e:
                    log.warning("auditor: %s; retrying", e)
                    await wait_any([stop], RETRY_S)
                except Exception:  # a bug must not end auditing for the bookie's lifetime: said, retried
                    log.exception("auditor failed; retrying")
                    await wait_any([stop], RETRY_S)
        finally:
            self.stats.is_auditor = False
            if self.node is not None:
                await self.bk.metadata_call(self.urm.leave_election, self.node)
                self.node = None

    async def _stand(self, stop: asyncio.Event, enabled: Switch) -> None:
        """One look at the election: audit if first, else wait on the predecessor."""
        if self.node is None:
            self.node = await self.bk.metadata_call(self.urm.join_election, self.bookie_id)
            log.info("auditor candidate %s", self.node)
        self._poke.event.clear()
        candidates = await self.bk.metadata_call(self.urm.candidates)
        if self.node not in candidates:
            self.node = None  # our session expired and took the node: stand again
            return
        index = candidates.index(self.node)
        if index == 0:
            await self._term(stop, enabled)
            return
        if await self.bk.metadata_call(self.urm.watch_candidate, candidates[index - 1], self._poke.callback):
            await wait_any([stop, self._poke.event], self.interval_s)

    async def _term(self, stop: asyncio.Event, enabled: Switch) -> None:
        """Audit until stopped or no longer first (session lost)."""
        node = self.node
        assert node is not None
        log.info("%s is the auditor", node)
        self.stats.is_auditor = True
        self.stats.terms += 1
        absence = AbsenceClock(self.delay_s)
        try:
            while not stop.is_set():
                changed = enabled.changed
                self._poke.event.clear()
                if not await self.bk.metadata_call(self.urm.watch_candidate, node, None):
                    self.node = None
                    return
                await self._cycle(absence, enabled.value, stop)
                wait = self.interval_s
                nxt = absence.next_due_in(self.clock())
                if nxt is not None:
                    wait = min(wait, nxt + 0.01)
                await wait_any([stop, self._poke.event, changed], wait)
        finally:
            self.stats.is_auditor = False

    async def _cycle(self, absence: AbsenceClock, enabled: bool, stop: asyncio.Event) -> None:
        """Registrations and cookies (4 reads with the leadership check), then the lost ones."""
        store = self.bk.store
        writable = await self.bk.metadata_call(lambda: store.bookie_ids(watch=self._poke.callback))
        readonly = await self.bk.metadata_call(lambda: store.bookie_ids(readonly=True, watch=self._poke.callback))
        known = set(await self.bk.metadata_call(store.list_cookies))
        self.stats.zk_reads += 4
        now = self.clock()
        absence.observe(now, known=known, registered=writable | readonly)
        due = absence.due(now)
        if due and enabled:
            if await self._scan_and_mark(due, stop):
                absence.handed(due)
        self.stats.audits += 1
        self.stats.last_audit_ms = int(time.time() * 1000)
        self.stats.absences_cancelled = absence.cancelled
        self.stats.pending = {b: round(s, 3) for b, s in absence.pending(self.clock()).items()}
        self.stats.lost = sorted(absence.lost)

    async def _throttled_reads(self, n: int) -> None:
        self.stats.zk_reads += n
        wait = self._reads.take(self.clock(), n)
        if wait:
            await asyncio.sleep(wait)

    async def _scan_and_mark(self, lost: set[str], stop: asyncio.Event) -> bool:
        """Mark every ledger naming a lost bookie; False if interrupted (tried again later)."""
        log.warning("bookie(s) %s lost (absent for %.1f s): scanning ledgers", sorted(lost), self.delay_s)
        t0, reads0, writes0 = time.monotonic(), self.stats.zk_reads, self.stats.zk_writes
        scanned = marked = 0
        async for mds in scan_metadata(self.bk, before_reads=self._throttled_reads):
            if stop.is_set() or self.node is None:
                return False
            for md in mds:
                refs = lost & ledger_bookies(md)
                if not refs:
                    continue
                wait = self._writes.take(self.clock())
                if wait:
                    await asyncio.sleep(wait)
                writes = await self.bk.metadata_call(self.urm.mark, md.ledger_id, sorted(refs))
                self.stats.zk_writes += writes
                marked += bool(writes)
            scanned += len(mds)
        self.stats.scans += 1
        self.stats.ledgers_scanned += scanned
        self.stats.ledgers_marked += marked
        self.stats.last_scan = {"bookies": sorted(lost), "ledgers_scanned": scanned, "ledgers_marked": marked,
                                "zk_reads": self.stats.zk_reads - reads0, "zk_writes": self.stats.zk_writes - writes0,
                                "seconds": round(time.monotonic() - t0, 3)}
        log.warning("lost bookie(s) %s: %d ledger(s) scanned, %d marked under-replicated", sorted(lost), scanned,
                    marked)
        return True
