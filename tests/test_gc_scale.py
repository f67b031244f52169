"""GC, checkpoints and deletes cost what changed (issue 26 part 3), on a real ZooKeeper and a
real LedgerStorage on disk.

What is counted, never timed: ledgers a GC pass compares with a listing and the ZooKeeper
requests it makes (its result), ledgers a checkpoint compares (`Snapshot.examined`), write-cache
keys a delete visits, LMDB write transactions a flush makes. Faked only where the fault is
the point: a ZooKeeper server that lags (LaggingStore: the reads of a real store answered
as of an older state until a sync), and the C add path (an entry staged and the state
raised without telling the storage, as `shardpath.pyx:AddPath` does).
"""
from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import math
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bookkeeper.bookie.gc import GarbageCollector, GcSettings
from bookkeeper.bookie.storage import LedgerStorage
from bookkeeper.bookie.storage import ledger_storage
from bookkeeper.bookie.storage.ledger_storage import ENTRY_OVERHEAD_BYTES
from bookkeeper.errors import MetadataServiceError
from bookkeeper.meta.zk import BUCKET_SPAN, ZkMetadataStore, ledger_path
from bookkeeper.testing.zookeeper import ZooKeeperServer
from tests.conftest import run

KEY = b"k" * 20
NO_COMPACTION = GcSettings(minor_threshold=0.0, minor_interval_s=1.0, major_threshold=0.0, major_interval_s=1.0)
_roots = itertools.count()


@pytest.fixture(scope="module")
def zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    with ZooKeeperServer(tmp_path_factory.mktemp("zk")) as server:
        yield server


def _store(zk: ZooKeeperServer) -> ZkMetadataStore:
    return ZkMetadataStore(f"zk://{zk.connect_string}/gcscale{next(_roots)}", session_timeout_ms=4000)


def _make_znodes(store: ZkMetadataStore, lids: list[int]) -> None:
    """The ledgers' metadata znodes (what GC lists), made concurrently."""
    for parent in {store.ledger_bucket(lid) for lid in lids}:
        store.zk.ensure_path(parent)
    for pending in [store.zk.create_async(ledger_path(store.root, lid), b"") for lid in lids]:
        pending.get(timeout=30)


def _gc(storage: LedgerStorage, store: Any, counters: collections.Counter[str] | None = None) -> GarbageCollector:
    """A shard's GC as the shard makes it (no compaction), on the running loop."""
    loop = asyncio.get_running_loop()

    async def checkpoint() -> None:
        snap = storage.snapshot()
        await loop.run_in_executor(None, storage.flush, snap, (1, 0))
        storage.flush_done(snap)
    return GarbageCollector(0, storage, loop, store=lambda: store, checkpoint=checkpoint, settings=NO_COMPACTION,
                            clock=time.monotonic, wall_clock=time.time, should_stop=lambda: False,
                            counters=collections.Counter() if counters is None else counters,
                            observe_duration=lambda _s: None)


def _checkpoint(st: LedgerStorage, mark: int) -> None:
    snap = st.snapshot()
    st.flush(snap, (mark, 0))
    st.flush_done(snap)


# -- GC passes ----------------------------------------------------------------------
def test_a_pass_over_buckets_that_did_not_move_touches_no_ledger(zk: ZooKeeperServer, tmp_path: Path) -> None:
    """6,002 ledgers held in 4 buckets: the first pass compares all of them; the next one only
    stats the 4 buckets. Then a bucket that gained a ledger here is compared again without
    being listed (its pzxid did not move); one that lost a ledger in ZooKeeper is listed,
    synced, confirmed, and its ledger dropped; one whose every ledger was deleted (its znode
    with them) is synced and confirmed gone. The pass after that touches nothing again."""
    store = _store(zk)
    st = LedgerStorage(tmp_path / "s")
    lids = [b * BUCKET_SPAN + i for b in (1, 2, 3) for i in range(2000)] + [4 * BUCKET_SPAN, 4 * BUCKET_SPAN + 1]
    made_later = 2 * BUCKET_SPAN + 5000
    deleted = [3 * BUCKET_SPAN + 7, 4 * BUCKET_SPAN, 4 * BUCKET_SPAN + 1]
    _make_znodes(store, [*lids, made_later])
    for lid in lids:
        st.create_ledger(lid, KEY)

    async def main() -> list[dict[str, Any]]:
        gc = _gc(st, store)
        results = [await gc.run(), await gc.run()]
        st.create_ledger(made_later, KEY)  # its metadata was listed already: the pzxid stays
        for lid in deleted:
            await asyncio.get_running_loop().run_in_executor(None, store.delete_ledger, lid)
        results += [await gc.run(), await gc.run()]
        return results
    try:
        first, unchanged, changed, again = run(main())
    finally:
        store.close()
        st.close()
    assert (first["ledgers_touched"], first["zk_stats"], first["zk_listings"]) == (6002, 4, 4)
    assert unchanged["ledgers_touched"] == 0 and unchanged["zk_reads"] == unchanged["zk_stats"] == 4
    assert unchanged["buckets_checked"] == 4 and unchanged["ledgers_deleted"] == 0
    assert changed["ledgers_touched"] == 2001 + 2000 + 2 and changed["ledgers_deleted"] == 3
    assert (changed["zk_stats"], changed["zk_listings"], changed["zk_syncs"]) == (4 + 2, 1, 2)
    assert all(st.ledger(lid) is None for lid in deleted) and st.ledger(made_later) is not None
    assert again["ledgers_touched"] == 0 and again["zk_reads"] == again["buckets_checked"] == 3


class LaggingStore:
    """A real ZkMetadataStore on a session whose server lags: until a sync of a bucket, its
    stat and listing answer as of `stale` (pzxid, suffixes), as a follower behind the leader
    would. Everything else goes to the real store."""

    def __init__(self, store: ZkMetadataStore, stale: dict[str, tuple[int, list[int]]]) -> None:
        self.real = store
        self.stale = stale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def bucket_version(self, bucket: str) -> int | None:
        return self.stale[bucket][0] if bucket in self.stale else self.real.bucket_version(bucket)

    def bucket_ledgers(self, bucket: str) -> tuple[int, list[int]] | None:
        return self.stale[bucket] if bucket in self.stale else self.real.bucket_ledgers(bucket)

    def sync(self, path: str) -> None:
        self.real.sync(path)
        self.stale.pop(path, None)


def test_a_ledger_missing_from_a_lagging_listing_is_kept_until_a_synced_read_says_gone(
        zk: ZooKeeperServer, tmp_path: Path) -> None:
    """Reference: ZooKeeper's consistency guarantees (a read may be served by a lagging
    server; sync first). A ledger created after the listing the session's server still
    answers with is held here (its first add arrived): the pass syncs, reads the bucket
    again, finds it, and drops nothing. Deleted for real, it goes at the next pass."""
    store = _store(zk)
    st = LedgerStorage(tmp_path / "s")
    old, new = BUCKET_SPAN + 1, BUCKET_SPAN + 2
    _make_znodes(store, [old])
    bucket = store.ledger_bucket(old)
    listing = store.bucket_ledgers(bucket)
    assert listing is not None
    _make_znodes(store, [new])
    for lid in (old, new):
        st.create_ledger(lid, KEY)
    lagging = LaggingStore(store, {bucket: listing})

    async def main() -> None:
        gc = _gc(st, lagging)
        kept = await gc.run()
        assert kept["ledgers_deleted"] == 0 and st.ledger(new) is not None and kept["zk_syncs"] == 1, kept
        await asyncio.get_running_loop().run_in_executor(None, store.delete_ledger, new)
        dropped = await gc.run()
        assert dropped["ledgers_deleted"] == 1 and st.ledger(new) is None and st.ledger(old) is not None
    try:
        run(main())
    finally:
        store.close()
        st.close()


def test_a_pass_while_zookeeper_is_down_drops_nothing_and_fails_at_once(tmp_path: Path) -> None:
    """ZooKeeper stopped before a pass, then stopped in the middle of one (after the first
    bucket, whose deleted ledger was found and confirmed): each pass raises
    MetadataServiceError without waiting for ZooKeeper to come back, drops nothing, and
    counts a failure; with ZooKeeper back, the next pass drops the deleted ledgers."""
    with ZooKeeperServer(tmp_path / "zk") as server:
        store = _store(server)
        st = LedgerStorage(tmp_path / "s")
        lids = [b * BUCKET_SPAN + i for b in (1, 2) for i in range(10)]
        _make_znodes(store, lids)
        for lid in lids:
            st.create_ledger(lid, KEY)
        gone = [BUCKET_SPAN + 3, 2 * BUCKET_SPAN + 4]
        for lid in gone:
            store.delete_ledger(lid)
        counters: collections.Counter[str] = collections.Counter()

        def wait_connected(up: bool) -> None:
            deadline = time.monotonic() + 30
            while store.connected != up:
                assert time.monotonic() < deadline, f"session never {'connected' if up else 'dropped'}"
                time.sleep(0.05)

        class StopsAfterFirstConfirm(LaggingStore):
            """Stops the ZooKeeper server once, right after the first read that follows a sync
            (the first bucket's confirming stat) answered."""

            synced = False
            armed = True

            def bucket_version(self, bucket: str) -> int | None:
                version = self.real.bucket_version(bucket)
                if self.synced and self.armed:
                    self.armed = False
                    server.stop()
                    wait_connected(False)
                return version

            def sync(self, path: str) -> None:
                self.real.sync(path)
                self.synced = True

        async def main() -> None:
            loop = asyncio.get_running_loop()
            try:
                await passes(loop)
            finally:  # here, not after run(): a request kazoo queued must fail before the loop waits for it
                await loop.run_in_executor(None, store.close)

        async def passes(loop: asyncio.AbstractEventLoop) -> None:
            await loop.run_in_executor(None, server.stop)
            await loop.run_in_executor(None, wait_connected, False)
            gc = _gc(st, store, counters)
            with pytest.raises(MetadataServiceError, match="dropped nothing"):
                await asyncio.wait_for(gc.run(), 20)
            assert gc.last_dropped == [] and all(st.ledger(lid) is not None for lid in lids)
            await loop.run_in_executor(None, server.start)
            await loop.run_in_executor(None, wait_connected, True)
            gc = _gc(st, StopsAfterFirstConfirm(store, {}), counters)
            with pytest.raises(MetadataServiceError, match="dropped nothing"):
                await asyncio.wait_for(gc.run(), 20)
            assert gc.last_dropped == [] and all(st.ledger(lid) is not None for lid in lids)
            await loop.run_in_executor(None, server.start)
            await loop.run_in_executor(None, wait_connected, True)
            result = await asyncio.wait_for(gc.run(), 20)
            assert result["ledgers_deleted"] == 2 and sorted(gc.last_dropped) == gone
        try:
            run(main())
        finally:
            st.close()
    assert counters["gc_failures"] == 2 and counters["gc_ledgers_deleted"] == 2 and counters["gc_zk_reads"] > 0


# -- deletes ------------------------------------------------------------------------
class CountingDict(dict):  # type: ignore[type-arg]
    """A write cache that counts the keys anyone walks (iteration)."""

    visited = 0

    def __iter__(self) -> Iterator[Any]:
        for key in super().__iter__():
            self.visited += 1
            yield key


def test_a_delete_visits_none_of_the_other_ledgers_cached_entries(tmp_path: Path) -> None:
    """200 ledgers x 100 entries cached: deleting one walks none of the 20,000 cached keys.
    Its entries stay counted until the checkpoint, which skips them: after it the ledger has
    no index entry and every other entry reads back."""
    st = LedgerStorage(tmp_path / "s")
    st.write_cache = CountingDict()
    for lid in range(1, 201):
        st.create_ledger(lid, KEY)
        for e in range(100):
            st.put_entry(lid, e, b"%d-%d" % (lid, e) * 10, e - 1)
    st.write_cache.visited = 0
    st.delete_ledger(7, now=0.0)
    assert st.write_cache.visited <= 100  # at most its own entries
    assert st.write_cache_bytes == sum(len(v) + ENTRY_OVERHEAD_BYTES for v in st.write_cache.values())
    st.write_cache = dict(st.write_cache)  # the flush's encoder takes a dict exactly
    _checkpoint(st, 1)
    assert st.write_cache_bytes == 0 and st.get_entry(7, 0) is None and st.get_entry(7, 99) is None
    assert st.get_entry(8, 99) == b"8-99" * 10 and st.get_entry(200, 0) == b"200-0" * 10
    st.close()


def test_a_ledger_deleted_and_made_again_before_a_checkpoint_keeps_only_its_new_entries(tmp_path: Path) -> None:
    """A zombie writer's add makes a deleted ledger again before the checkpoint that deletes
    it: the checkpoint deletes the old ledger's index and row first, then writes the new one's
    entries and state; the old cached entries are gone. (The checkpoint used to delete after
    writing, losing the new ledger's entries and state.)"""
    st = LedgerStorage(tmp_path / "s")
    st.create_ledger(5, KEY)
    for e in range(10):
        st.put_entry(5, e, b"old-%d" % e, e - 1)
    _checkpoint(st, 1)
    st.put_entry(5, 10, b"old-10", 9)
    st.delete_ledger(5, now=0.0)
    st.create_ledger(5, b"n" * 20)
    for e in range(3):
        st.put_entry(5, e, b"new-%d" % e, e - 1)
    _checkpoint(st, 2)
    st.close()
    st = LedgerStorage(tmp_path / "s")
    state = st.ledger(5)
    assert state is not None and state.master_key == b"n" * 20 and state.last_entry == 2
    assert [st.get_entry(5, e) for e in range(11)] == [b"new-0", b"new-1", b"new-2"] + [None] * 8
    st.close()


def test_a_ledger_made_again_with_the_state_it_had_is_written_again(tmp_path: Path) -> None:
    """Deleted and made again before the next checkpoint with the very state its deleted
    incarnation had saved (same key, one entry 0): that checkpoint deletes the old row and
    must write the new one. Compared against what the index held for the old incarnation,
    it was taken for unchanged, and after a restart the ledger and its entry were gone."""
    st = LedgerStorage(tmp_path / "s")
    st.create_ledger(7, KEY)
    st.put_entry(7, 0, b"old", -1)
    _checkpoint(st, 1)
    st.delete_ledger(7, now=0.0)
    st.create_ledger(7, KEY)
    st.put_entry(7, 0, b"new", -1)
    _checkpoint(st, 2)
    st.close()
    st = LedgerStorage(tmp_path / "s")
    state = st.ledger(7)
    assert state is not None and state.last_entry == 0 and st.get_entry(7, 0) == b"new"
    st.close()


def test_a_stored_ledger_costs_a_shard_at_most_200_bytes(tmp_path: Path) -> None:
    """tracemalloc over 20,000 ledgers made, given an entry each (a fresh master key object
    per ledger, as each arrives off the wire) and checkpointed: what the storage keeps for
    them in memory (state, maps, per-log byte counts; the index is LMDB's, on disk), divided:
    <= 200 B each (167 B measured). It was ~450 B: a saved-state tuple and its dict entry
    per ledger (124 B), a key per ledger (53 B), a set entry per held suffix (85 B), a dict
    entry per ledger and log (52 B), the cyclic GC's header on every state (16 B)."""
    import gc
    import tracemalloc
    n = 20_000
    st = LedgerStorage(tmp_path / "s")
    st.create_ledger(1, KEY)
    st.put_entry(1, 0, b"x" * 100, -1)
    _checkpoint(st, 1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for lid in range(1_000, 1_000 + n):
            st.create_ledger(lid, bytes(bytearray(KEY)))
            st.put_entry(lid, 0, b"x" * 100, -1)
        _checkpoint(st, 2)
        gc.collect()
        per_ledger = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
        st.close()
    assert per_ledger <= 200, f"{per_ledger:.0f} B per stored ledger"


def test_a_ledger_deleted_during_a_flush_is_not_written_back(tmp_path: Path) -> None:
    """The crash-safety rule of deletion (ledger_storage's module doc): a snapshot taken before
    a delete is flushed, or fails and is not put back, before the one carrying the delete
    sweeps the ledger's index; either way the ledger ends with no index entry and no row."""
    st = LedgerStorage(tmp_path / "s")
    for lid in (1, 2):
        st.create_ledger(lid, KEY)
        for e in range(5):
            st.put_entry(lid, e, b"x", e - 1)
    inflight = st.snapshot()
    st.delete_ledger(1, now=0.0)
    for e in range(5, 10):
        st.put_entry(2, e, b"x", e - 1)
    st.flush(inflight, (1, 0))
    st.flush_done(inflight)
    assert st.get_entry(1, 0) == b"x"  # written by the flush that was in flight
    failed = st.snapshot()  # carries the delete of 1, and entries of 2
    st.delete_ledger(2, now=0.0)
    st.flush_failed(failed)
    assert st.write_cache == {} and st.write_cache_bytes == 0  # not put back: 2 was deleted since
    _checkpoint(st, 2)
    st.close()
    st = LedgerStorage(tmp_path / "s")
    assert st.ledgers == {} and [st.get_entry(lid, e) for lid in (1, 2) for e in range(5)] == [None] * 10
    st.close()


class CountingEnv:
    """An LMDB environment that counts its write transactions."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def begin(self, **kw: Any) -> Any:
        self.writes += kw.get("write", False)
        return self.env.begin(**kw)


def test_a_deleted_ledgers_index_goes_in_bounded_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With at most 7 keys per transaction, deleting two ledgers of 50 flushed entries takes
    ceil(100 / 7) sweep transactions before the checkpoint's own; only their keys go."""
    monkeypatch.setattr(ledger_storage, "SWEEP_KEYS_PER_TXN", 7)
    st = LedgerStorage(tmp_path / "s")
    for lid in (1, 2, 3):
        st.create_ledger(lid, KEY)
        for e in range(50):
            st.put_entry(lid, e, b"e%d" % e, e - 1)
    _checkpoint(st, 1)
    st.delete_ledger(1, now=0.0)
    st.delete_ledger(3, now=0.0)
    env = st.env = CountingEnv(st.env)  # type: ignore[assignment]
    _checkpoint(st, 2)
    assert env.writes == math.ceil(100 / 7) + 1
    assert [st.get_entry(lid, e) for lid in (1, 3) for e in range(50)] == [None] * 100
    assert [st.get_entry(2, e) for e in range(50)] == [b"e%d" % e for e in range(50)]
    st.env = env.env
    st.close()


# -- checkpoints ----------------------------------------------------------------------
def _c_path_add(st: LedgerStorage, tmp_path: Path, ledger_id: int, key: bytes) -> None:
    """One add through the shard's C add path (AddPath.dispatch, as a connection's bytes reach
    it), made durable: a real in-process ShardServer and Journal over this storage."""
    from bookkeeper.bookie.journal import Journal
    from bookkeeper.bookie.server import BookieProtocol, ShardServer
    from bookkeeper.proto import Op, encode_request
    from bookkeeper.testing.syncers import ManualSyncer
    from tests.test_shard_inprocess import Socket

    async def main() -> None:
        server = ShardServer(storage=st, shard_index=0, shards=1, max_frame_bytes=1 << 20, readonly=False,
                             data_dir=str(tmp_path))
        syncer = ManualSyncer()
        journal = Journal(tmp_path / "journal", syncer=syncer, loop=asyncio.get_running_loop(),
                          on_durable=server.on_durable, on_failed=server.on_failed, preallocate_bytes=1 << 20)
        journal.start()
        server.journal = journal
        python_dispatch = server.dispatch
        server.dispatch = lambda conn, frame: pytest.fail(f"the add left the C path: {frame[:5]}")  # type: ignore[method-assign]
        conn, sock = BookieProtocol(server), Socket()
        conn.connection_made(sock)
        payload = struct.pack(">QqqQ", ledger_id, 0, -1, 6) + b"c-path"
        conn.data_received(encode_request(Op.ADD_ENTRY, 0, 1, ledger_id, 0, key, 0, payload))
        for _ in range(3):
            await asyncio.sleep(0)
            syncer.release_all()
        assert [r[1] for r in sock.responses()] == [0]
        server.dispatch = python_dispatch  # type: ignore[method-assign]
        journal.close()

    run(main())


def test_the_write_cache_of_the_c_add_path_is_never_walked_by_the_cyclic_gc(tmp_path: Path) -> None:
    """The C add path's (ledger, entry) keys are made untracked, so the write cache dict stays
    untracked and a collection never walks its entries (a full collection over a full cache
    stalled a shard's loop 10-50 ms under load). With a tracked key, as put_entry makes one,
    the dict is tracked: the check can tell them apart."""
    st = LedgerStorage(tmp_path / "s")
    st.create_ledger(20, KEY)
    st.create_ledger(21, KEY)
    gc.disable()  # a collection would untrack a tracked key itself
    try:
        _c_path_add(st, tmp_path, 20, KEY)
        assert (20, 0) in st.write_cache
        assert not gc.is_tracked(st.write_cache) and not any(gc.is_tracked(k) for k in st.write_cache)
        st.put_entry(21, 0, b"python path", -1)
        assert gc.is_tracked(st.write_cache)
    finally:
        gc.enable()
        st.close()


def test_a_checkpoint_compares_only_the_ledgers_that_changed(tmp_path: Path) -> None:
    """10,000 ledgers held, 4 changed since the last checkpoint (an add through put_entry, one
    through the C add path, a fence, a new ledger): the snapshot compares those 4 and writes
    their states, without a look at the entries cached. A failed flush puts them back; what
    commits survives a reopen."""
    st = LedgerStorage(tmp_path / "s")
    for lid in range(10_000):
        st.create_ledger(lid, KEY)
    _checkpoint(st, 1)
    st.put_entry(10, 0, b"a", -1)
    _c_path_add(st, tmp_path, 20, KEY)
    assert (20, 0) in st.write_cache and st.ledgers[20].in_dirty
    fenced = st.ledger(30)
    assert fenced is not None
    fenced.fenced = True
    st.create_ledger(10_000, KEY)
    snap = st.snapshot()
    assert snap.examined == 4 and sorted(snap.states) == [10, 20, 30, 10_000]
    st.flush_failed(snap)
    snap = st.snapshot()
    assert snap.examined == 4 and sorted(snap.states) == [10, 20, 30, 10_000]
    st.flush(snap, (2, 0))
    st.flush_done(snap)
    again = st.snapshot()
    assert again.examined == 0 and again.states == {}
    st.close()
    st = LedgerStorage(tmp_path / "s")
    assert [st.last_entry_id(10), st.last_entry_id(20), st.last_entry_id(31)] == [0, 0, -1]
    assert st.ledgers[30].fenced and not st.ledgers[31].fenced and 10_000 in st.ledgers
    st.close()
