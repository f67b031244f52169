"""Locust load tests against a real cluster (docs/api.md section 8), and the gevent bridge.

Each run is the real `locust` command line: headless with the three user classes,
then in distributed mode (a master and two workers). The bridge test measures how
late a 1 ms gevent timer fires while greenlets wait on the asyncio client, against
a control that waits the naive way (blocking the hub).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bookkeeper.testing.cluster import LocalCluster, free_port_block
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.runtime(50)]
LOCUST = str(Path(sys.executable).parent / "locust")
LOCUSTFILE = str(REPO / "loadtest" / "locustfile.py")
NAMES = ("add_entry", "read", "tail", "create_ledger", "close")
RUN_S = 15


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("loadtest"), bookies=3, shards=1)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "BK_METADATA_URI"}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["Name"]: row for row in csv.DictReader(f) if row["Type"] == "bookkeeper"}


def _check_results(prefix: Path) -> dict[str, dict[str, str]]:
    """Every documented request name ran, nothing failed, and the HDR file counts exactly the
    requests locust counted (its final JSON: the CSV is a snapshot up to a second old), at
    sub-millisecond resolution."""
    stats = _rows(Path(f"{prefix}_stats.csv"))
    for name in NAMES:
        assert name in stats and int(stats[name]["Request Count"]) > 0, (name, sorted(stats))
    final = {e["name"]: e for e in json.loads(Path(f"{prefix}.json").read_text()) if e["method"] == "bookkeeper"}
    assert all(e["num_failures"] == 0 for e in final.values()), final
    hdr = _rows(Path(f"{prefix}_hdr.csv"))
    assert {n: int(row["Count"]) for n, row in hdr.items()} == {n: e["num_requests"] for n, e in final.items()}
    values = [float(hdr["add_entry"][c]) for c in ("Min (ms)", "p50 (ms)", "p90 (ms)", "p99 (ms)")]
    assert any(v != int(v) for v in values), values  # not rounded to whole milliseconds
    return hdr


def test_headless_run_with_the_three_user_classes(cluster: LocalCluster, tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    proc = subprocess.run([LOCUST, "-f", LOCUSTFILE, "--headless", "-u", "6", "-r", "6", "-t", f"{RUN_S}s",
                           "--metadata-uri", cluster.metadata_uri, "--csv", str(prefix), "--json-file", str(prefix),
                           "--only-summary", "WriterUser", "ReaderUser", "TailerUser"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=RUN_S + 90,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    hdr = _check_results(prefix)
    print({n: (hdr[n]["Count"], hdr[n]["p50 (ms)"], hdr[n]["p99 (ms)"]) for n in NAMES})


def test_distributed_run_one_master_two_workers(cluster: LocalCluster, tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    port = free_port_block(1)
    logs = [open(tmp_path / f"{n}.log", "wb") for n in ("master", "worker1", "worker2")]
    master = subprocess.Popen([LOCUST, "-f", LOCUSTFILE, "--headless", "--master", "--master-bind-host",
                               "127.0.0.1", "--master-bind-port", str(port), "--expect-workers", "2",
                               "-u", "6", "-r", "6", "-t", f"{RUN_S}s", "--csv", str(prefix), "--json-file",
                               str(prefix), "--only-summary", "--metadata-uri", cluster.metadata_uri],
                              cwd=tmp_path, env=_env(), stdout=logs[0], stderr=logs[0], stdin=subprocess.DEVNULL)
    workers = [subprocess.Popen([LOCUST, "-f", LOCUSTFILE, "--worker", "--master-host", "127.0.0.1",
                                 "--master-port", str(port)],
                                cwd=tmp_path, env=_env(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
               for log in logs[1:]]
    try:
        assert master.wait(timeout=RUN_S + 120) == 0, (tmp_path / "master.log").read_text()[-4000:]
        for w in workers:
            w.wait(timeout=30)  # the master tells its workers to quit
        hdr = _check_results(prefix)
        print({n: (hdr[n]["Count"], hdr[n]["p50 (ms)"], hdr[n]["p99 (ms)"]) for n in NAMES})
    finally:
        for p in (master, *workers):
            _stop(p)
        for log in logs:
            log.close()


def test_failures_carry_the_client_error_class(cluster: LocalCluster, tmp_path: Path) -> None:
    """An ensemble larger than the cluster: create_ledger fails, reported with its error class."""
    prefix = tmp_path / "run"
    proc = subprocess.run([LOCUST, "-f", LOCUSTFILE, "--headless", "-u", "1", "-r", "1", "-t", "3s",
                           "--metadata-uri", cluster.metadata_uri, "--ensemble", "5", "--csv", str(prefix),
                           "--only-summary", "WriterUser"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=90,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr[-3000:]  # locust's exit code when requests failed
    with open(f"{prefix}_failures.csv") as f:
        failures = list(csv.DictReader(f))
    assert failures and all(row["Name"] == "create_ledger" for row in failures), failures
    assert "NotEnoughBookiesError" in failures[0]["Error"], failures


HUB_PROBE = r'''
from gevent import monkey; monkey.patch_all()
import asyncio, json, sys, time
import gevent
sys.path.insert(0, sys.argv[1])
from gevent_asyncio import AsyncioThread
from bookkeeper import BookKeeper

uri, mode = sys.argv[2], sys.argv[3]
bridge = AsyncioThread()
bk = bridge.call(BookKeeper.connect(uri))
lh = bridge.call(bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1))

native_lock = monkey.get_original("_thread", "allocate_lock")

def call(coro):
    if mode == "blocking":  # a hand-off through a native lock: the greenlet blocks its thread, and the hub
        done = native_lock()
        done.acquire()
        fut = asyncio.run_coroutine_threadsafe(coro, bridge.loop)
        fut.add_done_callback(lambda f: done.release())
        # Blocks the thread for as long as the add takes; every 0.5 s it lets the hub run once,
        # so an add that needs a greenlet (a patched kazoo or executor thread) cannot deadlock it.
        while not done.acquire(timeout=0.5):
            gevent.sleep(0)
        return fut.result()
    return bridge.call(coro)

lateness, running = [], True
def ticker():
    while running:
        t = time.perf_counter()
        gevent.sleep(0.001)
        lateness.append(time.perf_counter() - t - 0.001)

def writer():
    for _ in range(400):
        call(lh.add_entry(b"x" * 100))

tick = gevent.spawn(ticker)
gevent.sleep(0.01)
t0 = time.perf_counter()
gevent.joinall([gevent.spawn(writer) for _ in range(4)])
elapsed = time.perf_counter() - t0
running = False
tick.join()
bridge.call(lh.close())
bridge.call(bk.close())
bridge.stop()
print(json.dumps({"max_late_ms": max(lateness) * 1000, "ticks": len(lateness), "elapsed_s": elapsed}))
'''


def test_the_bridge_never_blocks_the_gevent_hub(cluster: LocalCluster, tmp_path: Path) -> None:
    """While four greenlets make 1,600 adds through the bridge, a 1 ms gevent timer keeps firing
    on time; the same adds waited for by blocking the greenlet's thread starve it (the control,
    which shows the probe can tell the difference)."""
    script = tmp_path / "hub_probe.py"
    script.write_text(HUB_PROBE)

    def probe(mode: str) -> dict[str, float]:
        p = subprocess.run([sys.executable, str(script), str(REPO / "loadtest"), cluster.metadata_uri, mode],
                           capture_output=True, text=True, timeout=120, env=_env(), stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    bridged, blocking = probe("bridge"), probe("blocking")
    print(f"bridge: {bridged}; blocking control: {blocking}")
    assert blocking["max_late_ms"] > 100, blocking  # one greenlet's 400 adds without a yield
    assert bridged["max_late_ms"] < 50, bridged
    assert bridged["ticks"] * 0.005 > bridged["elapsed_s"], bridged  # a tick every 5 ms at least, on average
