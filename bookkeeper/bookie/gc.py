"""Garbage collection of one shard: which ledgers were deleted, when to compact, and the pass.

Lives in: a shard process (the finder runs in a worker thread: its ZooKeeper reads block),
and the simulator's shards (bookkeeper/testing/sim), which run the same pass on virtual time.

Finding deleted ledgers without listing ZooKeeper (Reference: Apache BookKeeper's
ScanAndCompareGarbageCollector lists every ledger each cycle). Ledger metadata lives in
buckets of up to 10^4 znodes (`<root>/AA/BBBB/LCCCC`, docs/metadata.md). A bucket's
`pzxid` is the zxid of its last child create or delete, and zxids never repeat. So a
shard remembers, per bucket it holds ledgers in, the pzxid and the ids listed at that
pzxid; each cycle it reads only the bucket's stat, and lists the bucket again only when
the pzxid moved. A held ledger absent from a listing whose pzxid has not moved since does
not exist: its metadata was not there and nothing was created since. Per cycle that is one
`exists` per bucket held (at 10^6 ledgers with dense ids: 100), plus one `getChildren` per
bucket changed since the last cycle (a listing is at most 10^4 names, ~80 KB).
Memory: the sorted 4-digit suffixes per bucket, 2 bytes per ledger listed.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from array import array
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bookkeeper.meta.zk import ZkMetadataStore

if TYPE_CHECKING:
    from bookkeeper.bookie.storage.ledger_storage import LedgerStorage

log = logging.getLogger(__name__)

BUCKET_SPAN = 10_000  # ledgers per bucket: the last 4 digits of the id
TOMBSTONE_S = 7 * 86400  # how long a fenced, deleted ledger's adds stay refused (Apache: a week)


@dataclass(slots=True)
class FinderStats:
    """ZooKeeper reads of one cycle (for the operator: what GC costs)."""

    stat_reads: int = 0
    list_reads: int = 0


@dataclass(slots=True)
class DeletedLedgerFinder:
    """Remembers bucket listings across cycles; `find` returns the held ledgers that are gone."""

    store: ZkMetadataStore
    _buckets: dict[str, tuple[int, array]] = field(default_factory=dict)

    def find(self, held: Iterable[int]) -> tuple[list[int], FinderStats]:
        groups: dict[str, list[int]] = defaultdict(list)
        for lid in held:
            groups[self.store.ledger_bucket(lid)].append(lid)
        gone: list[int] = []
        stats = FinderStats()
        for bucket, lids in groups.items():
            listed = self._listed(bucket, stats)
            if listed is None:
                gone.extend(lids)
                continue
            for lid in lids:
                suffix = lid % BUCKET_SPAN
                i = bisect_left(listed, suffix)
                if i == len(listed) or listed[i] != suffix:
                    gone.append(lid)
        for bucket in [b for b in self._buckets if b not in groups]:
            del self._buckets[bucket]  # holds nothing there any more
        return gone, stats

    def _listed(self, bucket: str, stats: FinderStats) -> array | None:
        """The bucket's suffixes as of its current pzxid (None: the bucket is gone)."""
        stats.stat_reads += 1
        version = self.store.bucket_version(bucket)
        cached = self._buckets.get(bucket)
        if version is None:
            self._buckets.pop(bucket, None)
            return None
        if cached is not None and cached[0] == version:
            return cached[1]
        stats.list_reads += 1
        listing = self.store.bucket_ledgers(bucket)
        if listing is None:
            self._buckets.pop(bucket, None)
            return None
        version, suffixes = listing
        listed = array("H", suffixes)
        self._buckets[bucket] = (version, listed)
        return listed


def compaction_plan(now: float, *, last_minor: float, last_major: float, force: bool,
                    minor_threshold: float, minor_interval_s: float,
                    major_threshold: float, major_interval_s: float) -> tuple[str, float] | None:
    """Which compaction a GC pass runs: ("major" | "minor", live-share threshold) or None.

    Major (the higher threshold) includes what minor would do, so it wins when both are
    due; a threshold of 0 turns that kind off (as Apache BookKeeper); `force` (an
    operator's `bk bookie gc`) runs the highest enabled kind now.
    """
    if major_threshold > 0 and (force or now - last_major >= major_interval_s):
        return "major", major_threshold
    if minor_threshold > 0 and (force or now - last_minor >= minor_interval_s):
        return "minor", minor_threshold
    return None


@dataclass(frozen=True, slots=True)
class GcSettings:
    """A shard's compaction thresholds and intervals (the bookie config's), and its throttle."""

    minor_threshold: float
    minor_interval_s: float
    major_threshold: float
    major_interval_s: float
    rate_bytes_s: float = 0.0  # compaction copy rate; 0: unthrottled


class GarbageCollector:
    """One shard's GC passes: drop the ledgers whose metadata is gone (committed by a
    checkpoint before compaction looks), then compact the entry logs if due.

    What the shard gives it: its storage and loop; `store()` the ZooKeeper store to list
    ledgers with (None: unreachable now, the pass drops nothing); `checkpoint()` a
    checkpoint started after the call, run to its commit; `clock` and `wall_clock` (the
    tombstones' age; both virtual in a simulation);
    `should_stop` for a compaction under way; `counters` (the shard's, added to) and
    `observe_duration` (a compaction's seconds). Passes never overlap: an operator's forced
    pass waits for a periodic one and then runs.
    """

    def __init__(self, index: int, storage: LedgerStorage, loop: asyncio.AbstractEventLoop, *,
                 store: Callable[[], ZkMetadataStore | None], checkpoint: Callable[[], Awaitable[None]],
                 settings: GcSettings, clock: Callable[[], float], wall_clock: Callable[[], float],
                 should_stop: Callable[[], bool], counters: dict[str, int],
                 observe_duration: Callable[[float], None]) -> None:
        self.index = index
        self.storage = storage
        self.loop = loop
        self._store = store
        self._checkpoint = checkpoint
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock
        self._should_stop = should_stop
        self.counters = counters
        self._observe_duration = observe_duration
        self._finder: DeletedLedgerFinder | None = None
        self._lock = asyncio.Lock()
        self.compacting: asyncio.Future[Any] | None = None  # the worker thread's compaction, if any
        self._last_minor = self._last_major = clock()
        self.last_dropped: list[int] = []  # the ledgers the last pass dropped

    async def run(self, *, force: bool = False) -> dict[str, Any]:
        """One pass; what it did (the shape of `bk bookie gc`'s answer per shard)."""
        async with self._lock:
            t0 = self.clock()
            gone = await self._drop_deleted()
            now = self.clock()
            s = self.settings
            plan = compaction_plan(now, last_minor=self._last_minor, last_major=self._last_major, force=force,
                                   minor_threshold=s.minor_threshold, minor_interval_s=s.minor_interval_s,
                                   major_threshold=s.major_threshold, major_interval_s=s.major_interval_s)
            result: dict[str, Any] = {"shard": self.index, "ledgers_deleted": len(gone), "compaction": None,
                                      "logs_compacted": 0, "logs_deleted": 0, "entries_copied": 0,
                                      "bytes_copied": 0, "bytes_reclaimed": 0}
            if plan is not None:
                result.update(await self._compact(*plan))
                self._last_minor = now
                if plan[0] == "major":
                    self._last_major = now
            result["duration_s"] = round(self.clock() - t0, 3)
            return result

    async def _drop_deleted(self) -> list[int]:
        """Forget the ledgers whose metadata is gone, and commit that before compaction looks.
        The shard's ledgers are taken before the listing: a ledger's metadata is created
        before its first add reaches a bookie, so a ledger held then is in the listing."""
        self.last_dropped = []
        self.storage.prune_tombstones(self.wall_clock() - TOMBSTONE_S)
        held = list(self.storage.ledgers)
        if not held:
            return []

        def find() -> list[int] | None:
            store = self._store()
            if store is None:
                return None
            if self._finder is None or self._finder.store is not store:
                self._finder = DeletedLedgerFinder(store)
            return self._finder.find(held)[0]

        gone = await self.loop.run_in_executor(None, find)
        if not gone:
            return []
        now = self.wall_clock()
        for lid in gone:
            self.storage.delete_ledger(lid, now=now)
        log.info("shard %d: garbage-collected %d deleted ledger(s)", self.index, len(gone))
        self.counters["gc_ledgers_deleted"] += len(gone)
        self.last_dropped = gone
        await self._checkpoint()
        return gone

    async def _compact(self, kind: str, threshold: float) -> dict[str, Any]:
        """Compact entry logs under `threshold` live share in a worker thread, throttled."""
        self.compacting = self.loop.run_in_executor(None, functools.partial(
            self.storage.compact, threshold, rate_bytes_s=self.settings.rate_bytes_s, should_stop=self._should_stop))
        res = await asyncio.shield(self.compacting)  # a stop waits for the thread, never abandons it
        self.storage.release_logs(res.retired)
        self.counters["compaction_bytes_copied"] += res.bytes_copied
        self.counters["compaction_bytes_reclaimed"] += res.bytes_reclaimed
        self.counters["compaction_logs_deleted"] += res.logs_compacted + res.logs_deleted
        self._observe_duration(res.duration_s)
        if res.logs_compacted or res.logs_deleted:
            log.info("shard %d: %s compaction: %d log(s) compacted, %d deleted, %d bytes copied, %d reclaimed "
                     "in %.2fs", self.index, kind, res.logs_compacted, res.logs_deleted, res.bytes_copied,
                     res.bytes_reclaimed, res.duration_s)
        return {"compaction": kind, "logs_compacted": res.logs_compacted, "logs_deleted": res.logs_deleted,
                "entries_copied": res.entries_copied, "bytes_copied": res.bytes_copied,
                "bytes_reclaimed": res.bytes_reclaimed}
