"""Operators and their automation informed: every shard's Prometheus metrics on the supervisor's
http_port (parsed with prometheus_client's own parser), the admin routes, a decommission marker
turning a live bookie read-only (and back when removed), auto-recovery status on every bookie,
readiness for probes, the maintenance switch kept across a real restart, and READY=1 /
STOPPING=1 to a notify socket as systemd's Type=notify expects.

Reference: issue 10 item 4, issue 22 item 3, docs/api.md section 10; Apache BookKeeper's HTTP
admin (autorecovery/status, bookie/is_ready, bookie/state/readonly) and stats; sd_notify(3).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper import BookKeeper
from bookkeeper.bookie.sdnotify import notify_address, sd_notify
from bookkeeper.bookie.state import MANUAL_REASON
from bookkeeper.meta.underreplication import UnderReplicationManager
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.testing.cluster import LocalBookie, LocalCluster, free_port_block
from bookkeeper.testing.waiting import wait_until
from tests.conftest import run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("admin"), bookies=3, shards=2,
                     bookie_conf={"disk_check_interval_s": 0.5})
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def watched(cluster: LocalCluster) -> tuple[LocalBookie, int]:
    port = free_port_block()
    return cluster.add_bookie(http_port=port), port


def get(port: int, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=body)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read()
            return r.status, body.decode() if path == "/metrics" else json.loads(body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """name -> {labels as sorted tuple: value} for every sample."""
    status, text = get(port, "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, {}).items() if all((k, m) in labels for k, m in match.items()))


async def write_to(cluster: LocalCluster, bookie_id: str, entries: int) -> int:
    """Write `entries` to a ledger that has `bookie_id` in every write set if one can be made
    (the 50th try is used regardless); returns its id."""
    async with await BookKeeper.connect(cluster.metadata_uri) as bk:
        for attempt in range(50):
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            if bookie_id in lh.metadata.ensembles[0] or attempt == 49:
                break
            await lh.close()
        for fut in [lh.add_entry_async(b"m" * 100) for _ in range(entries)]:
            await fut
        await lh.read(0, lh.last_add_confirmed - 1)
        await lh.close()
        return lh.ledger_id


def test_metrics_parse_and_move_under_load(cluster: LocalCluster, watched: tuple[LocalBookie, int]) -> None:
    bookie, port = watched
    before = scrape(port)
    assert total(before, "bookkeeper_bookie_shards_up") == 2
    assert {dict(k)["shard"] for k in before["bookkeeper_add_entry_total"]} == {"0", "1"}
    run(write_to(cluster, bookie.bookie_id, 500))
    after = scrape(port)
    added = total(after, "bookkeeper_add_entry_total") - total(before, "bookkeeper_add_entry_total")
    assert added >= 500
    hist = total(after, "bookkeeper_add_entry_latency_seconds_count") - \
        total(before, "bookkeeper_add_entry_latency_seconds_count")
    assert hist >= 500
    inf = total(after, "bookkeeper_add_entry_latency_seconds_bucket", le="+Inf")
    assert inf == total(after, "bookkeeper_add_entry_latency_seconds_count")
    assert total(after, "bookkeeper_journal_sync_latency_seconds_count") > \
        total(before, "bookkeeper_journal_sync_latency_seconds_count")
    assert total(after, "bookkeeper_read_entry_total") > total(before, "bookkeeper_read_entry_total")
    assert total(after, "bookkeeper_journal_batch_entries_sum") >= 500
    assert total(after, "bookkeeper_ledgers") >= 1
    for name in ("bookkeeper_connections", "bookkeeper_write_cache_bytes", "bookkeeper_paused_senders",
                 "bookkeeper_journal_queue_bytes", "bookkeeper_disk_usage_ratio", "bookkeeper_bad_frames_total",
                 "bookkeeper_checkpoint_duration_seconds_count", "bookkeeper_compaction_duration_seconds_count",
                 "bookkeeper_entry_log_bytes", "bookkeeper_bookie_readonly", "bookkeeper_journal_pool_bytes",
                 "bookkeeper_journal_pool_released_bytes_total"):
        assert name in after, name
    kinds = {dict(k)["kind"] for k in after["bookkeeper_disk_usage_ratio"]}
    assert kinds == {"journal", "ledger"}


def test_a_stalled_shard_loop_shows_in_the_loop_lag_histogram(watched: tuple[LocalBookie, int]) -> None:
    """bookkeeper_shard_loop_lag_seconds: a shard whose loop is held up 1.5 s (its process
    stopped, as a long turn of its loop would hold it) records a lag above 0.25 s; the probe
    runs on every shard (observations grow on both). 1.5 s: an idle shard probes once a
    second, and some probe falls due in every 1.25 s of the stop."""
    bookie, port = watched

    def over(samples: dict[str, dict[tuple, float]], shard: str, bound: str = "0.25") -> float:
        name = "bookkeeper_shard_loop_lag_seconds"
        return (total(samples, name + "_count", shard=shard)
                - total(samples, name + "_bucket", shard=shard, le=bound))
    before = scrape(port)
    pid = bookie.shard_pid(0)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until("shard 0's stall counted above 0.25 s", lambda: over(scrape(port), "0") > over(before, "0"),
               timeout_s=30)
    after = scrape(port)
    for shard in ("0", "1"):
        assert total(after, "bookkeeper_shard_loop_lag_seconds_count", shard=shard) > \
            total(before, "bookkeeper_shard_loop_lag_seconds_count", shard=shard)


def test_admin_routes(cluster: LocalCluster, watched: tuple[LocalBookie, int]) -> None:
    bookie, port = watched
    assert get(port, "/api/v1/bookie/state") == (200, {
        "bookie_id": bookie.bookie_id, "state": "writable", "reason": None,
        "shards": [{"index": 0, "state": "writable", "reason": None},
                   {"index": 1, "state": "writable", "reason": None}]})
    status, info = get(port, "/api/v1/bookie/info")
    assert status == 200 and info["bookie_id"] == bookie.bookie_id and info["ledgers"] >= 0
    assert sorted(d["kind"] for d in info["dirs"]) == ["journal", "ledger"]
    assert all(0 < d["free_bytes"] <= d["total_bytes"] for d in info["dirs"])
    assert all(d["pool_bytes"] >= 0 and 0 <= d["usage"] <= 1 for d in info["dirs"])
    status, gc = get(port, "/api/v1/bookie/gc", method="POST")
    assert status == 200 and gc["shards_failed"] == [] and len(gc["shards"]) == 2
    assert {"bytes_reclaimed", "logs_deleted", "logs_compacted", "ledgers_deleted", "duration_s"} <= set(gc)
    assert get(port, "/api/v1/bookie/gc")[0] == 405
    # autorecovery = false here, and nobody runs it: Apache's answer all the same
    assert get(port, "/api/v1/autorecovery/status") == (200, {"enabled": True, "auditor": None, "underreplicated": 0})
    assert get(port, "/nope")[0] == 404


def test_one_forced_gc_at_a_time(watched: tuple[LocalBookie, int]) -> None:
    """100 concurrent GC POSTs run one pass: with the shards stopped (SIGSTOP) the first pass
    cannot end, so every other POST meets it and is answered 409 naming since when, and so is
    `bk bookie gc` (one line, exit 3); once the shards go on, the one pass answers 200."""
    bookie, port = watched
    shards = bookie.shard_pids()
    assert len(shards) == 2
    for pid in shards:
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(16) as pool:
            posts = [pool.submit(get, port, "/api/v1/bookie/gc", "POST") for _ in range(100)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in posts) < 99:
                assert time.monotonic() < deadline, f"{sum(f.done() for f in posts)} of 100 GC POSTs answered"
                time.sleep(0.05)
            answered = [f for f in posts if f.done()]
            busy = [f.result() for f in answered]
            cli = bk_cli("bookie", "gc", "--http", f"127.0.0.1:{port}")
            for pid in shards:
                os.kill(pid, signal.SIGCONT)
            ran = [f.result() for f in posts if f not in answered]
    finally:
        for pid in shards:
            os.kill(pid, signal.SIGCONT)
    assert {status for status, _ in busy} == {409}
    assert all("a forced GC pass is running since" in body["error"] and body["running_since"] for _, body in busy)
    assert len(ran) == 1 and ran[0][0] == 200 and ran[0][1]["shards_failed"] == [] and len(ran[0][1]["shards"]) == 2
    assert cli.returncode == 3, cli.stderr
    assert cli.stdout == "" and cli.stderr.count("\n") == 1
    assert cli.stderr.startswith(f"bk: bookie at 127.0.0.1:{port}: a forced GC pass is running since ")
    _wait_ready(port)


def _wait_registered_as(store: ZkMetadataStore, bookie_id: str, readonly: bool, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while bookie_id not in store.get_bookies(readonly=readonly) or bookie_id in store.get_bookies(
            readonly=not readonly):
        assert time.monotonic() < deadline, f"{bookie_id} not registered {'read-only' if readonly else 'writable'}"
        time.sleep(0.1)


def test_decommission_marker_turns_a_live_bookie_readonly(cluster: LocalCluster,
                                                          watched: tuple[LocalBookie, int]) -> None:
    """The marker `bk decommission` sets: the bookie re-registers read-only at once (adds get
    READ_ONLY, writers move on), says why, and is writable again when the marker goes; a
    restart while marked stays read-only."""
    bookie, port = watched
    store = ZkMetadataStore(cluster.metadata_uri, create=False)
    try:
        store.set_decommissioning(bookie.bookie_id)
        _wait_registered_as(store, bookie.bookie_id, readonly=True)
        status, state = get(port, "/api/v1/bookie/state")
        assert state["state"] == "readonly" and state["reason"] == "being decommissioned"
        assert {s["state"] for s in state["shards"]} == {"readonly"}
        before = scrape(port)
        run(write_to(cluster, "nobody", 50))  # new ensembles leave the read-only bookie out
        assert total(scrape(port), "bookkeeper_add_entry_total") == total(before, "bookkeeper_add_entry_total")
        bookie.stop()
        bookie.start()
        _wait_registered_as(store, bookie.bookie_id, readonly=True, timeout_s=60)
        store.clear_decommissioning(bookie.bookie_id)
        _wait_registered_as(store, bookie.bookie_id, readonly=False)
        assert get(port, "/api/v1/bookie/state")[1]["state"] == "writable"
    finally:
        store.clear_decommissioning(bookie.bookie_id)
        store.close()


# -- issue 22 item 3: admin HTTP for automation -------------------------------------------------
def bk_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", *args], cwd=REPO, env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60)


def _apache_keys(status: dict[str, Any]) -> dict[str, Any]:
    return {k: status[k] for k in ("enabled", "auditor", "underreplicated")}


def test_autorecovery_status_on_every_bookie_with_and_without_the_service(cluster: LocalCluster,
                                                                          watched: tuple[LocalBookie, int]) -> None:
    """A bookie without the embedded service answers from ZooKeeper what Apache answers: the
    cluster-wide flag, the elected auditor's bookie id, the under-replicated count; `bk
    autorecovery status --json` prints the same. A bookie running the service answers the same
    three, plus the service's own keys."""
    bookie, port = watched
    store = ZkMetadataStore(cluster.metadata_uri, create=False)
    urm = UnderReplicationManager(store)
    urm.ensure_layout()
    candidate = None
    try:
        urm.set_enabled(False)
        assert get(port, "/api/v1/autorecovery/status") == (200, {"enabled": False, "auditor": None,
                                                                  "underreplicated": 0})
        urm.set_enabled(True)
        candidate = urm.join_election("10.1.1.1:3181")  # a candidate standing in some other bookie
        urm.mark(7, ["10.1.1.1:3181"])
        want = {"enabled": True, "auditor": "10.1.1.1:3181", "underreplicated": 1}
        assert get(port, "/api/v1/autorecovery/status") == (200, want)
        cli = bk_cli("autorecovery", "status", "--json", "--metadata-uri", cluster.metadata_uri)
        assert cli.returncode == 0, cli.stderr
        assert _apache_keys(json.loads(cli.stdout)) == want
        mark = urm.get_mark(7)
        assert mark is not None and urm.unmark(mark)
        urm.leave_election(candidate)
        candidate = None

        with_service = cluster.add_bookie(http_port=free_port_block(), autorecovery=True,
                                          lost_bookie_delay_s=3600.0, audit_interval_s=0.5)
        try:
            sport = with_service.conf["http_port"]
            deadline = time.monotonic() + 60
            while (status := get(sport, "/api/v1/autorecovery/status")[1]).get("is_auditor") is not True:
                assert time.monotonic() < deadline, status
                time.sleep(0.2)
            want = {"enabled": True, "auditor": with_service.bookie_id, "underreplicated": 0}
            assert _apache_keys(status) == want and status["running"] is True  # the service's own keys kept
            assert get(port, "/api/v1/autorecovery/status") == (200, want)
        finally:
            with_service.stop()
    finally:
        urm.set_enabled(True)
        if candidate is not None:
            urm.leave_election(candidate)
        store.close()


def test_bookie_info_command_prints_what_the_admin_http_says(watched: tuple[LocalBookie, int]) -> None:
    """`bk bookie info --http HOST:PORT`: --json is the route's object; the table names each dir
    and the journal pool."""
    bookie, port = watched
    cli = bk_cli("bookie", "info", "--http", f"127.0.0.1:{port}", "--json")
    assert cli.returncode == 0, cli.stderr
    got, want = json.loads(cli.stdout), get(port, "/api/v1/bookie/info")[1]
    volatile = ("free_bytes", "usage", "pool_bytes")  # the journal writes between the two asks
    assert [{k: v for k, v in d.items() if k not in volatile} for d in got["dirs"]] == \
        [{k: v for k, v in d.items() if k not in volatile} for d in want["dirs"]]
    assert (got["bookie_id"], got["ledgers"]) == (want["bookie_id"], want["ledgers"])
    assert all(set(d) == set(want["dirs"][0]) for d in got["dirs"])
    table = bk_cli("bookie", "info", "--http", f"127.0.0.1:{port}")
    assert table.returncode == 0, table.stderr
    assert bookie.bookie_id in table.stdout and "journal pool" in table.stdout
    assert all(d["path"] in table.stdout for d in want["dirs"])


@pytest.mark.parametrize("body", [b"", b"yes", b"[true]", b'{"readonly": "true"}', b'{"readonly": 1}',
                                  b'{"readonly": null}', b"{}", b'{"readonly": true, "why": "x"}'])
def test_readonly_switch_refuses_a_bad_body(watched: tuple[LocalBookie, int], body: bytes) -> None:
    """Anything but {"readonly": true|false} is a 400 that says what is wanted, and changes nothing."""
    _bookie, port = watched
    status, answer = get(port, "/api/v1/bookie/state/readonly", method="PUT", body=body)
    assert status == 400 and '{"readonly": true|false}' in answer["error"], answer
    assert get(port, "/api/v1/bookie/state/readonly")[1]["readonly"] is False
    assert get(port, "/api/v1/bookie/state/readonly", method="POST", body=b'{"readonly": true}')[0] == 405


def test_readonly_switch_moves_the_registration_and_survives_restarts(cluster: LocalCluster) -> None:
    """PUT {"readonly": true}: answered once the bookie is registered read-only with every shard
    refusing adds; a real restart keeps it (the switch lives in the journal dir) until PUT
    {"readonly": false}, which a further restart keeps too. Reference: Apache BookKeeper
    PUT /api/v1/bookie/state/readonly."""
    port = free_port_block()
    bookie = cluster.add_bookie(http_port=port)
    store = ZkMetadataStore(cluster.metadata_uri, create=False)
    try:
        assert get(port, "/api/v1/bookie/state/readonly") == (200, {"readonly": False, "state": "writable",
                                                                    "reason": None})
        on = {"readonly": True, "state": "readonly", "reason": MANUAL_REASON}
        assert get(port, "/api/v1/bookie/state/readonly", method="PUT", body=b'{"readonly": true}') == (200, on)
        assert bookie.bookie_id in store.bookie_ids(readonly=True)  # already moved when the PUT answered
        assert bookie.bookie_id not in store.bookie_ids()
        state = get(port, "/api/v1/bookie/state")[1]
        assert state["reason"] == MANUAL_REASON and {s["state"] for s in state["shards"]} == {"readonly"}
        assert get(port, "/api/v1/bookie/is_ready") == (200, {"ready": True, "state": "readonly"})

        bookie.stop()
        bookie.start()
        _wait_registered_as(store, bookie.bookie_id, readonly=True, timeout_s=60)
        _wait_ready(port)
        assert get(port, "/api/v1/bookie/state/readonly") == (200, on)

        off = {"readonly": False, "state": "writable", "reason": None}
        assert get(port, "/api/v1/bookie/state/readonly", method="PUT", body=b'{"readonly": false}') == (200, off)
        assert bookie.bookie_id in store.bookie_ids() and bookie.bookie_id not in store.bookie_ids(readonly=True)
        bookie.stop()
        bookie.start()
        _wait_registered_as(store, bookie.bookie_id, readonly=False, timeout_s=60)
        _wait_ready(port)
        assert get(port, "/api/v1/bookie/state/readonly") == (200, off)
    finally:
        bookie.stop()
        store.close()


def _is_ready(port: int) -> bool:
    try:
        return get(port, "/api/v1/bookie/is_ready")[0] == 200
    except OSError:
        return False  # not listening yet


def _wait_ready(port: int) -> None:
    wait_until("ready", lambda: _is_ready(port), every_s=0.1)


def test_notify_socket_addresses() -> None:
    """'@name' is the abstract namespace, '/path' a file; anything else names no AF_UNIX socket."""
    assert [notify_address(v) for v in ("@sd", "/run/systemd/notify", "vsock:2:1234", "@", "relative")] == \
        ["\0sd", "/run/systemd/notify", None, None, None]


def test_sd_notify_sends_one_datagram_and_nothing_without_a_socket(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(tmp_path / "notify"))
        s.settimeout(5)
        assert sd_notify("READY=1\nSTATUS=x", environ={"NOTIFY_SOCKET": str(tmp_path / "notify")})
        assert s.recv(4096) == b"READY=1\nSTATUS=x"
    assert not sd_notify("READY=1", environ={})
    assert not sd_notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone")})  # logged, not raised


def test_supervisor_notifies_ready_once_ready_and_stopping_and_is_ready_follows_the_shards(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bookie started with NOTIFY_SOCKET (as systemd's Type=notify does): is_ready answers 200
    only with the registration in ZooKeeper; READY=1 arrives when is_ready answers 200; a shard
    that stops answering makes it 503 with the reason, and 200 again once it answers; a
    graceful stop sends STOPPING=1."""
    name = f"bk-test-notify-{os.getpid()}-{time.monotonic_ns()}"
    store = ZkMetadataStore(cluster.metadata_uri, create=False)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        port = free_port_block()
        bookie = cluster.add_bookie(wait=False, http_port=port)
        monkeypatch.delenv("NOTIFY_SOCKET")
        answers: list[tuple[int, bool]] = []  # (status, registered right after) while it starts
        stop_polling = threading.Event()

        def poll() -> None:
            while not stop_polling.is_set():
                try:
                    status = get(port, "/api/v1/bookie/is_ready")[0]
                    answers.append((status, bookie.bookie_id in store.bookie_ids() | store.bookie_ids(readonly=True)))
                except OSError:
                    pass  # not listening yet
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            sock.settimeout(120)
            message = sock.recv(4096).decode()
            assert message.startswith("READY=1\n") and f"STATUS={bookie.bookie_id} writable" in message, message
            assert get(port, "/api/v1/bookie/is_ready") == (200, {"ready": True, "state": "writable"})
        finally:
            stop_polling.set()
            poller.join()
        assert all(registered for status, registered in answers if status == 200), answers
        assert {status for status, _ in answers} <= {200, 503}, answers

        shard = bookie.shard_pid(1)
        os.kill(shard, signal.SIGSTOP)
        try:
            status, body = get(port, "/api/v1/bookie/is_ready")
            assert (status, body) == (503, {"ready": False, "reason": "shard(s) [1] not answering"})
        finally:
            os.kill(shard, signal.SIGCONT)
        assert get(port, "/api/v1/bookie/is_ready")[0] == 200

        bookie.stop()
        messages = []
        sock.settimeout(10)
        while "STOPPING=1" not in messages:
            messages.append(sock.recv(4096).decode())
        assert messages[-1] == "STOPPING=1", messages
    store.close()


def test_a_cross_site_post_is_refused(watched: tuple[LocalBookie, int]) -> None:
    """Found by review: a page the operator visits could POST here from the browser (a bookie
    without authentication, or mtls with the operator's certificate in the browser). A POST or
    PUT carrying an Origin header is refused (403, counted); GETs and bk's own requests work."""
    _bookie, port = watched
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/bookie/state/readonly", method="PUT",
                                 data=b'{"readonly": true}', headers={"Origin": "https://evil.example"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 403 and "cross-site" in json.loads(e.value.read())["error"]
    assert get(port, "/api/v1/bookie/state/readonly")[1]["readonly"] is False
    assert scrape(port)["bookkeeper_admin_http_refused_total"][(("reason", "cross_site"),)] == 1
