"""The bookie's decisions as tables: disk thresholds with hysteresis, the journal pool counted as
free and given back, the read-only state (with the operator's maintenance switch), which
compaction a GC pass runs; and the deleted-ledger finder against a real ZooKeeper.

Reference: Apache BookKeeper LedgerDirsMonitor (warn / threshold / low-water mark),
BookieStateManager, GarbageCollectorThread (minor / major compaction); docs/operations.md.
"""
from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable

import pytest

from bookkeeper.bookie.gc import DeletedLedgerFinder, FinderStats, compaction_plan
from bookkeeper.bookie.storage.ledger_storage import HeldBucket
from bookkeeper.bookie.metrics import Histogram, families
from bookkeeper.bookie.state import (MANUAL_REASON, READONLY, WRITABLE, DirState, JournalSpace, bookie_state,
                                    journal_space, next_dir_state)
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.testing.zookeeper import ZooKeeperServer

T = {"warn": 0.90, "threshold": 0.95, "lwm": 0.85}


@pytest.mark.parametrize("was_full, usage, full, warned", [
    (False, 0.10, False, False),
    (False, 0.90, False, True),    # warned only
    (False, 0.9499, False, True),
    (False, 0.95, True, True),     # at the threshold: full
    (True, 0.94, True, True),      # full stays full above the low-water mark ...
    (True, 0.85, True, False),     # ... and at it
    (True, 0.8499, False, False),  # under it: writable again
    (False, 1.0, True, True),
])
def test_dir_state_has_hysteresis(was_full: bool, usage: float, full: bool, warned: bool) -> None:
    now = next_dir_state(DirState("/d", "ledger", full=was_full), usage, **T)
    assert (now.full, now.warned, now.usage, now.path, now.kind) == (full, warned, usage, "/d", "ledger")


def _dirs(journal_full: bool, *ledger_full: bool) -> list[DirState]:
    return [DirState("/j", "journal", 0.99 if journal_full else 0.5, journal_full),
            *(DirState(f"/l{i}", "ledger", 0.99 if f else 0.5, f) for i, f in enumerate(ledger_full))]


MIB = 1 << 20
POOL = [("reuse-01", 4 * MIB), ("reuse-02", 4 * MIB), ("spare", 4 * MIB)]  # oldest first
J = {"warn": 0.4, "lwm": 0.3}


@pytest.mark.parametrize("free_mib, pool_mib, own, pooling, want", [
    # under lwm: nothing released, pooling (back) on; usage counts every pooled byte as free
    (90, 0, POOL, False, JournalSpace(0.10, (), True)),
    (90, 8, POOL, True, JournalSpace(0.02, (), True)),
    # between lwm and warn: nothing released, pooling as it was (hysteresis)
    (65, 12, POOL, True, JournalSpace(0.23, (), True)),
    (65, 12, POOL, False, JournalSpace(0.23, (), False)),
    # at warn (raw 40%): oldest first until the raw share is under warn, pooling off
    (60, 12, POOL, True, JournalSpace(0.28, ("reuse-01",), False)),
    (57, 12, POOL, True, JournalSpace(0.31, ("reuse-01",), False)),    # 43% - 4 MiB = 39%
    (55, 12, POOL, True, JournalSpace(0.33, ("reuse-01", "reuse-02"), False)),  # 45% - 4 = 41%: one more
    # far past: the whole pool, and the usage the thresholds see is still the raw share less the pool
    (20, 12, POOL, True, JournalSpace(0.68, ("reuse-01", "reuse-02", "spare"), False)),
    # a full disk whose only content is pool: counted as nearly empty (it never holds a bookie read-only)
    (0, 100, POOL, True, JournalSpace(0.0, ("reuse-01", "reuse-02", "spare"), False)),
    # other shards' pools count as free too, but only the caller's own files are its to release
    (20, 24, [], True, JournalSpace(0.56, (), False)),
    (20, 24, POOL[:1], True, JournalSpace(0.56, ("reuse-01",), False)),
])
def test_journal_space_counts_the_pool_as_free_and_releases_it_oldest_first(
        free_mib: int, pool_mib: int, own: list[tuple[str, int]], pooling: bool, want: JournalSpace) -> None:
    """Reference: issue 22 item 2 (the pool must never hold a bookie read-only); a 100 MiB disk."""
    got = journal_space(total_bytes=100 * MIB, free_bytes=free_mib * MIB, pool_bytes=pool_mib * MIB, own_pool=own,
                        pooling=pooling, **J)
    assert (got.release, got.pooling) == (want.release, want.pooling)
    assert got.usage == pytest.approx(want.usage)


def test_journal_space_of_an_unmeasurable_disk_is_full() -> None:
    assert journal_space(total_bytes=0, free_bytes=0, pool_bytes=0, **J) == JournalSpace(1.0, (), False)


@pytest.mark.parametrize("forced, decom, dirs, failed, state, reason", [
    (False, False, _dirs(False, False), {}, WRITABLE, None),
    (True, False, _dirs(False, False), {}, READONLY, "configuration"),
    (False, True, _dirs(False, False), {}, READONLY, "decommissioned"),
    (False, False, _dirs(True, False), {}, READONLY, "journal dir /j"),
    (False, False, _dirs(False, True), {}, READONLY, "every ledger dir is full"),
    (False, False, _dirs(False, True, False), {}, WRITABLE, None),   # one dir with room: new logs go there
    (False, False, _dirs(False, True, True), {}, READONLY, "every ledger dir is full"),
    (False, False, _dirs(False, False), {1: "journal failed: ENOSPC"}, READONLY, "shard 1 failed: journal failed"),
    (False, False, _dirs(False, False), {2: "b", 0: "a"}, READONLY, "shard 0 failed: a"),
    (True, True, _dirs(True, True), {0: "x"}, READONLY, "configuration"),  # the first rule's reason is given
    (False, True, _dirs(True, False), {}, READONLY, "decommissioned"),
])
def test_bookie_state(forced: bool, decom: bool, dirs: list[DirState], failed: dict[int, str], state: str,
                      reason: str | None) -> None:
    got_state, got_reason = bookie_state(forced=forced, decommissioning=decom, dirs=dirs, failed_shards=failed)
    assert got_state == state
    assert (got_reason is None) if reason is None else (reason in got_reason)


@pytest.mark.parametrize("manual, journal_full, decom, state, reason", [
    (True, False, False, READONLY, MANUAL_REASON),
    (True, True, False, READONLY, MANUAL_REASON),     # both hold: the switch is named first ...
    (False, True, False, READONLY, "journal dir /j"),  # ... and switched off, the full disk still holds
    (True, False, True, READONLY, MANUAL_REASON),
    (False, False, False, WRITABLE, None),             # writable only when neither holds
])
def test_maintenance_switch_combines_with_the_other_rules(manual: bool, journal_full: bool, decom: bool, state: str,
                                                          reason: str | None) -> None:
    got_state, got_reason = bookie_state(forced=False, decommissioning=decom, dirs=_dirs(journal_full, False),
                                         failed_shards={}, manual=manual)
    assert got_state == state
    assert (got_reason is None) if reason is None else (reason in got_reason)


P = {"minor_threshold": 0.2, "minor_interval_s": 3600.0, "major_threshold": 0.8, "major_interval_s": 86400.0}


@pytest.mark.parametrize("now, last_minor, last_major, force, overrides, plan", [
    (100.0, 0.0, 0.0, False, {}, None),                      # nothing due
    (3600.0, 0.0, 0.0, False, {}, ("minor", 0.2)),
    (86400.0, 0.0, 0.0, False, {}, ("major", 0.8)),           # both due: major covers minor
    (86400.0, 86000.0, 0.0, False, {}, ("major", 0.8)),
    (10.0, 0.0, 0.0, True, {}, ("major", 0.8)),               # an operator's pass runs the highest kind
    (10.0, 0.0, 0.0, True, {"major_threshold": 0.0}, ("minor", 0.2)),
    (86400.0, 0.0, 0.0, False, {"major_threshold": 0.0}, ("minor", 0.2)),
    (10.0, 0.0, 0.0, True, {"major_threshold": 0.0, "minor_threshold": 0.0}, None),  # both off
])
def test_compaction_plan(now: float, last_minor: float, last_major: float, force: bool,
                         overrides: dict[str, float], plan: tuple[str, float] | None) -> None:
    assert compaction_plan(now, last_minor=last_minor, last_major=last_major, force=force,
                           **{**P, **overrides}) == plan


def test_histogram_exposition_is_cumulative() -> None:
    h = Histogram((0.001, 0.01))
    h.observe(0.0005)
    h.observe(0.005, 3)
    h.observe(5.0)
    (fam,) = [f for f in families({0: {"histograms": {"add_entry_latency_seconds": h.snapshot()}}})
              if f.name == "bookkeeper_add_entry_latency_seconds"]
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.001": 1, "0.01": 4, "+Inf": 5}
    assert {s.name: s.value for s in fam.samples if not s.name.endswith("_bucket")} == pytest.approx(
        {"bookkeeper_add_entry_latency_seconds_count": 5, "bookkeeper_add_entry_latency_seconds_sum": 5.0155})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with ZooKeeperServer(tmp_path_factory.mktemp("zk")) as zk:
        s = ZkMetadataStore(zk.metadata_uri())
        try:
            yield s
        finally:
            s.close()


def _create(store: ZkMetadataStore, lid: int) -> None:
    store.create_ledger(LedgerMetadata(ledger_id=lid, ensemble_size=1, write_quorum=1, ack_quorum=1,
                                       digest=DigestType.CRC32C, password_digest="x", ensembles={0: ["b"]}))


def _held(lids: list[int], seen: dict[int, int]) -> dict[int, HeldBucket]:
    """The shard's held buckets for these ledgers; a ledger is given the next serial the first
    time it is held (as LedgerStorage does when a ledger is made)."""
    held: dict[int, HeldBucket] = {}
    for lid in lids:
        serial = seen.setdefault(lid, len(seen) + 1)
        bucket = held.setdefault(lid // 10_000, HeldBucket(array("H"), 0))
        bucket.add(lid % 10_000)
        bucket.created = max(bucket.created, serial)
    return held


def test_finder_reads_one_stat_per_bucket_and_lists_only_changed_buckets(store: ZkMetadataStore) -> None:
    """Held ledgers in two buckets: the first cycle lists both; an unchanged cycle only stats them;
    a deletion re-lists only its bucket (and confirms after a sync); a bucket emptied (and
    removed) drops all it held; a ledger created after a listing is never taken for deleted;
    ids never created are."""
    a = [10_000 + i for i in range(5)]   # bucket 00/0001
    b = [20_000 + i for i in range(3)]   # bucket 00/0002
    for lid in a + b:
        _create(store, lid)
    finder = DeletedLedgerFinder(store)
    seen: dict[int, int] = {}

    def find(lids: list[int]) -> tuple[list[int], FinderStats]:
        st = FinderStats()
        return sorted(finder.find(_held(lids, seen), st)), st
    gone, st = find(a + b)
    assert gone == [] and (st.stat_reads, st.list_reads) == (2, 2)
    gone, st = find(a + b)
    assert gone == [] and (st.stat_reads, st.list_reads, st.ledgers_touched) == (2, 0, 0)
    store.delete_ledger(a[0])
    gone, st = find(a + b)
    assert gone == [a[0]] and st.list_reads == 1 and st.syncs == 1
    late = 10_042
    _create(store, late)  # created after the last listing of its bucket: must be relisted, not dropped
    gone, st = find(a[1:] + b + [late])
    assert gone == [] and st.list_reads == 1
    never = 20_077  # a held id whose metadata never existed, in an unchanged bucket
    gone, _ = find(a[1:] + b + [late, never])
    assert gone == [never]
    for lid in b:
        store.delete_ledger(lid)  # the last one removes the bucket znode
    gone, _ = find(a[1:] + b + [late])
    assert gone == b
    for lid in b[:1]:
        _create(store, lid)  # the bucket made again: a fresh pzxid, never a stale listing
    gone, _ = find(a[1:] + [late, b[0]])
    assert gone == []


def test_the_loop_stall_and_blocked_split_the_lag_by_the_threads_schedstat() -> None:
    """LoopLag's stall and blocked histograms: a loop held 60 ms, during which its thread
    waited 45 ms for a CPU and ran 10 ms (as a schedstat reader says), records a lag of ~60
    ms, a stall of ~15 ms and a blocked time of ~5 ms; a wait longer than the lag records
    neither. With the real reader (this thread's /proc schedstat), a loop held by a sleep
    is blocked for most of the lag, and one held by a busy loop is not blocked at all."""
    import asyncio
    import time

    from bookkeeper.bookie.metrics import LoopLag
    from bookkeeper.metrics import LATENCY_BUCKETS_S

    def busy(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    class Seen(Histogram):  # each observation in order: a busy machine may add later probes
        def __init__(self) -> None:
            super().__init__(LATENCY_BUCKETS_S)
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            super().observe(value)
            self.seen.append(value)

    async def run(hold: Callable[[float], None], reads: list[tuple[int, int]] | None) -> list[float]:
        """The first probe's (lag, stall, blocked): the one the hold made late."""
        hs = [Seen() for _ in range(3)]
        it = None if reads is None else itertools.chain(reads, itertools.repeat(reads[-1]))
        probe = LoopLag(asyncio.get_running_loop(), hs[0], lambda: 1, period_s=0.01, stall=hs[1], blocked=hs[2],
                        schedstat_ns=None if it is None else lambda: next(it))
        probe.start()
        hold(0.07)  # at once: the loop held until ~60 ms past the first probe's due time
        await asyncio.sleep(0.001)  # the late probe runs
        probe.stop()
        return [h.seen[0] for h in hs]

    lag, stall, blocked = asyncio.run(run(time.sleep, [(0, 0), (10_000_000, 45_000_000)]))
    assert 0.055 <= lag < 0.2
    assert stall == pytest.approx(lag - 0.045) and blocked == pytest.approx(lag - 0.055)
    _lag, stall, blocked = asyncio.run(run(time.sleep, [(0, 0), (0, 500_000_000)]))
    assert stall == blocked == 0.0

    lag, _stall, blocked = asyncio.run(run(time.sleep, None))
    assert blocked >= 0.03, (lag, blocked)  # asleep: neither on a CPU nor queued
    lag, _stall, blocked = asyncio.run(run(busy, None))
    assert lag >= 0.055 and blocked == 0.0, (lag, blocked)  # on a CPU or queued for one
