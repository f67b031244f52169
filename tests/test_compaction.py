"""Entry logs that roll, durable per-log live bytes, and compaction (bookkeeper/bookie/storage).

Storage-level tests drive a real LedgerStorage on disk; the kill -9 tests run the compaction
in a child process that SIGKILLs itself at one step, then reopen the storage in this one.
The last test is the issue's acceptance run on a real bookie: 100 ledgers, 4 MiB entry logs,
90 deleted, one GC pass through the admin endpoint.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lmdb
import pytest

from bookkeeper.bookie.storage import LedgerStorage
from bookkeeper.bookie.storage.entrylog import _LOG_KEY
from tests.conftest import run

MIB = 1 << 20


def _open(root: Path, **kw) -> LedgerStorage:
    return LedgerStorage(root / "index", log_dirs=[root / "a", root / "b"],
                         entry_log_max_bytes=kw.pop("entry_log_max_bytes", MIB), **kw)


def _fill(st: LedgerStorage, ledgers: range, rounds: int, *, size: int = 1000, seed: int = 1,
          mark: int = 1) -> dict[tuple[int, int], bytes]:
    """Interleaved adds to every ledger, one checkpoint per round (as a busy bookie writes)."""
    rng = random.Random(seed)
    data: dict[tuple[int, int], bytes] = {}
    for lid in ledgers:
        if st.ledger(lid) is None:
            st.create_ledger(lid, b"k" * 20)
    for r in range(rounds):
        for lid in ledgers:
            for e in range(r * 10, r * 10 + 10):
                data[(lid, e)] = b = rng.randbytes(size)
                st.put_entry(lid, e, b, e - 1)
        _checkpoint(st, mark + r)
    return data


def _checkpoint(st: LedgerStorage, mark: int) -> None:
    snap = st.snapshot()
    st.flush(snap, (mark, 0))
    st.flush_done(snap)


def _logs(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.glob("[ab]/*.log"))}


def _check(st: LedgerStorage, data: dict[tuple[int, int], bytes], live: set[int]) -> None:
    bad = [k for k, b in data.items() if k[0] in live and st.get_entry(*k) != b]
    assert bad == [], f"{len(bad)} entries lost or altered, first {bad[:3]}"


def test_logs_roll_at_their_size_and_spread_over_every_ledger_dir(tmp_path: Path) -> None:
    """A checkpoint bigger than entry_log_max_bytes rolls mid-flush; new logs alternate between
    ledger dirs on one filesystem (equal free space: the dir holding fewer logs wins)."""
    st = _open(tmp_path)
    data = _fill(st, range(1, 11), 6, size=10_000)  # ~6 MiB of entries
    logs = _logs(tmp_path)
    assert len(logs) >= 6
    assert {k.split("/")[0] for k in logs} == {"a", "b"}
    closed = [n for k, n in logs.items() if not k.endswith(f"{st._log_id:08d}.log")]
    assert all(n <= MIB + 10_020 for n in closed), closed  # the last record may end past the size
    _check(st, data, set(range(1, 11)))
    st.close()


def test_log_records_survive_a_restart_without_a_rescan(tmp_path: Path) -> None:
    """Per-log, per-ledger bytes are committed with the index: a reopened storage has the same
    usage; a store made before records existed gets them from its index once."""
    st = _open(tmp_path)
    _fill(st, range(1, 6), 4)
    st.delete_ledger(2, now=0.0)
    _checkpoint(st, 99)
    usage = st.log_usage()
    assert sum(u[2] for u in usage.values()) == sum(
        n for info in st.logs.values() for lid, n in info.ledgers.items() if lid != 2) > 0
    st.close()
    st = _open(tmp_path)
    assert {k: v for k, v in st.log_usage().items() if v[1] > 8} == {k: v for k, v in usage.items() if v[1] > 8}
    st.close()
    env = lmdb.open(str(tmp_path / "index" / "index.lmdb"), max_dbs=5)
    with env.begin(write=True) as txn:  # as a store written by the previous version
        txn.drop(env.open_db(b"logs", txn=txn), delete=False)
        txn.delete(b"logs_format", db=env.open_db(b"meta", txn=txn))
    env.close()
    st = _open(tmp_path)
    migrated = st.log_usage()
    assert {k: v[2] for k, v in migrated.items()} == {k: v[2] for k, v in usage.items() if v[2]}
    st.close()


def test_an_orphan_log_is_deleted_at_open(tmp_path: Path) -> None:
    """A log file no record names (a crash before its first commit) holds nothing indexed."""
    st = _open(tmp_path)
    data = _fill(st, range(1, 3), 2)
    st.close()
    orphan = tmp_path / "b" / "00000999.log"
    orphan.write_bytes(b"BKELOG01" + b"\0" * 100)
    st = _open(tmp_path)
    assert not orphan.exists()
    _check(st, data, {1, 2})
    st.close()


def test_a_fenced_ledger_deleted_leaves_a_tombstone_that_outlives_a_restart(tmp_path: Path) -> None:
    """A ledger fenced here and then garbage-collected is remembered (apache/bookkeeper#4462):
    the shard refuses its zombie writer's adds instead of making the ledger again. The
    tombstone commits with the deletion, is there after a reopen, and goes once pruned; an
    unfenced ledger deleted leaves none."""
    st = _open(tmp_path)
    _fill(st, range(1, 3), 1)
    st.ledger(1).fenced = True
    _checkpoint(st, 2)
    st.delete_ledger(1, now=1000.0)
    st.delete_ledger(2, now=1000.0)
    assert st.tombstones == {1: 1000.0}
    _checkpoint(st, 3)
    st.close()
    st = _open(tmp_path)
    assert st.tombstones == {1: 1000.0} and st.ledger(1) is None and st.ledger(2) is None
    assert st.prune_tombstones(before=999.0) == 0 and st.tombstones == {1: 1000.0}
    assert st.prune_tombstones(before=1001.0) == 1 and st.tombstones == {}
    _checkpoint(st, 4)
    st.close()
    st = _open(tmp_path)
    assert st.tombstones == {}
    st.close()


def test_compaction_copies_live_entries_and_deletes_dead_logs(tmp_path: Path) -> None:
    """After 18 of 20 interleaved ledgers are deleted, a major pass leaves about the live bytes;
    re-added entries keep their newest copy; every live entry reads back, also after a reopen."""
    st = _open(tmp_path)
    data = _fill(st, range(1, 21), 8)
    st.put_entry(19, 0, b"rewritten", -1)  # a recovery add of the same entry: the old copy is dead
    data[(19, 0)] = b"rewritten"
    _checkpoint(st, 100)
    before = sum(_logs(tmp_path).values())
    for lid in range(1, 19):
        st.delete_ledger(lid, now=0.0)
    _checkpoint(st, 101)
    steps: list[tuple[str, int]] = []
    res = st.compact(0.8, on_step=lambda s, lid: steps.append((s, lid)))
    st.release_logs(res.retired)
    after = sum(_logs(tmp_path).values())
    live = sum(len(b) + 20 for k, b in data.items() if k[0] > 18)
    print(f"compaction: {before} -> {after} bytes, live {live}, {res}")
    assert res.logs_compacted + res.logs_deleted == len(res.retired) > 0
    assert res.entries_copied > 0 and res.bytes_reclaimed > 0
    assert after <= live + 2 * MIB
    assert [s for s, _ in steps[:4]] == ["before_copy", "after_copy", "after_index_switch", "after_delete"]
    _check(st, data, {19, 20})
    st.close()
    st = _open(tmp_path)
    _check(st, data, {19, 20})
    st.close()


def test_a_stopped_pass_leaves_the_index_where_it_was(tmp_path: Path) -> None:
    """should_stop mid-copy: nothing switched, nothing deleted; the next pass finishes the job."""
    st = _open(tmp_path, entry_log_max_bytes=4 * MIB)
    data = _fill(st, range(1, 11), 4, size=20_000)
    for lid in range(1, 6):
        st.delete_ledger(lid, now=0.0)
    _checkpoint(st, 50)
    calls = iter(range(10**6))
    res = st.compact(0.9, should_stop=lambda: next(calls) >= 1)  # after the first batch
    assert res.retired == [] and res.entries_copied > 0
    _check(st, data, set(range(6, 11)))
    res = st.compact(0.9)
    st.release_logs(res.retired)
    assert res.retired
    _check(st, data, set(range(6, 11)))
    st.close()


def test_the_throttle_bounds_the_copy_rate(tmp_path: Path) -> None:
    """Copying B bytes at R bytes/s takes at least B/R seconds (a lower bound: never flaky)."""
    st = _open(tmp_path, entry_log_max_bytes=4 * MIB)
    _fill(st, range(1, 5), 8, size=20_000)
    st.delete_ledger(1, now=0.0)
    _checkpoint(st, 50)
    res = st.compact(0.9, rate_bytes_s=8 * MIB)
    assert res.bytes_copied > MIB
    assert res.duration_s >= res.bytes_copied / (8 * MIB) * 0.95, res
    st.close()


def test_a_reader_of_a_compacted_log_follows_the_index(tmp_path: Path) -> None:
    """A reader fd cached on a log that compaction deleted still reads (the inode lives on) until
    release_logs closes it; after that the entry comes from its new copy."""
    st = _open(tmp_path)
    data = _fill(st, range(1, 5), 4, size=10_000)
    assert st.get_entry(4, 0) == data[(4, 0)]  # caches a reader of the first log
    for lid in (1, 2, 3):
        st.delete_ledger(lid, now=0.0)
    _checkpoint(st, 50)
    res = st.compact(0.8)
    assert res.retired and all(lid not in st._paths for lid in res.retired)
    _check(st, data, {4})
    st.release_logs(res.retired)
    assert not set(res.retired) & set(st._readers)
    _check(st, data, {4})
    st.close()


_CHILD = r"""
import os, random, signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.test_compaction import _open, _fill, _checkpoint
st = _open(Path({dir!r}))
_fill(st, range(1, 21), 8, size=3000)
for lid in range(1, 19):
    st.delete_ledger(lid, now=0.0)
_checkpoint(st, 100)
seen = []
def step(name, log_id):
    seen.append(name)
    if name == {step!r} and seen.count(name) == 2:  # mid-pass: one log already done
        os.kill(os.getpid(), signal.SIGKILL)
st.compact(0.8, on_step=step)
print("finished without the kill", flush=True)
"""


@pytest.mark.parametrize("step", ["before_copy", "after_copy", "after_index_switch", "after_delete"])
def test_kill_9_at_each_compaction_step_loses_nothing_and_leaks_nothing(tmp_path: Path, step: str) -> None:
    """The child compacts and SIGKILLs itself at `step` of its second log. Reopened here, every
    live entry reads back; the next pass (the next GC) leaves only logs that have a record."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(root), dir=str(tmp_path), step=step)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    ref = _open(tmp_path / "reference")
    data = _fill(ref, range(1, 21), 8, size=3000)  # same seed: the bytes the child wrote
    ref.close()
    st = _open(tmp_path)
    _check(st, data, {19, 20})
    res = st.compact(0.8)
    st.release_logs(res.retired)
    _check(st, data, {19, 20})
    on_disk = {int(p.stem) for p in tmp_path.glob("[ab]/*.log")}
    with st.env.begin(db=st.db_logs) as txn:
        recorded = {_LOG_KEY.unpack(k)[0] for k, _ in txn.cursor()}
    assert on_disk - {st._log_id} <= recorded, "a log file no record names was left behind"
    live = sum(len(b) + 20 for k, b in data.items() if k[0] > 18)
    assert sum(_logs(tmp_path).values()) <= live + 2 * MIB
    st.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from bookkeeper.testing.cluster import LocalCluster, free_port_block

    c = LocalCluster(tmp_path_factory.mktemp("gc"), bookies=0, shards=1,
                     bookie_conf={"entry_log_max_bytes": 4 * MIB, "gc_interval_s": 3600,
                                  "major_compaction_interval_s": 3600, "minor_compaction_interval_s": 3600,
                                  "checkpoint_interval_s": 1})
    c.start()
    try:
        c.add_bookie(http_port=free_port_block())
        yield c
    finally:
        c.stop()


def test_gc_reclaims_the_space_of_deleted_ledgers(cluster) -> None:
    """Acceptance: 100 ledgers with 4 MiB entry logs, 90 deleted, one GC pass (POST
    /api/v1/bookie/gc): the ledger dirs fall to within 2 entry logs of the live data and the 10
    live ledgers read back byte-identical. Prints what was reclaimed and how long it took."""
    from bookkeeper.client import BookKeeper

    bookie = cluster.bookies[0]
    ledger_dirs = [Path(d) for d in bookie.conf["ledger_dirs"]]
    admin = f"http://127.0.0.1:{bookie.conf['http_port']}"

    def dir_bytes() -> int:
        return sum(p.stat().st_blocks * 512 for d in ledger_dirs for p in d.rglob("*") if p.is_file())

    async def write() -> dict[int, list[bytes]]:
        rng = random.Random(5)
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            handles = [await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1, password=b"gc")
                       for _ in range(100)]
            data: dict[int, list[bytes]] = {h.ledger_id: [] for h in handles}
            for _ in range(40):  # interleaved: every entry log holds a bit of every ledger
                futs = []
                for h in handles:
                    b = rng.randbytes(10_000)
                    data[h.ledger_id].append(b)
                    futs.append(h.add_entry_async(b))
                await asyncio.gather(*futs)
            for h in handles:
                await h.close()
            for lid in list(data)[10:]:
                await bk.delete_ledger(lid)
            return {lid: data[lid] for lid in list(data)[:10]}

    live = run(write())
    time.sleep(1.5)  # one checkpoint interval: the entries leave the write cache for the logs
    before = dir_bytes()
    req = urllib.request.Request(f"{admin}/api/v1/bookie/gc", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=300) as resp:
        result = json.load(resp)
    after = dir_bytes()
    live_bytes = sum(len(b) + 20 for bs in live.values() for b in bs)
    print(f"GC: {before} -> {after} bytes on disk (live data {live_bytes}); result {result}")
    assert result["ledgers_deleted"] == 90 and result["bytes_reclaimed"] > 0
    assert after <= live_bytes + 2 * 4 * MIB, (before, after, live_bytes)

    async def read_back() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            for lid, want in live.items():
                rh = await bk.open_ledger(lid, password=b"gc")
                got = await rh.read(0, rh.last_add_confirmed)
                assert [e.data for e in got] == want, lid

    run(read_back())


def test_a_zombie_writer_cannot_add_to_its_fenced_ledger_once_it_is_deleted_and_collected(cluster) -> None:
    """apache/bookkeeper#4462 (Pulsar lost messages so): a writer keeps adding to its ledger
    after another client fenced it (a recovery open), deleted it, and the bookie's GC dropped
    it. The bookie must refuse the add as fenced, not make the ledger again and acknowledge
    an entry nobody can read. Without the tombstone the add succeeds."""
    from bookkeeper.client import BookKeeper
    from bookkeeper.errors import LedgerFencedError

    admin = f"http://127.0.0.1:{cluster.bookies[0].conf['http_port']}"

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as old, \
                await BookKeeper.connect(cluster.metadata_uri) as new:
            lh = await old.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1, password=b"z")
            await lh.add_entry(b"before")
            await (await new.open_ledger(lh.ledger_id, password=b"z", recovery=True)).close()
            await new.delete_ledger(lh.ledger_id)
            req = urllib.request.Request(f"{admin}/api/v1/bookie/gc", method="POST", data=b"")
            result = await asyncio.get_running_loop().run_in_executor(
                None, lambda: json.load(urllib.request.urlopen(req, timeout=300)))
            assert result["ledgers_deleted"] >= 1, result
            with pytest.raises(LedgerFencedError):
                await lh.add_entry(b"after")

    run(main())
