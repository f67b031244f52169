"""Garbage collection of one shard: which ledgers were deleted, when to compact, and the pass.

Lives in: a shard process (the finder runs in a worker thread: its ZooKeeper reads block),
and the simulator's shards (bookkeeper/testing/sim), which run the same pass on virtual time.

Finding deleted ledgers without listing ZooKeeper (Reference: Apache BookKeeper's
ScanAndCompareGarbageCollector lists every ledger each cycle). Ledger metadata lives in
buckets of up to 10^4 znodes (the parent of a ledger's znode, `ZkMetadataStore.ledger_bucket`;
ids `lid // BUCKET_SPAN` share one, docs/metadata.md). A bucket's `pzxid` is the zxid of its
last child create or delete, and zxids never repeat. The storage keeps the ledgers it holds
grouped by bucket as they are made and deleted (`LedgerStorage.buckets`), each group with the
serial of its last ledger made. A pass reads one stat per bucket held; a bucket whose pzxid
and serial are those of its last complete comparison costs nothing more: no ledger was
deleted there (pzxid) and none made here (serial), so every ledger held there was listed
then. Otherwise its held ledgers are compared with its listing (listed again only if the
pzxid moved). Per pass: one `exists` per bucket held (at 10^6 ledgers with dense ids: 100),
plus one `getChildren` per bucket changed; per-ledger work only in buckets that changed.
Memory: the sorted 4-digit suffixes per bucket listed, 2 bytes per ledger.

A ledger missing from a listing is dropped only once confirmed: `sync` on the bucket, then
its stat again (and its listing again if the pzxid moved). Why: a session's server may lag
the leader, and the first listing may miss a ledger created before its first add reached
this shard; after the sync, the server has every write committed before it, and every
ledger held was created in ZooKeeper before it (a client creates the metadata, then adds).
A pass drops nothing unless its whole scan succeeded: ZooKeeper trouble anywhere (or a
session not connected, on which kazoo would queue a request until ZooKeeper is back) fails
the pass with MetadataServiceError, and none of its comparisons is remembered (the next
pass compares those buckets again).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from array import array
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import KazooException, ZookeeperError

from bookkeeper.errors import MetadataServiceError
from bookkeeper.meta.zk import BUCKET_SPAN, ZkMetadataStore

if TYPE_CHECKING:
    from bookkeeper.bookie.storage.ledger_storage import HeldBucket, LedgerStorage

log = logging.getLogger(__name__)

TOMBSTONE_S = 7 * 86400  # how long a fenced, deleted ledger's adds stay refused (Apache: a week)


@dataclass(slots=True)
class FinderStats:
    """What one cycle cost (for the operator: what GC costs), counted as it goes, so a cycle
    that fails still says what it asked ZooKeeper."""

    buckets: int = 0  # buckets held, one stat each
    stat_reads: int = 0  # bucket stats (confirming ones included)
    list_reads: int = 0  # bucket listings (confirming ones included)
    syncs: int = 0  # ZooKeeper syncs before confirming an absence
    ledgers_touched: int = 0  # held ledgers compared with a listing (buckets that changed only)

    @property
    def zk_reads(self) -> int:
        """Every ZooKeeper request of the cycle (a sync is one too)."""
        return self.stat_reads + self.list_reads + self.syncs


@dataclass(slots=True)
class DeletedLedgerFinder:
    """Remembers bucket listings across cycles; `find` returns the held ledgers that are gone."""

    store: ZkMetadataStore
    _buckets: dict[str, tuple[int, array[int]]] = field(default_factory=dict)  # path -> (pzxid, suffixes listed)
    # bucket -> (pzxid, serial) of its last comparison in a cycle that succeeded
    _compared: dict[int, tuple[int, int]] = field(default_factory=dict)

    def find(self, held: Mapping[int, HeldBucket], stats: FinderStats) -> list[int]:
        """The held ledgers whose metadata is gone, each absence confirmed after a sync (module
        doc). `held`: the storage's buckets, read from this worker thread while the loop adds
        to them (a copy of a dict or of an array of ints is one step under the GIL)."""
        gone: list[int] = []
        compared: dict[int, tuple[int, int]] = {}
        paths = set()
        for bucket, ledgers in list(held.items()):
            path = self.store.ledger_bucket(bucket * BUCKET_SPAN)
            paths.add(path)
            serial = ledgers.created
            stats.buckets += 1
            listed = self._listed(path, stats)
            if listed is not None and (self._buckets[path][0], serial) == self._compared.get(bucket):
                compared[bucket] = self._compared[bucket]
                continue
            suffixes = set(ledgers.suffixes)  # after the serial: a ledger made between is compared again next cycle
            stats.ledgers_touched += len(suffixes)
            missing = suffixes.difference(listed) if listed is not None else suffixes
            if missing:
                # After the sync the listing is compared whole again: a held ledger deleted
                # between the two listings is gone too, and the pzxid recorded below is this
                # listing's (comparing only the first one's misses would skip it for good).
                listed = self._confirm(path, stats)
                if listed is not None:
                    missing = suffixes.difference(listed)
                base = bucket * BUCKET_SPAN
                gone.extend(base + suffix for suffix in sorted(missing))
            if listed is not None:
                compared[bucket] = (self._buckets[path][0], serial)
        self._compared = compared  # only now: a cycle that failed leaves the last good comparison
        for path in [p for p in self._buckets if p not in paths]:
            del self._buckets[path]  # holds nothing there any more
        return gone

    def _confirm(self, path: str, stats: FinderStats) -> array[int] | None:
        """The bucket's suffixes as of after a sync: ledgers missing there are gone."""
        self._online()
        stats.syncs += 1
        self.store.sync(path)
        return self._listed(path, stats)

    def _online(self) -> None:
        """Fail at once on a session that is not connected: kazoo would queue the request until
        ZooKeeper is back, holding the pass (and a forced one waiting for it) for the outage."""
        if not self.store.connected:
            raise MetadataServiceError("not connected to ZooKeeper")

    def _listed(self, bucket: str, stats: FinderStats) -> array[int] | None:
        """The bucket's suffixes as of its current pzxid (None: the bucket is gone)."""
        self._online()
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
    `should_stop` for a compaction under way; `counters` (the shard's, added to),
    `observe_duration` (a compaction's seconds) and `observe_pass` (a whole pass's seconds,
    failed ones included). Passes never overlap: an operator's forced pass waits for a
    periodic one and then runs.
    """

    def __init__(self, index: int, storage: LedgerStorage, loop: asyncio.AbstractEventLoop, *,
                 store: Callable[[], ZkMetadataStore | None], checkpoint: Callable[[], Awaitable[None]],
                 settings: GcSettings, clock: Callable[[], float], wall_clock: Callable[[], float],
                 should_stop: Callable[[], bool], counters: dict[str, int],
                 observe_duration: Callable[[float], None],
                 observe_pass: Callable[[float], None] = lambda _s: None) -> None:
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
        self._observe_pass = observe_pass
        self._finder: DeletedLedgerFinder | None = None
        self._lock = asyncio.Lock()
        self.compacting: asyncio.Future[Any] | None = None  # the worker thread's compaction, if any
        self._last_minor = self._last_major = clock()
        self.last_dropped: list[int] = []  # the ledgers the last pass dropped

    async def run(self, *, force: bool = False) -> dict[str, Any]:
        """One pass; what it did (the shape of `bk bookie gc`'s answer per shard; what each key
        means: docs/compaction.md). A pass whose ZooKeeper scan fails drops nothing, compacts
        nothing, and raises MetadataServiceError."""
        async with self._lock:
            t0 = self.clock()
            stats = FinderStats()
            try:
                gone = await self._drop_deleted(stats)
            except Exception:
                self.counters["gc_failures"] += 1
                self._observe_pass(self.clock() - t0)
                raise
            finally:
                self.counters["gc_zk_reads"] += stats.zk_reads
                self.counters["gc_ledgers_touched"] += stats.ledgers_touched
            now = self.clock()
            s = self.settings
            plan = compaction_plan(now, last_minor=self._last_minor, last_major=self._last_major, force=force,
                                   minor_threshold=s.minor_threshold, minor_interval_s=s.minor_interval_s,
                                   major_threshold=s.major_threshold, major_interval_s=s.major_interval_s)
            result: dict[str, Any] = {"shard": self.index, "ledgers_deleted": len(gone), "compaction": None,
                                      "logs_compacted": 0, "logs_deleted": 0, "entries_copied": 0,
                                      "bytes_copied": 0, "bytes_reclaimed": 0, "buckets_checked": stats.buckets,
                                      "zk_stats": stats.stat_reads, "zk_listings": stats.list_reads,
                                      "zk_syncs": stats.syncs, "zk_reads": stats.zk_reads,
                                      "ledgers_touched": stats.ledgers_touched,
                                      "drop_duration_s": round(now - t0, 3)}
            if plan is not None:
                result.update(await self._compact(*plan))
                self._last_minor = now
                if plan[0] == "major":
                    self._last_major = now
            duration = self.clock() - t0
            self._observe_pass(duration)
            result["duration_s"] = round(duration, 3)
            return result

    async def _drop_deleted(self, stats: FinderStats) -> list[int]:
        """Forget the ledgers whose metadata is gone, and commit that before compaction looks."""
        self.last_dropped = []
        self.storage.prune_tombstones(self.wall_clock() - TOMBSTONE_S)
        held = self.storage.buckets
        if not held:
            return []

        def find() -> list[int]:
            store = self._store()
            if store is None:
                return []
            if self._finder is None or self._finder.store is not store:
                self._finder = DeletedLedgerFinder(store)
            return self._finder.find(held, stats)

        try:
            gone = await self.loop.run_in_executor(None, find)
        except (KazooException, ZookeeperError, MetadataServiceError) as e:
            raise MetadataServiceError(f"shard {self.index}: GC pass dropped nothing: ZooKeeper: "
                                       f"{type(e).__name__} {e}") from e
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
