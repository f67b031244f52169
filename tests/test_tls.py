"""TLS between client and bookies (issue 23 item 1), client side, over real bookies
(LocalCluster) with certificates the tests make (bookkeeper.testing.pki, a trustme CA):
a 3/2/2 ledger over mTLS; each refusal an AuthenticationError naming why (a plain client
against `require`, an untrusted CA, a certificate for another bookie id, a rogue bookie
holding a valid client certificate, a registration pointing a bookie id elsewhere, an
expired client certificate); and a writer that keeps writing while every certificate and
then the CA are rolled.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from bookkeeper import BookKeeper, errors
from bookkeeper.client.bookie_client import ShardConnection
from bookkeeper.proto import NO_KEY, REQUEST_HEADER_BYTES, Op, encode_responses, parse_requests
from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.testing.pki import TestPKI, install
from tests.conftest import run

pytestmark = [pytest.mark.cluster, pytest.mark.runtime(120)]

MTLS = {"tls": "require", "tls_client_auth": True, "auth_provider": "mtls", "tls_reload_interval_s": 1.0}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture(scope="module")
def mtls_cluster(tmp_path_factory: pytest.TempPathFactory, pki: TestPKI) -> Iterator[LocalCluster]:
    """3 bookies, tls = require, client certificates required, principal = the certificate's CN."""
    c = LocalCluster(tmp_path_factory.mktemp("mtls"), bookies=3, shards=2, pki=pki, bookie_trust=MTLS)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def _first_add_error(uri: str, **kwargs: Any) -> BaseException:
    """The error a client with these keywords gets at its first ledger, printed with its delay:
    at create_ledger, which asks a bookie who the client is (WHOAMI) to record the creator."""
    async with await BookKeeper.connect(uri, add_timeout_s=30.0, read_timeout_s=30.0, **kwargs) as bk:
        t0 = time.perf_counter()
        with pytest.raises(errors.BKError) as e:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await lh.add_entry(b"x")
        print(f"refused after {(time.perf_counter() - t0) * 1000:.1f} ms: {type(e.value).__name__}: {e.value}")
        return e.value


def test_a_3_2_2_ledger_is_written_and_read_over_mtls(mtls_cluster: LocalCluster) -> None:
    async def main() -> None:
        async with await BookKeeper.connect(mtls_cluster.metadata_uri, **mtls_cluster.client_trust("alice")) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw")
            payloads = [bytes([i]) * (i * 37 + 1) for i in range(50)]
            assert await lh.add_entries(payloads) == list(range(50))
            await lh.close()
            rh = await bk.open_ledger(lh.ledger_id, password=b"pw")
            assert [e.data for e in await rh.read(0, 49)] == payloads
            # Connections are made per shard a ledger routes to; a bookie's other shards' may
            # exist unopened. Every opened one is mTLS 1.3, and the three bookies' were opened.
            opened = [c for c in bk.pool._conns.values() if c._transport is not None]
            assert len({c.bookie_id for c in opened}) == 3, bk.pool._conns
            for conn in opened:
                assert conn._transport.get_extra_info("ssl_object") is not None
                assert conn._transport.get_extra_info("ssl_object").version() == "TLSv1.3"
    run(main())


@pytest.mark.parametrize("case,expected", [
    ("plain client", "TLS required"),
    ("untrusted CA", "not signed by a trusted CA"),
    ("client certificate of another CA", "did not accept this client's certificate"),
    ("client certificate of another CA, no AUTH", "did not accept this client's certificate"),
])
def test_refused_with_the_reason(mtls_cluster: LocalCluster, pki: TestPKI, case: str, expected: str) -> None:
    other = pki.other_ca()
    kwargs: dict[str, Any] = {
        "plain client": {},
        "untrusted CA": {**mtls_cluster.client_trust("alice"), "tls_ca_file": other.ca_file},
        "client certificate of another CA": {**mtls_cluster.client_trust(), "auth_provider": "mtls",
                                             **dict(zip(("tls_cert_file", "tls_key_file"), other.client("mallory")))},
        "client certificate of another CA, no AUTH": {  # refused at its first request, not in set-up
            **mtls_cluster.client_trust(), **dict(zip(("tls_cert_file", "tls_key_file"), other.client("eve")))},
    }[case]
    err = run(_first_add_error(mtls_cluster.metadata_uri, **kwargs))
    assert isinstance(err, errors.AuthenticationError), f"{type(err).__name__}: {err}"
    assert expected in str(err)


class RogueBookie:
    """A process's listener that speaks START_TLS and then TLS with a valid CLIENT certificate of
    the cluster's CA: it holds a real certificate, just not one naming any bookie id."""

    def __init__(self, cert: str, key: str) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshakes: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            header = b""
            while len(header) < REQUEST_HEADER_BYTES:
                header += conn.recv(REQUEST_HEADER_BYTES - len(header))
            frames, _ = parse_requests(header, 1 << 20)
            op, _, rid = frames[0][:3]
            conn.sendall(encode_responses([(op, 0, rid, 0, -1, 0, b"")]))  # START_TLS: OK
            try:
                with self.ctx.wrap_socket(conn, server_side=True) as tls:
                    self.handshakes.append("done")
                    tls.recv(1)
            except (ssl.SSLError, OSError) as e:
                self.handshakes.append(f"failed: {e}")

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def test_a_rogue_bookie_holding_a_valid_client_certificate_is_refused(mtls_cluster: LocalCluster,
                                                                       pki: TestPKI) -> None:
    rogue = RogueBookie(*pki.client("rogue"))

    async def main() -> None:
        async with await BookKeeper.connect(mtls_cluster.metadata_uri, **mtls_cluster.client_trust("alice")) as bk:
            conn = bk.pool.connection_to("127.0.0.1", rogue.port, f"127.0.0.1:{rogue.port}")
            with pytest.raises(errors.AuthenticationError) as e:
                await _call(conn, Op.READ_LAC, 1)
            print(e.value)
            assert f"bookie 127.0.0.1:{rogue.port}" in str(e.value)
            assert "bookie://" in str(e.value) or "purpose" in str(e.value)
    try:
        run(main())
    finally:
        rogue.close()


async def _call(conn: ShardConnection, op: int, ledger_id: int) -> tuple[Any, ...]:
    fut: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()

    def done(_ctx: None, resp: tuple[Any, ...] | None, err: errors.BKError | None) -> None:
        if not fut.done():
            fut.set_exception(err) if err is not None else fut.set_result(resp)  # type: ignore[arg-type]
    conn.request(op, 0, ledger_id, -1, NO_KEY, 0, b"", done, None)
    return await fut


def test_a_registration_pointing_a_bookie_id_elsewhere_fails_the_identity_check(mtls_cluster: LocalCluster) -> None:
    """Bookie 0's registration rewritten in ZooKeeper to bookie 1's addresses: the client, which
    has a connection verified for bookie 1 there already, makes a new one for bookie 0's id and
    refuses bookie 1's certificate for it."""
    b0, b1 = mtls_cluster.bookies[0], mtls_cluster.bookies[1]
    zk = KazooClient(hosts=mtls_cluster.zk.connect_string)
    zk.start(timeout=10)
    path = f"/ledgers/available/{b0.bookie_id}"
    original, _ = zk.get(path)

    async def main() -> None:
        async with await BookKeeper.connect(mtls_cluster.metadata_uri, **mtls_cluster.client_trust("alice")) as bk:
            await bk.pool.call(b1.bookie_id, Op.GET_BOOKIE_INFO, 0, 0, -1, NO_KEY)  # verified for b1
            forged = json.loads(original)
            forged["shards"] = mtls_cluster.registrations()[b1.bookie_id]["shards"]
            zk.set(path, json.dumps(forged).encode())
            await bk.refresh_bookies()
            with pytest.raises(errors.AuthenticationError) as e:
                await bk.pool.call(b0.bookie_id, Op.GET_BOOKIE_INFO, 0, 0, -1, NO_KEY)
            print(e.value)
            assert f"not bookie://{b0.bookie_id}" in str(e.value) and f"bookie://{b1.bookie_id}" in str(e.value)
            await bk.pool.call(b1.bookie_id, Op.GET_BOOKIE_INFO, 0, 0, -1, NO_KEY)  # b1 itself still fine
    try:
        run(main())
    finally:
        zk.set(path, original)
        zk.stop()
        zk.close()


def test_a_certificate_for_another_bookie_id_is_refused(mtls_cluster: LocalCluster) -> None:
    """Bookies 0 and 1 swap certificates (both valid, of the trusted CA): each is refused for
    naming the other's id. Restored afterwards."""
    b0, b1 = mtls_cluster.bookies[0], mtls_cluster.bookies[1]
    keys = ("tls_cert_file", "tls_key_file")
    saved = {b: {k: b.conf[k] for k in keys} for b in (b0, b1)}
    for b, other in ((b0, b1), (b1, b0)):
        b.conf.update(saved[other])
    try:
        for b in (b0, b1):
            mtls_cluster.restart_bookie(b)

        async def main() -> None:
            async with await BookKeeper.connect(mtls_cluster.metadata_uri,
                                                **mtls_cluster.client_trust("alice")) as bk:
                for b, other in ((b0, b1), (b1, b0)):
                    with pytest.raises(errors.AuthenticationError) as e:
                        await bk.pool.call(b.bookie_id, Op.GET_BOOKIE_INFO, 0, 0, -1, NO_KEY)
                    print(e.value)
                    assert f"names bookie://{other.bookie_id}, not bookie://{b.bookie_id}" in str(e.value)
        run(main())
    finally:
        for b in (b0, b1):
            b.conf.update(saved[b])
            mtls_cluster.restart_bookie(b)


def test_a_client_certificate_that_expires_is_refused_afterwards_naming_the_expiry(mtls_cluster: LocalCluster,
                                                                                  pki: TestPKI) -> None:
    cert, key = pki.expiring_client("brief", 8)
    kwargs = {**mtls_cluster.client_trust(), "auth_provider": "mtls", "tls_cert_file": cert, "tls_key_file": key}

    async def main() -> None:
        async with await BookKeeper.connect(mtls_cluster.metadata_uri, **kwargs) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await lh.add_entry(b"while valid")
            await lh.close()
        await asyncio.sleep(max(0.0, expires - time.time()) + 1.5)
        err = await _first_add_error(mtls_cluster.metadata_uri, **kwargs)
        assert isinstance(err, errors.AuthenticationError), f"{type(err).__name__}: {err}"
        assert "expired" in str(err)
    expires = time.time() + 8
    run(main())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_writer_runs_60_s_while_certificates_and_then_the_ca_are_rolled(tmp_path: Path, pki: TestPKI) -> None:
    """A long-lived writer, and a long-lived prober that drops its connections every ~second
    (new handshakes with the files its client reloaded), run 60 s while: each bookie's certificate is replaced on disk; the CA file
    becomes a bundle of the old and a new CA; every bookie and the client get certificates of
    the new CA; the CA file becomes the new CA alone. 0 errors."""
    trust_dir = tmp_path / "trust"
    trust_dir.mkdir()
    ca_file = str(trust_dir / "ca.pem")
    shutil.copy(pki.ca_file, ca_file)
    cluster = LocalCluster(tmp_path / "cluster", bookies=3, shards=1, pki=pki,
                           bookie_trust={**MTLS, "tls_ca_file": ca_file})
    cluster.start()
    try:
        # Where each bookie reads its pair (its own files): replaced in place, by rename.
        cert_paths = [(b.conf["tls_cert_file"], b.conf["tls_key_file"]) for b in cluster.bookies]
        client_cert, client_key = str(trust_dir / "client.pem"), str(trust_dir / "client-key.pem")
        for src, dest in zip(pki.client("roller"), (client_cert, client_key)):
            shutil.copy(src, dest)
        kwargs = {"tls": "require", "tls_ca_file": ca_file, "tls_cert_file": client_cert, "tls_key_file": client_key,
                  "auth_provider": "mtls", "tls_reload_interval_s": 1.0}
        new_ca = pki.other_ca()

        def roll(issuer: TestPKI) -> None:
            for b, (cert, key) in zip(cluster.bookies, cert_paths):
                src_cert, src_key = issuer.bookie(b.bookie_id)
                install(src_key, key)
                install(src_cert, cert)
                time.sleep(2.5)

        steps = [(3, "each bookie's certificate replaced", lambda: roll(pki)),
                 (13, "CA file: old + new CA", lambda: install(pki.bundle(new_ca), ca_file)),
                 (18, "each bookie's certificate from the new CA", lambda: roll(new_ca)),
                 (27, "the client's certificate from the new CA",
                  lambda: [install(s, d) for s, d in zip(new_ca.client("roller"), (client_cert, client_key))]),
                 (31, "CA file: the new CA alone", lambda: install(new_ca.ca_file, ca_file))]
        counts = run(_write_while(cluster.metadata_uri, kwargs, 60.0, steps))
        print(counts)
        assert counts["errors"] == [] and counts["adds"] > 100 and counts["probes"] > 20
    finally:
        cluster.stop()


async def _write_while(uri: str, kwargs: dict[str, Any], seconds: float,
                       steps: list[tuple[float, str, Any]]) -> dict[str, Any]:
    """A writer for `seconds` and a prober (new connections each round: its client's reloaded
    TLS context is what they use), running the roll's steps (off the loop) at their times;
    returns the counts and every error seen."""
    errs: list[str] = []
    counts: dict[str, Any] = {"adds": 0, "probes": 0, "errors": errs}
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()

    async def writer() -> None:
        async with await BookKeeper.connect(uri, **kwargs) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            while time.monotonic() - t0 < seconds:
                try:
                    await lh.add_entry(b"w" * 512)
                    counts["adds"] += 1
                except errors.BKError as e:
                    errs.append(f"writer {time.monotonic() - t0:.1f}s: {e}")
                    return
                await asyncio.sleep(0.01)
            await lh.close()

    async def prober() -> None:
        async with await BookKeeper.connect(uri, **kwargs) as bk:
            while time.monotonic() - t0 < seconds:
                bk.pool.drop_connections()  # the next requests connect anew
                try:
                    lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
                    await lh.add_entry(b"probe")
                    await lh.close()
                    counts["probes"] += 1
                except errors.BKError as e:
                    errs.append(f"probe {time.monotonic() - t0:.1f}s: {e}")
                await asyncio.sleep(0.7)

    async def roller() -> None:
        for at, what, step in steps:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            print(f"{time.monotonic() - t0:5.1f}s {what}")
            await loop.run_in_executor(None, step)

    await asyncio.gather(writer(), prober(), roller())
    return counts
