"""Durability under kill -9: every acknowledged entry survives, byte-identical (journal replay),
and a torn last journal block is detected and discarded, never served.

Reference: docs/design.md invariant 1; Apache BookKeeper Journal replay on bookie start.
Checkpoints are pushed far out so that acknowledged entries live only in the journal
when the process dies: what is read back after restart came from replay.
"""
from __future__ import annotations

import asyncio
import mmap
import os
from collections import deque
from collections.abc import Callable

import pytest

from bookkeeper import BookKeeper, errors
from bookkeeper._ext.journal import REC_ADD, JournalBatch, scan_blocks
from bookkeeper.client.digest import DigestManager
from bookkeeper.meta.ledger_metadata import DigestType
from bookkeeper.proto import Op, shard_for_ledger
from bookkeeper.testing.cluster import LocalBookie, LocalCluster
from tests.conftest import run

pytestmark = pytest.mark.runtime(55)

NO_CHECKPOINT = {"checkpoint_interval_s": 3600.0, "write_cache_max_bytes": 1 << 30}
PASSWORD = b"durable"


async def stream_until_failure(lh, *, kill_at: int, kill: Callable[[], None], max_entries: int = 20_000,
                               window: int = 200) -> dict[int, bytes]:
    """Pipelined adds; after kill_at acknowledgements run kill(); stop at the first failed add.

    Returns the writer's record of acknowledged entries: id -> bytes.
    """
    acked: dict[int, bytes] = {}
    pending: deque[tuple[asyncio.Future[int], bytes]] = deque()
    killed = False
    for i in range(max_entries):
        data = b"entry-%08d-" % i + os.urandom(16 + i % 200)
        try:
            pending.append((lh.add_entry_async(data), data))
        except errors.BKError:
            break
        if len(pending) >= window:
            fut, d = pending.popleft()
            try:
                acked[await fut] = d
            except errors.BKError:
                break
        if not killed and len(acked) >= kill_at:
            kill()
            killed = True
    for fut, d in pending:
        try:
            acked[await fut] = d
        except errors.BKError:
            pass
    assert killed, "the stream ended before the fault was injected"
    return acked


async def read_direct(bk: BookKeeper, bookie_id: str, ledger_id: int, entry_id: int) -> bytes:
    """One entry straight from one bookie, digest verified."""
    resp = await bk.pool.call(bookie_id, Op.READ_ENTRY, 0, ledger_id, entry_id, bk.master_key(PASSWORD))
    return DigestManager(ledger_id, DigestType.CRC32C, PASSWORD).verify(resp[6], entry_id)[0]


async def check_all_acked(bk: BookKeeper, bookie: LocalBookie, ledger_id: int, acked: dict[int, bytes]) -> None:
    assert sorted(acked) == list(range(len(acked))), "acknowledged ids must be contiguous"
    await bk.refresh_bookies()
    for eid, data in acked.items():
        assert await read_direct(bk, bookie.bookie_id, ledger_id, eid) == data, eid
    rh = await bk.open_ledger(ledger_id, password=PASSWORD)
    assert rh.last_add_confirmed >= max(acked)
    got = await rh.read(0, max(acked))
    assert [e.data for e in got] == [acked[i] for i in range(len(acked))]


def _owning_shard(ledger_id: int, cluster: LocalCluster) -> int:
    return shard_for_ledger(ledger_id, cluster.shards)


def test_kill9_of_a_shard_process_loses_no_acknowledged_entry(make_cluster) -> None:
    """kill -9 of the owning shard mid-stream: the supervisor restarts it and replay restores every ack."""
    cluster = make_cluster(bookies=3, shards=2, bookie_conf=NO_CHECKPOINT)

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3, password=PASSWORD)
            victim = cluster.bookies[0]
            shard = _owning_shard(lh.ledger_id, cluster)
            old_pid = victim.shard_pid(shard)
            acked = await stream_until_failure(lh, kill_at=3000, kill=lambda: victim.kill_shard(shard))
            victim.wait_shard_replaced(shard, old_pid)
            cluster.wait_shards_up(victim)
            assert len(acked) >= 3000
            await check_all_acked(bk, victim, lh.ledger_id, acked)
    run(main())


def test_kill9_of_whole_bookie_then_restart_loses_no_acknowledged_entry(make_cluster) -> None:
    """kill -9 of supervisor and shards mid-stream; restarted with the same config, the bookie takes
    over its stale registration and serves every acknowledged entry from journal replay."""
    cluster = make_cluster(bookies=3, shards=2, bookie_conf=NO_CHECKPOINT)

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3, password=PASSWORD)
            victim = cluster.bookies[1]
            acked = await stream_until_failure(lh, kill_at=3000, kill=victim.kill)
            victim.start()
            cluster.wait_registered([victim], timeout_s=4 + 10)  # session timeout + 10 s (docs/api.md)
            await check_all_acked(bk, victim, lh.ledger_id, acked)
    run(main())


def test_torn_last_journal_block_is_discarded_never_served(make_cluster) -> None:
    """A half-written block at the journal's end (a crash mid-write) fails its checksum on replay:
    the entry in it is not served, and every entry before it is."""
    cluster = make_cluster(bookies=1, shards=2, bookie_conf=NO_CHECKPOINT)
    bookie = cluster.bookies[0]

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1, password=PASSWORD)
            acked = {}
            for i in range(300):
                data = b"t%d" % i
                acked[await lh.add_entry(data)] = data
            shard = _owning_shard(lh.ledger_id, cluster)
            bookie.kill()

            # Forge the block a crash would have torn: entry 300, valid encoding, half written.
            jdir = bookie.dir / "journal" / f"shard-{shard}"
            newest = max(jdir.glob("*.jnl"))
            with open(newest, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
                _, end, torn, _, _ = scan_blocks(mm, 4096)
                assert not torn
            batch = JournalBatch()
            forged = DigestManager(lh.ledger_id, DigestType.CRC32C, PASSWORD).encode(300, 299, 999, b"torn" * 2000)
            batch.add(REC_ADD, lh.ledger_id, 300, forged)
            block = bytes(batch.seal(10_000))
            with open(newest, "r+b") as f:
                f.seek(end)
                f.write(block[: len(block) // 2])

            bookie.start()
            cluster.wait_registered([bookie])
            await bk.refresh_bookies()
            for eid, data in acked.items():
                assert await read_direct(bk, bookie.bookie_id, lh.ledger_id, eid) == data
            try:
                await read_direct(bk, bookie.bookie_id, lh.ledger_id, 300)
                raise AssertionError("the torn entry was served")
            except errors.NoSuchEntryError:
                pass
            assert "torn block" in (bookie.dir / "bookie.log").read_text()
            rh = await bk.open_ledger(lh.ledger_id, password=PASSWORD)
            assert rh.last_add_confirmed == 299
    run(main())


def test_thread_fallback_journal_cluster_round_trip_and_restart(make_cluster) -> None:
    """journal_sync=thread: the same durability across a graceful restart and a kill -9."""
    cluster = make_cluster(bookies=3, shards=2, journal_sync="thread", bookie_conf=NO_CHECKPOINT)

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3, password=PASSWORD)
            victim = cluster.bookies[2]
            acked = await stream_until_failure(lh, kill_at=1000, kill=victim.kill, max_entries=5000)
            victim.start()
            cluster.wait_registered([victim])
            await check_all_acked(bk, victim, lh.ledger_id, acked)
    run(main())
    logs = "".join((b.dir / "bookie.log").read_text() for b in cluster.bookies)
    assert "journal sync: thread" in logs and "journal sync: io_uring" not in logs
