"""A ZooKeeper that cannot be reached is an error at once that says what is wrong (issue 27 item 3).

Refused (every address: a port bound by nobody, or bound and not listening), a TCP connect
that gets no answer (a listener whose accept queue is full drops the SYN), a hung server (a
socket that listens and never reads: TCP is accepted, no session starts), and a URI mixing
them with a live ZooKeeper: the decisions of bookkeeper/meta/zk_connect.py as table tests,
then `bk` (one line, exit 1, no traceback) and `BookKeeper.connect` against those real
sockets. Durations are printed, not asserted (timing goals are benchmarks); what is
asserted is the message, which the old code never produced ("Connection time-out", after
15 s, whatever the cause).

Reference: docs/api.md section 2 (exit codes) and section 3 (`connect`'s errors,
`zk_connect_timeout_s`).
"""
from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bookkeeper.sync
from bookkeeper import BookKeeper
from bookkeeper.client.config import ClientConfig
from bookkeeper.errors import BKError, ConfigError, MetadataServiceError, ZooKeeperUnreachableError
from bookkeeper.meta.zk import ZkMetadataStore, parse_metadata_uri
from bookkeeper.meta.zk_connect import (REFUSED, UNRESOLVED, StartVerdict, failure_reason, hung_message,
                                        start_verdict, unreachable_message)
from bookkeeper.testing.zookeeper import ZooKeeperServer
from tests.conftest import run
from tests.test_cli import assert_one_line_error, bk

V = StartVerdict


# -- decisions ----------------------------------------------------------------------
@pytest.mark.parametrize("error, words", [
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "connection refused"),
    (OSError(errno.EHOSTUNREACH, "No route to host"), "no route to host"),
    (OSError(errno.ENETUNREACH, "Network is unreachable"), "network unreachable"),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "connection reset"),
    (TimeoutError("timed out"), "no answer within 2 s"),
    (OSError(), "no answer within 2 s"),  # kazoo's create_tcp_connection once its time is used up
    (OSError(errno.EACCES, "Permission denied"), "permission denied"),
    (OSError("something odd"), "something odd"),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_failure_reason_words_each_failed_connect(error: OSError, words: str) -> None:
    assert failure_reason(error, connect_timeout_s=2.0) == words


@pytest.mark.parametrize("connected, addresses, failed, accepted, timed_out, verdict", [
    (True, 1, 0, 1, False, V.CONNECTED),
    (True, 2, 1, 1, True, V.CONNECTED),
    (False, 1, 1, 0, False, V.UNREACHABLE),   # the only address refused: at once
    (False, 3, 3, 0, False, V.UNREACHABLE),   # every address failed once: at once
    (False, 3, 2, 0, False, V.WAIT),          # one not tried yet
    (False, 2, 1, 1, False, V.WAIT),          # one refused, one accepted TCP: a session may still start
    (False, 2, 1, 1, True, V.HUNG),           # ... and none did within the session timeout
    (False, 1, 0, 1, True, V.HUNG),
    (False, 3, 1, 0, True, V.UNREACHABLE),    # time up before every address was tried
    (False, 1, 0, 0, True, V.UNREACHABLE),
    (False, 1, 0, 0, False, V.WAIT),
])
def test_start_verdict_table(connected: bool, addresses: int, failed: int, accepted: int, timed_out: bool,
                             verdict: StartVerdict) -> None:
    assert start_verdict(connected=connected, addresses=addresses, failed=failed, accepted=accepted,
                         timed_out=timed_out) is verdict


@pytest.mark.parametrize("reasons, message", [
    ({"127.0.0.1:2181": [REFUSED]}, "cannot reach ZooKeeper at 127.0.0.1:2181 (connection refused): is it running?"),
    ({"localhost:2181": [REFUSED, REFUSED]},  # two addresses of one name, same reason: said once
     "cannot reach ZooKeeper at localhost:2181 (connection refused): is it running?"),
    ({"a:1": [REFUSED], "b:2": ["no route to host"]},
     "cannot reach ZooKeeper at a:1 (connection refused), b:2 (no route to host): "
     "is it running, and is the address right?"),
    ({"zk.invalid:2181": [UNRESOLVED]},
     "cannot reach ZooKeeper at zk.invalid:2181 (cannot resolve the host name): is the address right?"),
    ({"localhost:1": [REFUSED, "no answer within 2 s"]},
     "cannot reach ZooKeeper at localhost:1 (connection refused; no answer within 2 s): "
     "is it running, and is the address right?"),
    ({}, "cannot reach ZooKeeper: no answer within 10 s"),
])
def test_unreachable_message_names_each_host_and_why(reasons: dict[str, list[str]], message: str) -> None:
    assert unreachable_message(reasons, waited_s=10.0) == message


def test_hung_message_names_the_server_and_the_session_timeout() -> None:
    assert hung_message(["127.0.0.1:5", "127.0.0.1:5"], session_timeout_s=2.5) == (
        "ZooKeeper at 127.0.0.1:5 accepted a connection but started no session within the session timeout "
        "(2.5 s): is it hung or overloaded?")


@pytest.mark.parametrize("uri", ["zk://h:abc/ledgers", "zk://h:99999/ledgers"])
def test_a_bad_host_port_in_the_uri_is_a_bk_error(uri: str) -> None:
    with pytest.raises(BKError, match="bad host:port"):
        parse_metadata_uri(uri)


@pytest.mark.parametrize("value", [0, -1.0])
def test_zk_connect_timeout_must_be_positive(value: float) -> None:
    with pytest.raises(ConfigError, match="zk_connect_timeout_s"):
        ClientConfig(zk_connect_timeout_s=value).validate()


# -- real sockets -------------------------------------------------------------------
@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound and not listening: every connect to it is refused, and no other
    process can take it while the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A hung ZooKeeper: a socket that listens (the kernel completes every TCP handshake) and
    never accepts or reads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose TCP connects get no answer: its listener's accept queue is full (backlog 0,
    filled by connects nobody accepts), so the kernel drops further SYNs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        fillers = []
        try:
            for _ in range(3):
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                fillers.append(c)
            time.sleep(0.2)  # the handshakes that fit complete
            yield port
        finally:
            for c in fillers:
                c.close()


def _timed(what: str, fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    elapsed = time.perf_counter() - t0
    print(f"{what}: {elapsed:.2f} s")
    return elapsed


def test_bk_against_a_closed_port_says_connection_refused_in_one_line() -> None:
    """The acceptance command: `bk bookies list --metadata-uri zk://127.0.0.1:1/ledgers` (nothing
    listens on port 1) exits 1 with the new message."""
    results = []
    _timed("bk bookies list against zk://127.0.0.1:1 (process start included)",
           lambda: results.append(bk("bookies", "list", uri="zk://127.0.0.1:1/ledgers")))
    r = results[0]
    assert r.returncode == 1, str(r)
    line = assert_one_line_error(r)
    assert line == ("bk: ZooKeeperUnreachableError: cannot reach ZooKeeper at 127.0.0.1:1 (connection refused): "
                    "is it running?"), line
    assert r.stdout == b""


def test_bk_against_a_hung_zookeeper_says_so_after_the_session_timeout(hung_port: int) -> None:
    results = []
    _timed("bk ledgers list against a hung server (session timeout 10 s)",
           lambda: results.append(bk("ledgers", "list", uri=f"zk://127.0.0.1:{hung_port}/ledgers")))
    r = results[0]
    assert r.returncode == 1, str(r)
    line = assert_one_line_error(r, mentions="ZooKeeperUnreachableError")
    assert (f"ZooKeeper at 127.0.0.1:{hung_port} accepted a connection but started no session within the "
            f"session timeout (10 s): is it hung or overloaded?") in line, line


def test_connect_to_a_refused_port_raises_zookeeper_unreachable(refusing_port: int) -> None:
    uri = f"zk://127.0.0.1:{refusing_port}/ledgers"
    with pytest.raises(ZooKeeperUnreachableError) as caught:
        _timed("BookKeeper.connect, refused", lambda: run(BookKeeper.connect(uri)))
    assert str(caught.value) == f"cannot reach ZooKeeper at 127.0.0.1:{refusing_port} (connection refused): " \
                                "is it running?"
    assert isinstance(caught.value, MetadataServiceError)
    with pytest.raises(ZooKeeperUnreachableError, match="connection refused"):
        bookkeeper.sync.BookKeeper.connect(uri)


def test_connect_to_a_hung_server_fails_after_the_session_timeout(hung_port: int) -> None:
    with pytest.raises(ZooKeeperUnreachableError) as caught:
        _timed("BookKeeper.connect, hung, session timeout 2 s",
               lambda: run(BookKeeper.connect(f"zk://127.0.0.1:{hung_port}/ledgers", zk_session_timeout_ms=2000)))
    assert str(caught.value) == (f"ZooKeeper at 127.0.0.1:{hung_port} accepted a connection but started no "
                                 f"session within the session timeout (2 s): is it hung or overloaded?")


def test_a_tcp_connect_without_answer_fails_after_the_connect_timeout(silent_port: int) -> None:
    with pytest.raises(ZooKeeperUnreachableError) as caught:
        _timed("ZkMetadataStore, SYN dropped, connect timeout 1 s",
               lambda: ZkMetadataStore(f"zk://127.0.0.1:{silent_port}/ledgers", create=False,
                                       session_timeout_ms=10_000, connect_timeout_s=1.0))
    assert str(caught.value) == (f"cannot reach ZooKeeper at 127.0.0.1:{silent_port} (no answer within 1 s): "
                                 "is it running, and is the address right?")


def test_every_address_is_named_and_refused_only_when_every_one_refused(refusing_port: int, hung_port: int) -> None:
    """One refusing and one hung address: not "refused" (one accepted TCP), but hung, after the
    session timeout; two refusing addresses and a name that does not resolve: each named."""
    with pytest.raises(ZooKeeperUnreachableError) as caught:
        ZkMetadataStore(f"zk://127.0.0.1:{refusing_port},127.0.0.1:{hung_port}/ledgers", create=False,
                        session_timeout_ms=2000)
    assert str(caught.value).startswith(f"ZooKeeper at 127.0.0.1:{hung_port} accepted a connection"), caught.value
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        second = other.getsockname()[1]
        with pytest.raises(ZooKeeperUnreachableError) as caught:
            ZkMetadataStore(f"zk://127.0.0.1:{refusing_port},127.0.0.1:{second},zk.invalid:2181/ledgers",
                            create=False)
    assert str(caught.value) == (
        f"cannot reach ZooKeeper at 127.0.0.1:{refusing_port} (connection refused), 127.0.0.1:{second} "
        "(connection refused), zk.invalid:2181 (cannot resolve the host name): is it running, and is the address "
        "right?")


def test_a_refusing_address_beside_a_live_zookeeper_connects(tmp_path: Path, refusing_port: int) -> None:
    with ZooKeeperServer(tmp_path / "zk") as zk:
        ZkMetadataStore(zk.metadata_uri("/ledgers")).close()  # lays out a cluster root
        uri = f"zk://127.0.0.1:{refusing_port},{zk.connect_string}/ledgers"

        async def connect() -> int:
            async with await BookKeeper.connect(uri) as client:
                return len(await client.refresh_bookies())
        assert run(connect()) == 0


# -- a bookie started before its ZooKeeper ----------------------------------------------
def test_a_bookie_started_before_its_zookeeper_waits_for_it(tmp_path: Path) -> None:
    """The supervisor's first session is retried with back-off while ZooKeeper refuses (a host
    booting before its ZooKeeper; under supervisord a bookie that exits within startsecs is
    marked FATAL for good): here the first back-off starts a real ZooKeeper on the refused port,
    and the next attempt connects."""
    from bookkeeper.bookie.supervisor import connect_at_start
    from bookkeeper.config import BookieConfig
    from bookkeeper.testing.cluster import free_port_block

    port = free_port_block(1)  # nobody listens on it yet: refused
    zk = ZooKeeperServer(tmp_path / "zk", port=port)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 1:
            zk.start()

    cfg = BookieConfig(metadata_uri=f"zk://127.0.0.1:{port}/ledgers")
    try:
        store = connect_at_start(cfg, sleep=sleep)
        store.close()
    finally:
        zk.stop()
    assert slept == [1.0]


def test_a_bookie_gives_up_on_an_unreachable_zookeeper_after_its_wait(refusing_port: int) -> None:
    """With no ZooKeeper coming, the attempts back off (1, 2, 4 s ...) on the caller's clock and
    the last one's error is raised once the wait is spent."""
    from bookkeeper.bookie.supervisor import connect_at_start
    from bookkeeper.config import BookieConfig

    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    cfg = BookieConfig(metadata_uri=f"zk://127.0.0.1:{refusing_port}/ledgers")
    with pytest.raises(ZooKeeperUnreachableError, match="connection refused"):
        connect_at_start(cfg, wait_s=10.0, clock=lambda: now[0], sleep=sleep)
    assert slept == [1.0, 2.0, 4.0]
