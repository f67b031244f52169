"""The metadata layout at scale (issue 26): ids allocated in blocks, ids past 10^10 in the
19-digit subtree, `bk metadata upgrade|status`, listings that start anywhere. Real ZooKeeper."""
from __future__ import annotations

import time

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.security import OPEN_ACL_UNSAFE

from bookkeeper.errors import LedgerIdsExhaustedError, MetadataAuthError, MetadataLayoutError
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata
from bookkeeper.meta.zk import (FIRST_BLOCK, LEGACY_MAX_ID, SUPPORTED_LAYOUT, ZkMetadataStore, bucket_base,
                                ledger_path)
from bookkeeper.proto import MAX_LEDGER_ID
from bookkeeper.testing.zookeeper import ZooKeeperServer


@pytest.fixture(scope="module")
def zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    with ZooKeeperServer(tmp_path_factory.mktemp("zk")) as server:
        yield server


_roots = iter(range(10**6))


def _uri(zk: ZooKeeperServer) -> str:
    return f"zk://{zk.connect_string}/layout{next(_roots)}"


def _metadata(lid: int) -> LedgerMetadata:
    return LedgerMetadata(ledger_id=lid, ensemble_size=1, write_quorum=1, ack_quorum=1,
                          digest=DigestType.CRC32C, password_digest="x", ensembles={0: ["b:1"]})


def _legacy(store: ZkMetadataStore) -> None:
    """Make the store's fresh cluster look like one made before LAYOUT existed (layout 1): no
    LAYOUT, no idblocks, an open idgen."""
    store.zk.delete(store.layout_path)
    store.zk.delete(store.idblocks_path)
    store.zk.set_acls(store.idgen_path, OPEN_ACL_UNSAFE)
    store.zk.set(store.idgen_path, b"")
    store.layout = 1


def test_a_new_cluster_starts_at_the_newest_layout_and_hands_out_ids_in_blocks(zk: ZooKeeperServer) -> None:
    uri = _uri(zk)
    bookie = ZkMetadataStore(uri)
    try:
        assert bookie.layout_version() == SUPPORTED_LAYOUT == 2
        clients = [ZkMetadataStore(uri, create=False) for _ in range(3)]
        ids = [c.allocate_ledger_id() for _ in range(FIRST_BLOCK + 5) for c in clients]
        assert len(set(ids)) == len(ids)  # three clients, interleaved: never the same id
        # One compare-and-set per block: 3 clients x 2 blocks (64, then 128) reserved 576 ids.
        assert int(bookie.zk.get(bookie.idblocks_path)[0]) == 3 * (FIRST_BLOCK + 2 * FIRST_BLOCK)
        for c in clients:
            c.close()
    finally:
        bookie.close()


def test_the_allocator_at_its_ceiling_errs_and_never_reuses(zk: ZooKeeperServer) -> None:
    store = ZkMetadataStore(_uri(zk))
    try:
        store.zk.set(store.idblocks_path, str(MAX_LEDGER_ID - 1).encode())
        assert [store.allocate_ledger_id(), store.allocate_ledger_id()] == [MAX_LEDGER_ID - 1, MAX_LEDGER_ID]
        with pytest.raises(LedgerIdsExhaustedError, match="every ledger id"):
            store.allocate_ledger_id()
        with pytest.raises(LedgerIdsExhaustedError):
            ZkMetadataStore(store.uri, create=False).allocate_ledger_id()
    finally:
        store.close()


def test_layout_1s_wrapped_counter_is_an_error_not_a_reused_id(zk: ZooKeeperServer) -> None:
    """ZooKeeper's sequential suffix is a signed 32-bit counter: past 2^31 - 1 the node is
    `ID--2147483648`, which the old parse read as 2147483648 (or, wrapped further, an id
    already handed out). The counter is the parent's cversion: set it there by making and
    deleting children is 2^31 writes, so the wrapped name is made directly instead."""
    store = ZkMetadataStore(_uri(zk))
    try:
        _legacy(store)
        lid = store.allocate_ledger_id()
        assert lid == store.allocate_ledger_id() - 1
        real_create = store.zk.create
        store.zk.create = lambda path, *a, **k: real_create(path.replace("ID-", "ID--2147483648"), *a,
                                                            **{**k, "sequence": False})
        with pytest.raises(LedgerIdsExhaustedError, match="bk metadata upgrade"):
            store.allocate_ledger_id()
    finally:
        store.close()


def test_upgrade_is_idempotent_and_an_old_style_create_then_fails_naming_it(zk: ZooKeeperServer) -> None:
    store = ZkMetadataStore(_uri(zk))
    old = None
    try:
        _legacy(store)
        old = ZkMetadataStore(store.uri, create=False)
        assert old.layout == 1
        handed = [old.allocate_ledger_id() for _ in range(5)]
        store.create_ledger(_metadata(handed[-1]))
        store.create_ledger(_metadata(12_345))  # an id in use above every sequence number
        assert store.layout_status()["layout"] == 1

        status = store.upgrade_layout()
        assert status["layout"] == 2 and status["next_id"] == 12_346
        again = store.upgrade_layout()
        assert again == status  # a no-op: the counter did not move

        # What the code before layout 2 did to allocate: a sequential child of idgen.
        with pytest.raises(MetadataAuthError, match="bk metadata upgrade"):
            store.zk.create(f"{store.idgen_path}/ID-", b"", sequence=True)
        # A client that read layout 1 before the upgrade switches allocators at its next id.
        assert old.allocate_ledger_id() >= 12_346 and old.layout == 2
    finally:
        if old is not None:
            old.close()
        store.close()


def test_a_layout_newer_than_this_code_is_refused(zk: ZooKeeperServer) -> None:
    store = ZkMetadataStore(_uri(zk))
    try:
        store.zk.set(store.layout_path, json.dumps({"layout": SUPPORTED_LAYOUT + 1}).encode())
        with pytest.raises(MetadataLayoutError, match="upgrade it"):
            ZkMetadataStore(store.uri, create=False)
    finally:
        store.close()


def test_ids_past_ten_digits_live_in_the_second_subtree_and_every_lister_walks_both(zk: ZooKeeperServer) -> None:
    store = ZkMetadataStore(_uri(zk))
    try:
        assert ledger_path("/r", 7) == "/r/00/0000/L0007"
        assert ledger_path("/r", 10**10) == "/r/000/0000/0100/0000/L0000"
        assert ledger_path("/r", MAX_LEDGER_ID) == "/r/922/3372/0368/5477/L5807"
        ids = [0, 7, 10_000, LEGACY_MAX_ID, 10**10, 10**10 + 3, 5 * 10**15 + 1, MAX_LEDGER_ID]
        for lid in reversed(ids):
            store.create_ledger(_metadata(lid))
        assert list(store.list_ledgers()) == ids
        assert list(store.list_ledgers(start=8)) == ids[2:]
        assert list(store.list_ledgers(start=10**10 + 1)) == ids[5:]
        assert list(store.list_ledgers(start=MAX_LEDGER_ID)) == ids[-1:]
        assert [bucket_base(store.root, b) for b in store.ledger_buckets(start=10_001)] == [
            10_000, LEGACY_MAX_ID // 10_000 * 10_000, 10**10, 5 * 10**15, MAX_LEDGER_ID // 10_000 * 10_000]
        assert store.max_ledger_id() == MAX_LEDGER_ID
        for lid in ids:
            assert store.read_ledger(lid).ledger_id == lid
            store.delete_ledger(lid)
        # every emptied level went with its last ledger
        assert [c for c in store.zk.get_children(store.root) if c.isdigit()] == []
    finally:
        store.close()


def test_bk_metadata_status_and_upgrade(zk: ZooKeeperServer, tmp_path: Path) -> None:
    store = ZkMetadataStore(_uri(zk))
    try:
        _legacy(store)

        def bk(*args: str) -> dict[str, object]:
            out = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "metadata", *args, "--json",
                                  "--metadata-uri", store.uri], capture_output=True, text=True, check=True)
            return dict(json.loads(out.stdout))
        assert bk("status")["layout"] == 1
        first = bk("upgrade")
        assert first["changed"] is True and first["layout"] == 2
        second = bk("upgrade")
        assert second["changed"] is False and second["next_id"] == first["next_id"]
        assert bk("status") == {"layout": 2, "supported": 2, "allocator": "blocks", "next_id": first["next_id"]}
    finally:
        store.close()


def test_creates_past_max_pending_creates_wait_then_fail_naming_the_bound(make_cluster) -> None:  # noqa: ANN001
    """One create held in ZooKeeper's path (its metadata write waits on an event: the stall is
    what is staged, ZooKeeper and the bookie are real) takes the only slot; the next waits
    metadata_timeout_s and fails with MetadataServiceError, and goes through once the slot is
    free. Nothing queues without bound."""
    import asyncio
    import threading

    from bookkeeper.client import BookKeeper
    from bookkeeper.errors import MetadataServiceError

    cluster = make_cluster(bookies=1, shards=1)

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri, max_pending_creates=1,
                                            metadata_timeout_s=0.3) as bk:
            release = threading.Event()
            real = bk.store.create_ledger_async

            class Stalled:  # the store's Pending, sent only once released: a metadata write that hangs
                def __init__(self, md: LedgerMetadata) -> None:
                    self.md = md

                def then(self, done):  # noqa: ANN001, ANN202
                    threading.Thread(target=lambda: release.wait(30) and real(self.md).then(done), daemon=True).start()
            bk.store.create_ledger_async = Stalled
            try:
                first = asyncio.ensure_future(bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1))
                async with asyncio.timeout(10):
                    while not bk._creates.locked():  # the first create holds the one slot
                        if first.done():
                            first.result()  # it failed before taking the slot: say why
                        await asyncio.sleep(0.01)
                t0 = time.monotonic()
                with pytest.raises(MetadataServiceError, match="1 creates pending"):
                    await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1)
                assert time.monotonic() - t0 >= 0.3  # it waited metadata_timeout_s, not refused at once
                release.set()
                lh = await first
            finally:
                release.set()
                bk.store.create_ledger_async = real
            second = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1)
            assert second.ledger_id != lh.ledger_id
    asyncio.run(main())


def test_an_upgrade_that_stopped_after_retiring_idgen_completes_when_run_again(zk: ZooKeeperServer) -> None:
    """A first run that retired idgen and stopped before its multi-op (a crash) leaves layout
    1 with an idgen nobody can write: the second run must not need to write it again."""
    from bookkeeper.meta.zk import RETIRED_IDGEN, retired_acls

    store = ZkMetadataStore(_uri(zk))
    try:
        _legacy(store)
        store.create_ledger(_metadata(store.allocate_ledger_id()))
        store.zk.set(store.idgen_path, RETIRED_IDGEN)
        store.zk.set_acls(store.idgen_path, retired_acls(None))
        assert store.layout_version() == 1
        assert store.upgrade_layout()["layout"] == 2
    finally:
        store.close()


def test_concurrent_metadata_writes_go_as_one_multi_op_and_fail_one_by_one(make_cluster) -> None:
    """write_metadata calls made together are one ZooKeeper multi-op (counted at the store);
    one whose version moved fails alone with MetadataVersionError and the rest are applied
    (rolled back with it, then sent again, each alone: pipelined plain compare-and-sets, so
    that k stale writes cost one more round trip, not k); a lone write is a plain one."""
    import asyncio

    from bookkeeper.client import BookKeeper
    from bookkeeper.errors import MetadataVersionError

    cluster = make_cluster(bookies=3, shards=1)

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            handles = [await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2) for _ in range(20)]
            calls = {"multi": [], "single": 0}
            multi, single = bk.store.write_ledgers_async, bk.store.write_ledger_async

            def counted_multi(mds):  # noqa: ANN001, ANN202
                calls["multi"].append(len(mds))
                return multi(mds)

            def counted_single(md):  # noqa: ANN001, ANN202
                calls["single"] += 1
                return single(md)
            bk.store.write_ledgers_async, bk.store.write_ledger_async = counted_multi, counted_single
            mds = [await bk.ledger_metadata(h.ledger_id) for h in handles]
            stale = mds[7].replace(version=mds[7].version + 5)
            wanted = [md.replace(custom_metadata={"k": b"v"}) for md in mds[:7]] + [stale] + \
                     [md.replace(custom_metadata={"k": b"v"}) for md in mds[8:]]
            got = await asyncio.gather(*(bk.write_metadata(md) for md in wanted), return_exceptions=True)
            assert isinstance(got[7], MetadataVersionError)
            for i, md in enumerate(got):
                if i != 7:
                    assert md.version == mds[i].version + 1, (i, md)
                    stored = await bk.ledger_metadata(mds[i].ledger_id)
                    assert stored.custom_metadata == {"k": b"v"} and stored.version == md.version
            assert calls["multi"] == [20] and calls["single"] == 19
            assert (await bk.write_metadata(got[0].replace(custom_metadata={}))).version == got[0].version + 1
            assert calls["single"] == 20
    asyncio.run(main())


def test_concurrent_metadata_writes_past_zookeepers_request_limit_are_split(make_cluster) -> None:
    """Twenty concurrent writes of ~60 KB metadata each (1.2 MB together, past ZooKeeper's
    1 MB jute.maxbuffer: one multi-op of them would end the session) go as several multi-ops
    of at most MULTI_OP_BYTES, and every one is applied."""
    import asyncio

    from bookkeeper.client import BookKeeper
    from bookkeeper.meta.zk import MULTI_OP_BYTES

    cluster = make_cluster(bookies=3, shards=1)

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            handles = [await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2) for _ in range(20)]
            mds = [await bk.ledger_metadata(h.ledger_id) for h in handles]
            big = {"blob": b"b" * 60_000}
            multi_ops: list[int] = []
            real = bk.store.zk.transaction

            def counted():  # noqa: ANN202 - every multi-op the writes go in, measured at commit
                txn = real()
                commit = txn.commit_async

                def measured():  # noqa: ANN202
                    multi_ops.append(sum(len(op.data) for op in txn.operations))
                    return commit()
                txn.commit_async = measured
                return txn
            bk.store.zk.transaction = counted
            try:
                got = await asyncio.gather(*(bk.write_metadata(md.replace(custom_metadata=big)) for md in mds))
            finally:
                bk.store.zk.transaction = real
            assert len(multi_ops) > 1 and max(multi_ops) <= MULTI_OP_BYTES and sum(multi_ops) > 1_000_000
            assert [md.version for md in got] == [md.version + 1 for md in mds]
            for md in mds:
                assert (await bk.ledger_metadata(md.ledger_id)).custom_metadata == big
    asyncio.run(main())
