"""Garbage collection of one shard: which ledgers were deleted, and when to compact.

Lives in: a shard process (the finder runs in a worker thread: its ZooKeeper reads block).

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

from array import array
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from bookkeeper.meta.zk import ZkMetadataStore

BUCKET_SPAN = 10_000  # ledgers per bucket: the last 4 digits of the id


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
