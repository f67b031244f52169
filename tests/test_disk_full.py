"""Disks guarded: a bookie whose ledger dir (or journal dir) fills turns read-only before ENOSPC,
writers move on through ensemble change with nothing acknowledged lost, reads keep working,
and once ledgers are deleted and GC runs it is writable again.

Reference: issue 10 item 2; Apache BookKeeper LedgerDirsMonitor / read-only mode. The small
filesystems are real tmpfs mounts made (and unmounted) by the test.
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from bookkeeper import BookKeeper
from bookkeeper.errors import BKError
from bookkeeper.testing.cluster import LocalBookie, LocalCluster, free_port_block
from tests.conftest import run

ENTRY = 48 * 1024
# Small thresholds on a small filesystem: read-only at 60%, writable again under 40%; checked often.
DISK_CONF = {"disk_usage_warn": 0.5, "disk_usage_threshold": 0.6, "disk_usage_lwm": 0.4,
             "disk_check_interval_s": 0.1, "entry_log_max_bytes": 1 << 20}


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(small, roomy): a 40 MiB filesystem to fill and a 512 MiB one for the bookie's other dir.
    Both are the test's own: the thresholds apply to every dir, and the host's disk usage is
    nobody's business here. tmpfs takes memory only as it fills."""
    mounts = []
    try:
        for name, size in (("small-fs", "40m"), ("roomy-fs", "512m")):
            mnt = tmp_path / name
            mnt.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
            mounts.append(mnt)
        yield mounts[0], mounts[1]
    finally:
        for mnt in mounts:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def http_json(port: int, path: str, method: str = "GET") -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def registered_as(cluster: LocalCluster, bookie_id: str) -> str | None:
    zk = KazooClient(hosts=cluster.zk.connect_string)
    zk.start(timeout=10)
    try:
        if zk.exists(f"/ledgers/available/readonly/{bookie_id}"):
            return "readonly"
        if zk.exists(f"/ledgers/available/{bookie_id}"):
            return "writable"
        return None
    finally:
        zk.stop()
        zk.close()


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def payload(i: int) -> bytes:
    return bytes([i % 251]) * ENTRY + i.to_bytes(8, "big")


async def fill_until_readonly(cluster: LocalCluster, small: LocalBookie, port: int) -> tuple[int, int, int]:
    """Write to a ledger whose write sets all hold the small bookie until it turns read-only, then
    as many entries again; check every acknowledged entry reads back. Returns (ledger id,
    ensemble changes, entries written before read-only)."""
    async with await BookKeeper.connect(cluster.metadata_uri) as bk:
        for _ in range(50):  # placement is random: a 3-bookie ensemble on 4 that holds the small one
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2, password=b"pw")
            if small.bookie_id in lh.metadata.ensembles[0]:
                break
            await lh.close()
        else:
            raise AssertionError("no ensemble held the small bookie")
        n = 0
        deadline = time.monotonic() + 120
        while registered_as(cluster, small.bookie_id) != "readonly":
            assert time.monotonic() < deadline, "the bookie never turned read-only"
            for fut in [lh.add_entry_async(payload(n + k)) for k in range(16)]:
                await fut
            n += 16
        for i in range(n, 2 * n):  # writes go on: READ_ONLY from the bookie -> ensemble change
            await lh.add_entry(payload(i))
        assert small.bookie_id not in lh.metadata.last_ensemble
        changes = bk.stats["ensemble_changes"]
        await lh.close()
        rh = await bk.open_ledger(lh.ledger_id, password=b"pw")
        got = [e.data for e in await rh.read(0, rh.last_add_confirmed)]
        assert got == [payload(i) for i in range(2 * n)], "an acknowledged entry was lost or changed"
        state = http_json(port, "/api/v1/bookie/state")
        assert state["state"] == "readonly" and "full" in state["reason"], state
        assert state["shards"][0]["state"] == "readonly" and state["shards"][0]["reason"] == state["reason"]
        return lh.ledger_id, changes, n


def delete_and_gc(cluster: LocalCluster, small: LocalBookie, port: int, ledger_id: int) -> dict[str, Any]:
    async def delete() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            await bk.delete_ledger(ledger_id)
    run(delete())
    result = http_json(port, "/api/v1/bookie/gc", method="POST")
    wait_for(lambda: registered_as(cluster, small.bookie_id) == "writable", 30, "writable again")
    return result


def test_full_ledger_dir_turns_bookie_readonly_and_back(tmpfs: tuple[Path, Path], make_cluster) -> None:
    cluster: LocalCluster = make_cluster(bookies=3, shards=1)
    port = free_port_block()
    small = cluster.add_bookie(ledger_dirs=[str(tmpfs[0])], journal_dir=str(tmpfs[1] / "journal"), http_port=port,
                               write_cache_max_bytes=2 << 20,
                               checkpoint_interval_s=0.5, **DISK_CONF)
    assert http_json(port, "/api/v1/bookie/state")["state"] == "writable"
    ledger_id, changes, n = run(fill_until_readonly(cluster, small, port))
    info = http_json(port, "/api/v1/bookie/info")
    (ldir,) = [d for d in info["dirs"] if d["kind"] == "ledger"]
    # The fill outruns the 0.1 s disk check on tmpfs; what must hold is room left for the write
    # cache (2 MiB) to be flushed, and that no write failed for lack of space.
    assert ldir["full"] and ldir["free_bytes"] > 2 << 20, f"read-only before ENOSPC: {ldir}"
    assert "No space left" not in small.log_tail(10_000)
    assert changes >= 1
    print(f"ledger dir: read-only at {1 - ldir['free_bytes'] / ldir['total_bytes']:.0%} after {n} "
          f"entries of {ENTRY} B; {changes} ensemble change(s)")
    result = delete_and_gc(cluster, small, port, ledger_id)
    print(f"GC: {result['bytes_reclaimed']} bytes reclaimed, {result['logs_deleted'] + result['logs_compacted']} "
          f"log(s) removed in {result['duration_s']}s")
    assert result["ledgers_deleted"] >= 1 and result["bytes_reclaimed"] > 0
    assert http_json(port, "/api/v1/bookie/state") == {"bookie_id": small.bookie_id, "state": "writable",
                                                       "reason": None,
                                                       "shards": [{"index": 0, "state": "writable", "reason": None}]}


def test_full_journal_dir_turns_bookie_readonly_and_back(tmpfs: tuple[Path, Path], make_cluster) -> None:
    cluster: LocalCluster = make_cluster(bookies=3, shards=1)
    port = free_port_block()
    # Checkpoints only when the (large) write cache fills: the journal is what fills the disk.
    small = cluster.add_bookie(journal_dir=str(tmpfs[0] / "journal"), ledger_dirs=[str(tmpfs[1] / "ledgers")],
                               http_port=port, checkpoint_interval_s=3600,
                               write_cache_max_bytes=256 << 20, journal_preallocate_bytes=1 << 20,
                               journal_file_max_bytes=2 << 20, journal_sync="thread", **DISK_CONF)
    ledger_id, changes, _ = run(fill_until_readonly(cluster, small, port))
    state = http_json(port, "/api/v1/bookie/state")
    assert "journal dir" in state["reason"], state
    info = http_json(port, "/api/v1/bookie/info")
    (jdir,) = [d for d in info["dirs"] if d["kind"] == "journal"]
    assert jdir["full"] and jdir["free_bytes"] > 2 << 20, f"read-only before ENOSPC: {jdir}"
    assert "No space left" not in small.log_tail(10_000)
    assert changes >= 1
    result = delete_and_gc(cluster, small, port, ledger_id)  # GC checkpoints: the journal is trimmed
    assert result["ledgers_deleted"] >= 1
    try:
        run(_simple_write(cluster))
    except BKError as e:
        raise AssertionError(f"cluster not writable after the bookie came back: {e}") from e


async def _simple_write(cluster: LocalCluster) -> None:
    async with await BookKeeper.connect(cluster.metadata_uri) as bk:
        lh = await bk.create_ledger(ensemble=4, write_quorum=4, ack_quorum=4)
        await lh.add_entry(b"x")
        await lh.close()
