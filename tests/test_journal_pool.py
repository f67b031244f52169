"""The journal's reuse pool never holds a bookie read-only (issue 22 item 2).

A bookie whose journal dir is its own small filesystem (a real tmpfs, mounted and unmounted
by the test): the pool (trimmed files kept for reuse, the zero-filled spare) counts as free in
every disk check, and is given back, oldest first, as soon as the disk passes
disk_usage_warn (logged once, counted in bookkeeper_journal_pool_released_bytes_total). A
filler file turns the bookie read-only; once it is removed the bookie is writable again,
though before this its own pool kept the disk over disk_usage_lwm for good. The
operator's maintenance switch and a full journal disk combine: writable only when neither holds.

Sizes: a 64 MiB filesystem, 4 MiB journal files, 4 pooled at most. Four rolls, then a
checkpoint: 4 files pooled + the current one + the spare = 24 MiB (37.5%): under warn 40%,
over lwm 30%: the state the issue found, a disk its own pool keeps over lwm.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper import BookKeeper
from bookkeeper.bookie.state import MANUAL_REASON
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.testing.cluster import LocalBookie, LocalCluster, free_port_block
from bookkeeper.testing.waiting import wait_until
from tests.conftest import run

MIB = 1 << 20
FILE_BYTES = 4 * MIB
ENTRY = 64 * 1024
FILLER_BYTES = 30 * MIB  # with the current file: 34 MiB, 53% counting the pool as free; 84% with it
CONF = {"disk_usage_warn": 0.4, "disk_usage_threshold": 0.5, "disk_usage_lwm": 0.3, "disk_check_interval_s": 0.2,
        "journal_preallocate_bytes": FILE_BYTES, "journal_file_max_bytes": FILE_BYTES, "journal_reuse_files": 4,
        # checkpoints only when the test asks for one (a GC pass that drops a deleted ledger)
        "checkpoint_interval_s": 3600.0, "write_cache_max_bytes": 256 * MIB, "gc_interval_s": 3600.0}


def _mount(mnt: Path, size: str) -> None:
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (the test needs root): {done.stderr.strip()}")


def _umount(mnt: Path) -> None:
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], check=True)  # something still holds it: detach it now


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(journal fs of 64 MiB, roomy fs of 256 MiB for the ledger dir): the thresholds apply to
    every dir, and the host's disk usage is nobody's business here."""
    mounted: list[Path] = []
    try:
        for name, size in (("journal-fs", "64m"), ("ledger-fs", "256m")):
            _mount(tmp_path / name, size)
            mounted.append(tmp_path / name)
        yield mounted[0], mounted[1]
    finally:
        for mnt in mounted:
            _umount(mnt)


def http(port: int, path: str, method: str = "GET", body: bytes | None = None) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=body)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def journal_info(port: int) -> dict[str, Any]:
    (jdir,) = [d for d in http(port, "/api/v1/bookie/info")["dirs"] if d["kind"] == "journal"]
    return jdir


def released_metric(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "bookkeeper_journal_pool_released_bytes_total")


def wait_for(what: str, cond: Callable[[], bool]) -> float:
    """Until cond() holds; returns when (time.monotonic())."""
    wait_until(what, cond)
    return time.monotonic()


def registered_as(store: ZkMetadataStore, bookie_id: str) -> str | None:
    if bookie_id in store.bookie_ids(readonly=True):
        return "readonly"
    return "writable" if bookie_id in store.bookie_ids() else None


def is_state(port: int, store: ZkMetadataStore, bookie: LocalBookie, state: str) -> bool:
    """The bookie says `state` and ZooKeeper has it registered so."""
    return http(port, "/api/v1/bookie/state")["state"] == state and registered_as(store, bookie.bookie_id) == state


async def roll_and_checkpoint(cluster: LocalCluster, bookie: LocalBookie, port: int, rolls: int) -> None:
    """Write to a ledger on every bookie until the bookie's journal rolled `rolls` times, then
    delete it and run a GC pass: its checkpoint trims every file before the current one."""
    shard_dir = Path(bookie.conf["journal_dir"]) / "shard-0"
    first = max(int(p.stem, 16) for p in shard_dir.glob("*.jnl"))
    async with await BookKeeper.connect(cluster.metadata_uri) as bk:
        lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3, password=b"pw")
        assert bookie.bookie_id in lh.metadata.ensembles[0]
        while max(int(p.stem, 16) for p in shard_dir.glob("*.jnl")) < first + rolls:
            for fut in [lh.add_entry_async(os.urandom(ENTRY)) for _ in range(8)]:
                await fut
        await lh.close()
        await bk.delete_ledger(lh.ledger_id)
    assert http(port, "/api/v1/bookie/gc", method="POST")["ledgers_deleted"] == 1


RELEASED = re.compile(r"released (\d+) pooled journal file\(s\), (\d+) bytes: (.*)$")


def stable_pool_bytes(port: int) -> int:
    """The pool once the spare's zero-fill (a background thread) is done: two equal looks."""
    last = -1
    while (now := journal_info(port)["pool_bytes"]) != last:
        last = now
        time.sleep(0.3)
    return now


def test_full_journal_disk_gives_back_its_pool_and_turns_writable_again(disks: tuple[Path, Path],
                                                                         make_cluster) -> None:
    journal_fs, ledger_fs = disks
    cluster: LocalCluster = make_cluster(bookies=2, shards=1)
    port = free_port_block()
    bookie = cluster.add_bookie(journal_dir=str(journal_fs / "journal"), ledger_dirs=[str(ledger_fs / "ledgers")],
                                http_port=port, **CONF)
    store = ZkMetadataStore(cluster.metadata_uri, create=False)
    try:
        # 1. Four rolls and a checkpoint: the pool holds the four trimmed files (and the spare).
        run(roll_and_checkpoint(cluster, bookie, port, rolls=4))
        pool = stable_pool_bytes(port)
        jdir = journal_info(port)
        raw = 1 - jdir["free_bytes"] / jdir["total_bytes"]
        assert pool >= 4 * FILE_BYTES, jdir
        assert CONF["disk_usage_lwm"] <= raw < CONF["disk_usage_warn"], f"the pool keeps the disk over lwm: {jdir}"
        assert jdir["usage"] == pytest.approx(raw - pool / jdir["total_bytes"], abs=1e-3)  # pool counted as free
        assert is_state(port, store, bookie, "writable") and released_metric(port) == 0
        print(f"\njournal fs {jdir['total_bytes'] / MIB:.0f} MiB: pool {pool / MIB:.0f} MiB, raw {raw:.1%}, "
              f"counted {jdir['usage']:.1%}")

        # 2. A filler pushes the disk over the threshold even with the pool counted as free.
        filler = journal_fs / "filler"
        t0 = time.monotonic()
        with open(filler, "wb") as f:
            f.write(b"\xff" * FILLER_BYTES)
            os.fsync(f.fileno())
        t_readonly = wait_for("read-only", lambda: is_state(port, store, bookie, "readonly"))
        state = http(port, "/api/v1/bookie/state")
        assert state["reason"].startswith(f"journal dir {journal_fs / 'journal'} is "), state
        t_released = wait_for("the pool released", lambda: journal_info(port)["pool_bytes"] == 0)
        assert released_metric(port) == pool
        # Each release is logged once, files oldest first. The filler may still be growing when a
        # check runs, so the pool can go in more than one release: together they are the pool.
        releases = [RELEASED.search(line) for line in bookie.log_tail(10_000).splitlines()
                    if "pooled journal file(s)" in line]
        assert releases and all(releases), releases
        names = [n for m in releases for n in m[3].split(", ")]
        assert sum(int(m[2]) for m in releases) == pool, releases
        assert sum(int(m[1]) for m in releases) == len(names) == len(set(names)), names
        reuse = [n for n in names if n.startswith("reuse-")]
        assert reuse == sorted(reuse) and names[:len(reuse)] == reuse, names  # the reuse files first, oldest first
        assert "No space left" not in bookie.log_tail(10_000)

        # 3. The filler goes: only the current journal file is left, under lwm: writable again.
        t1 = time.monotonic()
        filler.unlink()
        t_writable = wait_for("writable again", lambda: is_state(port, store, bookie, "writable"))
        print(f"journal disk timeline: filler written at t=0, read-only at t={t_readonly - t0:.2f}s, pool of "
              f"{pool / MIB:.0f} MiB released by t={t_released - t0:.2f}s; filler removed at t={t1 - t0:.2f}s, "
              f"writable again at t={t_writable - t0:.2f}s ({t_writable - t1:.2f}s after the removal)")

        # 4. Pooling is back under lwm, and the pool is counted as free again.
        run(roll_and_checkpoint(cluster, bookie, port, rolls=2))
        jdir = journal_info(port)
        assert jdir["pool_bytes"] > 0 and not jdir["full"], jdir
        raw = 1 - jdir["free_bytes"] / jdir["total_bytes"]
        assert jdir["usage"] == pytest.approx(raw - jdir["pool_bytes"] / jdir["total_bytes"], abs=1e-3)

        # 5. The maintenance switch and a full journal disk: writable only when neither holds.
        switch = "/api/v1/bookie/state/readonly"
        assert http(port, switch, "PUT", b'{"readonly": true}')["reason"] == MANUAL_REASON
        with open(filler, "wb") as f:
            f.write(b"\xff" * FILLER_BYTES)
        wait_for("the journal dir full", lambda: journal_info(port)["full"])
        after = http(port, switch, "PUT", b'{"readonly": false}')
        assert after["state"] == "readonly" and after["reason"].startswith("journal dir "), after
        assert registered_as(store, bookie.bookie_id) == "readonly"
        filler.unlink()
        wait_for("writable with neither", lambda: is_state(port, store, bookie, "writable"))
    finally:
        store.close()
        bookie.stop()  # before the fixture unmounts its journal
