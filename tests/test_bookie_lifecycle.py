"""Bookie lifecycle: cookies, registration, restart, admin HTTP.

Reference: docs/api.md section 4 (a bookie killed and restarted is back within the ZooKeeper
session timeout plus 10 s; wiped or swapped directories refuse to start, naming the
cookie mismatch); Apache BookKeeper Cookie.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
import subprocess
import sys
import time
import urllib.request

import pytest

from bookkeeper.config import BookieConfig
from bookkeeper.errors import ConfigError
from bookkeeper.testing.cluster import LocalCluster

pytestmark = pytest.mark.runtime(60)


def _run_bookie_once(conf_path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "bookie", "--conf", str(conf_path)],
                          capture_output=True, text=True, timeout=timeout_s)


def test_bookie_with_wiped_ledger_dir_refuses_to_start(make_cluster) -> None:
    """Wiping a bookie's directories makes it refuse its old id with a cookie mismatch message."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=1)
    b = cluster.bookies[0]
    b.stop()
    shutil.rmtree(b.dir / "ledgers")
    proc = _run_bookie_once(b.conf_path)
    assert proc.returncode != 0
    assert "cookie mismatch" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert b.bookie_id not in cluster.registrations()


def test_bookie_with_swapped_journal_dir_refuses_to_start(make_cluster) -> None:
    """A journal directory from another bookie carries the other cookie: refused."""
    cluster: LocalCluster = make_cluster(bookies=2, shards=1)
    a, b = cluster.bookies
    a.stop()
    b.stop()
    shutil.rmtree(a.dir / "journal")
    shutil.copytree(b.dir / "journal", a.dir / "journal")
    proc = _run_bookie_once(a.conf_path)
    assert proc.returncode != 0 and "cookie mismatch" in proc.stderr


def test_changed_shard_count_refuses_to_start(make_cluster) -> None:
    """Ledger ownership hashes over the shard count: changing it under the same data is refused."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    b = cluster.bookies[0]
    b.stop()
    b.conf["shards"] = 1
    b.write_conf()
    proc = _run_bookie_once(b.conf_path)
    assert proc.returncode != 0 and "cookie mismatch" in proc.stderr and "shards" in proc.stderr


def test_restart_after_kill9_is_back_within_session_timeout_plus_10s(make_cluster) -> None:
    """The stale ephemeral registration of a killed bookie is taken over, not waited for as an error."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    b = cluster.bookies[0]
    b.kill()
    assert b.bookie_id in cluster.registrations()  # still there: the session has not expired
    t0 = time.monotonic()
    b.start()
    cluster.wait_registered([b], timeout_s=4 + 10)
    print(f"back in service after {time.monotonic() - t0:.2f}s")
    assert cluster.registrations()[b.bookie_id]["pid"] == b.pid


def test_supervisor_restarts_a_dead_shard_and_keeps_registration(make_cluster) -> None:
    """A shard killed with SIGKILL is restarted on its port; the bookie stays registered."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    b = cluster.bookies[0]
    old = b.shard_pid(1)
    b.kill_shard(1)
    b.wait_shard_replaced(1, old, timeout_s=30)
    cluster.wait_shards_up(b)
    assert b.bookie_id in cluster.registrations()


def test_admin_http_heartbeat_and_metrics(make_cluster, tmp_path) -> None:
    """http_port serves /heartbeat and Prometheus /metrics on 127.0.0.1."""
    from bookkeeper.testing.cluster import free_port_block

    port = free_port_block()
    make_cluster(bookies=1, shards=1, bookie_conf={"http_port": port})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/heartbeat", timeout=5) as r:
        assert r.status == 200 and r.read() == b"OK\n"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert b"bookie_shards_up 1.0" in r.read()


def test_registration_lists_every_shard_address(make_cluster) -> None:
    """The ephemeral registration carries all shard addresses (the client routes by it)."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    b = cluster.bookies[0]
    reg = cluster.registrations()[b.bookie_id]
    assert reg["shards"] == [{"host": "127.0.0.1", "port": b.port}, {"host": "127.0.0.1", "port": b.port + 1}]
    assert json.loads(json.dumps(reg))["rack"] == "/default-rack"


def test_config_rejects_bad_values_clearly(tmp_path) -> None:
    """Bad config fails with the key named, before anything starts."""
    conf = tmp_path / "b.toml"
    conf.write_text('metadata_uri = "zk://127.0.0.1:1/ledgers"\njournal_sync = "magic"\n')
    proc = _run_bookie_once(conf, timeout_s=30)
    assert proc.returncode != 0 and "journal_sync" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ConfigError, match="journal_sync"):
        BookieConfig.load(conf)


def test_deleted_ledger_is_garbage_collected_on_bookies(make_cluster) -> None:
    """After delete_ledger, bookies drop the ledger's entries once its metadata is gone (GC)."""
    import asyncio

    from bookkeeper import BookKeeper, errors
    from bookkeeper.proto import Op
    from tests.conftest import run

    cluster: LocalCluster = make_cluster(bookies=1, shards=1, bookie_conf={"gc_interval_s": 0.5})

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1, password=b"g")
            for i in range(20):
                await lh.add_entry(b"%d" % i)
            await lh.close()
            bookie = cluster.bookies[0].bookie_id
            key = bk.master_key(b"g")
            await bk.pool.call(bookie, Op.READ_ENTRY, 0, lh.ledger_id, 5, key)
            await bk.delete_ledger(lh.ledger_id)
            for _ in range(100):
                try:
                    await bk.pool.call(bookie, Op.READ_ENTRY, 0, lh.ledger_id, 5, key)
                except errors.NoSuchLedgerError:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("the deleted ledger is still served after 10 s")
    run(main())


def test_bookie_stops_gracefully_when_zookeeper_is_gone(make_cluster) -> None:
    """SIGTERM stops a bookie (shards drained and checkpointed) even after ZooKeeper died."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    b = cluster.bookies[0]
    cluster.zk.stop()
    proc = b.proc
    assert proc is not None
    proc.terminate()
    rc = proc.wait(timeout=25)
    assert rc == 0
    assert b.shard_pids() == []
    assert (b.dir / "bookie.log").read_text().count("stopped") >= 2


def test_second_copy_of_a_running_bookie_refuses_to_start(make_cluster) -> None:
    """The directories are locked for the bookie's life: a second copy must not replay and trim
    the journal under the running one."""
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    b = cluster.bookies[0]
    proc = _run_bookie_once(b.conf_path)
    assert proc.returncode != 0 and "in use by another running bookie" in proc.stderr
    assert cluster.registrations()[b.bookie_id]["pid"] == b.pid


def test_shards_die_with_a_killed_supervisor_and_the_bookie_restarts_clean(make_cluster) -> None:
    """kill -9 of the supervisor alone takes its shards down (PR_SET_PDEATHSIG); the restarted
    bookie serves every acknowledged entry."""
    from bookkeeper import BookKeeper
    from tests.conftest import run

    cluster: LocalCluster = make_cluster(bookies=1, shards=2, bookie_conf={"checkpoint_interval_s": 3600.0})
    b = cluster.bookies[0]

    async def write() -> int:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1, password=b"s")
            for i in range(100):
                await lh.add_entry(b"s%d" % i)
            return lh.ledger_id

    lid = run(write())
    shards = b.shard_pids()
    assert len(shards) == 2
    import os
    import signal as sig
    assert b.proc is not None
    os.kill(b.proc.pid, sig.SIGKILL)
    b.proc.wait()
    def alive(pid: int) -> bool:
        try:
            return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:  # reaped between the checks
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in shards) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in shards), "a shard outlived its supervisor"
    b.proc = None
    b.start()
    cluster.wait_registered([b], timeout_s=14)

    async def read() -> list[bytes]:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            rh = await bk.open_ledger(lid, password=b"s")
            return [e.data for e in await rh.read(0, rh.last_add_confirmed)]
    assert run(read()) == [b"s%d" % i for i in range(100)]


def test_first_start_interrupted_between_cookie_writes_recovers(make_cluster) -> None:
    """Local cookies equal to the bookie's own and none in ZooKeeper: the first start stopped
    between the two writes; the bookie completes it instead of refusing forever."""
    from kazoo.client import KazooClient

    cluster: LocalCluster = make_cluster(bookies=1, shards=1)
    b = cluster.bookies[0]
    b.stop()
    zk = KazooClient(hosts=cluster.zk.connect_string)
    zk.start(timeout=10)
    try:
        zk.delete(f"/ledgers/cookies/{b.bookie_id}")
    finally:
        zk.stop()
        zk.close()
    b.start()
    cluster.wait_registered([b])


def test_failed_checkpoint_keeps_its_entries(tmp_path) -> None:
    """A flush that fails puts its entries back: they stay readable and the next checkpoint has them."""
    from bookkeeper.bookie.storage import LedgerStorage

    st = LedgerStorage(tmp_path / "s")
    st.create_ledger(7, b"k" * 20)
    for e in range(10):
        st.put_entry(7, e, b"entry-%d" % e, e - 1)
    snap = st.snapshot()
    st.put_entry(7, 10, b"entry-10", 9)
    st.flush_failed(snap)
    assert [st.get_entry(7, e) for e in range(11)] == [b"entry-%d" % e for e in range(11)]
    snap2 = st.snapshot()
    assert sorted(snap2.entries) == [(7, e) for e in range(11)]
    st.flush(snap2, (1, 4096))
    st.flush_done(snap2)
    assert st.write_cache == {} and [st.get_entry(7, e) for e in range(11)] == [b"entry-%d" % e for e in range(11)]
    st.close()


def test_io_uring_that_kills_its_process_falls_back_to_thread_syncer(make_cluster, tmp_path, monkeypatch) -> None:
    """A liburing that dies with SIGILL on import (the 2026.x wheels on CPUs without AVX-512)
    costs one logged line: the bookie starts on the thread syncer and serves adds."""
    fake = tmp_path / "fake-liburing" / "liburing"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    cluster: LocalCluster = make_cluster(bookies=1, shards=2)
    monkeypatch.delenv("PYTHONPATH")
    log = cluster.bookies[0].log_tail(200)
    fallbacks = [line for line in log.splitlines() if "io_uring unavailable" in line]
    assert len(fallbacks) == 1 and "SIGILL" in fallbacks[0], log
    assert log.count("journal sync: thread") == 2, log
    proc = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "--metadata-uri", cluster.metadata_uri,
                           "simpletest", "-e", "1", "-w", "1", "-a", "1", "-n", "20"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
