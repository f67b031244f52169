"""Ledger round trips on a real cluster (ZooKeeper + 5 bookies x 2 shards).

Reference: Apache BookKeeper ledger API (create / add / read / close / delete) and
round-robin striping: entry e is stored on ensemble[(e + i) % E], i < Qw, and only there.
"""
from __future__ import annotations

import asyncio

import pytest

from bookkeeper import BookKeeper, DigestType, errors
from bookkeeper.client.core import write_set
from bookkeeper.meta.ledger_metadata import LedgerState
from bookkeeper.proto import Op
from tests.conftest import run

QUORUMS = [(1, 1, 1), (3, 2, 2), (3, 3, 2), (5, 3, 2)]


async def stored_on(bk: BookKeeper, ledger_id: int, entry_id: int, bookies: list[str], key: bytes) -> set[str]:
    """Which of the bookies answer READ_ENTRY with the entry (asked one by one, directly)."""
    have = set()
    for b in bookies:
        try:
            await bk.pool.call(b, Op.READ_ENTRY, 0, ledger_id, entry_id, key)
            have.add(b)
        except (errors.NoSuchEntryError, errors.NoSuchLedgerError):
            pass
    return have


@pytest.mark.parametrize("e,qw,qa", QUORUMS, ids=[f"{e}-{w}-{a}" for e, w, a in QUORUMS])
def test_create_add_read_close_delete_round_trip(cluster5, e: int, qw: int, qa: int) -> None:
    """Every acknowledged entry reads back byte-identical and lies exactly on its write set."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=e, write_quorum=qw, ack_quorum=qa, digest=DigestType.CRC32C,
                                        password=b"secret", custom_metadata={"app": b"demo"})
            payloads = [bytes([i % 256]) * (i % 300 + 1) for i in range(40)]
            ids = [await lh.add_entry(p) for p in payloads[:20]]
            ids += await asyncio.gather(*(lh.add_entry_async(p) for p in payloads[20:]))
            assert ids == list(range(40))
            assert lh.last_add_confirmed == 39
            assert lh.length == sum(map(len, payloads))
            got = await lh.read(0, 38)  # the writer may read up to its LAC
            assert [x.data for x in got] == payloads[:39]
            await lh.close()
            md = await bk.ledger_metadata(lh.ledger_id)
            assert md.state is LedgerState.CLOSED and md.last_entry_id == 39
            assert md.length == sum(map(len, payloads))
            assert md.custom_metadata == {"app": b"demo"}

            rh = await bk.open_ledger(lh.ledger_id, password=b"secret", digest=DigestType.CRC32C)
            assert rh.last_add_confirmed == 39
            assert [x.data for x in await rh.read(0, 39)] == payloads
            with pytest.raises(errors.NoSuchEntryError):
                await rh.read(0, 40)

            ensemble = md.ensembles[0]
            assert len(ensemble) == e and len(set(ensemble)) == e
            key = bk.master_key(b"secret")
            for entry_id in range(40):
                expected = {ensemble[i] for i in write_set(entry_id, e, qw)}
                assert await stored_on(bk, lh.ledger_id, entry_id, ensemble, key) == expected, entry_id

            await bk.delete_ledger(lh.ledger_id)
            assert lh.ledger_id not in [lid async for lid in bk.list_ledgers()]
            with pytest.raises(errors.NoSuchLedgerError):
                await bk.open_ledger(lh.ledger_id, password=b"secret")
    run(main())


def test_ten_thousand_pipelined_adds_ack_in_order(cluster5) -> None:
    """10,000 pipelined adds are acknowledged in id order with contiguous ids (docs/design.md invariant 2)."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"p")
            order: list[int] = []
            futs = []
            for i in range(10_000):
                f = lh.add_entry_async(b"%d" % i)
                f.add_done_callback(lambda f: order.append(f.result()))
                futs.append(f)
            ids = await asyncio.gather(*futs)
            assert ids == list(range(10_000))
            assert order == list(range(10_000))
            await lh.close()
            rh = await bk.open_ledger(lh.ledger_id, password=b"p")
            got = await rh.read(0, 9_999)
            assert [x.data for x in got] == [b"%d" % i for i in range(10_000)]
            await bk.delete_ledger(lh.ledger_id)
    run(main())


def test_open_ledger_with_wrong_password_is_unauthorized(cluster5) -> None:
    """A wrong password gets UnauthorizedError and fences nothing: the writer keeps adding."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"right")
            await lh.add_entry(b"a")
            with pytest.raises(errors.UnauthorizedError):
                await bk.open_ledger(lh.ledger_id, password=b"wrong")
            assert await lh.add_entry(b"b") == 1
            await lh.close()
    run(main())


def test_closed_ledger_refuses_adds(cluster5) -> None:
    """add_entry on a closed handle raises LedgerClosedError."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1)
            await lh.close()
            with pytest.raises(errors.LedgerClosedError):
                await lh.add_entry(b"x")
            rh = await bk.open_ledger(lh.ledger_id)
            assert rh.last_add_confirmed == -1
    run(main())


def test_not_enough_bookies(cluster5) -> None:
    """An ensemble larger than the registered bookies fails clearly."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            with pytest.raises(errors.NotEnoughBookiesError):
                await bk.create_ledger(ensemble=6, write_quorum=2, ack_quorum=2)
    run(main())


def test_recovery_open_fences_the_writer(cluster5) -> None:
    """After a recovery open, the old writer's next add fails with LedgerFencedError and the
    recovered ledger holds every entry the writer saw acknowledged (docs/design.md invariant 3)."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as writer, \
                await BookKeeper.connect(cluster5.metadata_uri) as reader:
            lh = await writer.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw")
            for i in range(50):
                await lh.add_entry(b"e%d" % i)
            rh = await reader.open_ledger(lh.ledger_id, password=b"pw")
            assert rh.metadata.state is LedgerState.CLOSED
            assert rh.last_add_confirmed == 49
            assert [x.data for x in await rh.read(0, 49)] == [b"e%d" % i for i in range(50)]
            with pytest.raises(errors.LedgerFencedError):
                await lh.add_entry(b"late")
            rh2 = await reader.open_ledger(lh.ledger_id, password=b"pw")
            assert rh2.last_add_confirmed == 49
    run(main())


def test_open_without_recovery_reads_up_to_lac(cluster5) -> None:
    """recovery=False does not fence; it reads up to the LAC, which may lag by one entry."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2, password=b"p")
            for i in range(10):
                await lh.add_entry(b"%d" % i)
            rh = await bk.open_ledger(lh.ledger_id, password=b"p", recovery=False)
            lac = await rh.read_last_add_confirmed()
            assert lac in (8, 9)
            assert [x.data for x in await rh.read(0, lac)] == [b"%d" % i for i in range(lac + 1)]
            with pytest.raises(errors.NoSuchEntryError):
                await rh.read(0, 10)
            assert await lh.add_entry(b"10") == 10  # not fenced
            await lh.close()
    run(main())


@pytest.mark.parametrize("e,qw,qa", [(3, 2, 2), (1, 1, 1)], ids=["3-2-2", "1-1-1"])
def test_a_pausing_writers_last_entry_reaches_a_tailer_while_the_ledger_is_open(cluster5, e: int, qw: int,
                                                                                 qa: int) -> None:
    """Explicit LAC: a writer that stops after entry 4 sends its LAC once idle, so a tailer in
    another client gets entry 4 (and READ_LAC says 4) with the ledger still open. Before, the
    bookies learnt LAC 4 only from a fifth add's piggyback or the close."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri, explicit_lac_interval_ms=5) as bk, \
                await BookKeeper.connect(cluster5.metadata_uri) as reader:
            lh = await bk.create_ledger(ensemble=e, write_quorum=qw, ack_quorum=qa)
            await lh.add_entry(b"0")
            rh = await reader.open_ledger(lh.ledger_id, recovery=False)
            got: list[bytes] = []

            async def tail() -> None:
                async for entry in rh.tail(0):
                    got.append(entry.data)
                    if len(got) == 5:
                        return
            tailer = asyncio.create_task(tail())
            for i in range(1, 5):
                await lh.add_entry(b"%d" % i)
            await asyncio.wait_for(tailer, 10)  # a bound, not a timing goal: without the LAC it never ends
            assert got == [b"%d" % i for i in range(5)]
            assert not (await bk.ledger_metadata(lh.ledger_id)).is_closed
            assert await rh.read_last_add_confirmed() == 4
            assert await lh.add_entry(b"5") == 5  # the writer goes on: nothing was fenced
            await lh.close()
    run(main())


def test_explicit_lac_off_leaves_the_last_entry_to_the_next_add(cluster5) -> None:
    """explicit_lac_interval_ms=0: the bookies' LAC stays one behind a paused writer (what the
    explicit LAC is for); a negative interval is a configuration error."""
    async def main() -> None:
        with pytest.raises(errors.ConfigError, match="explicit_lac_interval_ms"):
            await BookKeeper.connect(cluster5.metadata_uri, explicit_lac_interval_ms=-1)
        async with await BookKeeper.connect(cluster5.metadata_uri, explicit_lac_interval_ms=0) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            for i in range(5):
                await lh.add_entry(b"%d" % i)
            rh = await bk.open_ledger(lh.ledger_id, recovery=False)
            await asyncio.sleep(0.2)  # 40 default intervals: a LAC that was going to be sent would be
            assert await rh.read_last_add_confirmed() == 3
            await lh.close()
    run(main())


def test_batches_and_callbacks_on_a_cluster_then_close_waits_for_the_callbacks(cluster5) -> None:
    """add_entries / add_entry_callback on real bookies: consecutive ids among single adds, close()
    returns only after every callback ran, and everything reads back in order."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            assert await lh.add_entry(b"s0") == 0
            assert await lh.add_entries([b"b%d" % i for i in range(100)]) == list(range(1, 101))
            seen: list[int] = []
            for i in range(50):
                lh.add_entry_callback(b"c%d" % i, lambda e, err: seen.append(e if err is None else -1))
            await lh.close()
            assert seen == list(range(101, 151)) and lh.metadata.last_entry_id == 150
            rh = await bk.open_ledger(lh.ledger_id)
            data = [x.data for x in await rh.read(0, 150)]
            assert data == [b"s0"] + [b"b%d" % i for i in range(100)] + [b"c%d" % i for i in range(50)]
    run(main())


def test_bookie_registrations_are_read_again_only_after_a_watch_says_they_changed(cluster5) -> None:
    """Creates, opens and closes read no registration while none changes (they used to re-read
    every bookie each time); a bookie registering trips the ZooKeeper watch, and the next
    create reads the registrations again and knows it."""
    import json

    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            reads: list[bool] = []
            real = bk.store.get_bookies

            def counted(*, readonly: bool = False) -> dict:
                reads.append(readonly)
                return real(readonly=readonly)
            bk.store.get_bookies = counted  # type: ignore[method-assign]  # a spy: the real read runs
            for _ in range(5):
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                await lh.add_entry(b"x")
                await bk.open_ledger(lh.ledger_id, recovery=False)
                await lh.close()
            assert reads == []
            path = f"{bk.store.root}/available/watched-bookie:1"
            info = json.dumps({"shards": [{"host": "127.0.0.1", "port": 1}]}).encode()
            await bk.metadata_call(lambda: bk.store.zk.create(path, info, ephemeral=True))
            try:
                deadline = asyncio.get_running_loop().time() + 10
                while not bk._bookies_dirty and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                assert sorted(reads) == [False, True] and "watched-bookie:1" in bk._bookies
                await lh.close()
            finally:
                await bk.metadata_call(bk.store.zk.delete, path)
    run(main())


def test_tailing_a_ledger_that_is_deleted_ends_with_no_such_ledger(cluster5) -> None:
    """A tailer at the head of an open ledger whose metadata is deleted raises NoSuchLedgerError
    (it used to retry the vanished ledger with back-off forever)."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri, long_poll_timeout_ms=200) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await lh.add_entries([b"a", b"b"])
            rh = await bk.open_ledger(lh.ledger_id, recovery=False)
            got: list[bytes] = []

            async def tail() -> None:
                async for entry in rh.tail(0):
                    got.append(entry.data)
            tailer = asyncio.create_task(tail())
            while len(got) < 2:
                await asyncio.sleep(0.01)
            await bk.delete_ledger(lh.ledger_id)
            with pytest.raises(errors.NoSuchLedgerError, match="deleted while being tailed"):
                await asyncio.wait_for(tailer, 30)
    run(main())


def test_blocking_client_twin(cluster5) -> None:
    """bookkeeper.sync has the same names without await; add_entry_async returns a concurrent Future."""
    import concurrent.futures

    import bookkeeper.sync

    with bookkeeper.sync.BookKeeper.connect(cluster5.metadata_uri) as bk:
        lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"s")
        assert lh.add_entry(b"zero") == 0
        futs = [lh.add_entry_async(b"n%d" % i) for i in range(1, 200)]
        assert all(isinstance(f, concurrent.futures.Future) for f in futs)
        assert [f.result(timeout=30) for f in futs] == list(range(1, 200))
        assert lh.add_entries([b"x", b"y"]) == [200, 201]
        lh.close()
        rh = bk.open_ledger(lh.ledger_id, password=b"s")
        assert rh.read(0, 0)[0].data == b"zero"
        assert [e.entry_id for e in rh.tail(190)] == list(range(190, 202))
        assert lh.ledger_id in list(bk.list_ledgers())
        bk.delete_ledger(lh.ledger_id)


def test_entry_over_frame_limit_is_refused_before_sending(cluster5) -> None:
    """An entry that cannot fit max_frame_bytes raises TooLargeError; the handle keeps working."""
    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            big = b"x" * (bk.pool.max_frame_bytes - 50)
            with pytest.raises(errors.TooLargeError):
                lh.add_entry_async(big)
            near = b"y" * (bk.pool.max_frame_bytes - 200)
            assert await lh.add_entry(near) == 0
            await lh.close()
            rh = await bk.open_ledger(lh.ledger_id)
            assert (await rh.read(0, 0))[0].data == near
    run(main())
