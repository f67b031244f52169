"""The security primitives of issue 23 (bookkeeper.security), each decision in a table.

TLS rules are checked by real handshakes (Python's ssl over a socketpair, and uvloop's
start_tls over loopback as the wire does it) with certificates made by bookkeeper.testing.pki
(a trustme CA); certificates from bookkeeper.security.pki are read back with `openssl x509`.
Reference: issue 23, items 1 (TLS, identity, reload), 2 (authentication), 5 (authorization).
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cryptography import x509

from bookkeeper.cli.security import add_security_parsers
from bookkeeper.errors import AuthenticationError, AuthorizationError, ConfigError
from bookkeeper.security import pki
from bookkeeper.security.auth import (AuthStep, MtlsClientProvider, MtlsServerProvider, TokenClientProvider,
                                      TokenServerProvider, load_client_provider, load_server_provider,
                                      renew_delay_s)
from bookkeeper.security.authz import ROLES, AuthzPolicy
from bookkeeper.security.reload import should_check
from bookkeeper.security.tls import (TLS_MODES, ReloadingTLS, bookie_ids_of, check_bookie_identity,
                                     describe_tls_failure, principal_of)
from bookkeeper.security.tokens import (TokenKeys, generate_keys_file, mint_token, token_from_setting,
                                        unverified_claims)
from bookkeeper.testing.pki import TestPKI, install

BOOKIE = "127.0.0.1:3181"
OTHER_BOOKIE = "127.0.0.1:3182"
SECRET = b"s" * 32
NOW = 1_800_000_000.0  # epoch seconds: 2027-01-15T08:00:00Z


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(str(tmp_path_factory.mktemp("pki")))


def server_tls(ca: TestPKI, bookie_id: str = BOOKIE, *, client_auth: bool = False, **kw: Any) -> ReloadingTLS:
    cert, key = ca.bookie(bookie_id)
    return ReloadingTLS(server_side=True, cert_file=cert, key_file=key, ca_file=ca.ca_file, client_auth=client_auth,
                        **kw)


def client_tls(ca_file: str, pair: tuple[str, str] | None = None, **kw: Any) -> ReloadingTLS:
    cert, key = pair or (None, None)
    return ReloadingTLS(server_side=False, cert_file=cert, key_file=key, ca_file=ca_file, **kw)


class Handshake:
    """One TLS connection over a socketpair: the server side on a thread, the client here; the
    server writes one byte after its handshake so a refusal of the client's certificate (sent
    after the client's handshake in TLS 1.3) reaches the client too."""

    def __init__(self, server_ctx: ssl.SSLContext | None, client_ctx: ssl.SSLContext, *,
                 plain_reply: bytes = b"") -> None:
        self.server_peer: dict[str, Any] | None = None
        self.client_peer: dict[str, Any] | None = None
        self.server_error: BaseException | None = None
        self.client_error: BaseException | None = None
        self.version: str | None = None
        a, b = socket.socketpair()
        a.settimeout(10)
        b.settimeout(10)
        thread = threading.Thread(target=self._serve, args=(a, server_ctx, plain_reply))
        thread.start()
        try:
            with client_ctx.wrap_socket(b) as s:
                self.client_peer = s.getpeercert()
                self.version = s.version()
                assert s.recv(1) == b"!"
        except (ssl.SSLError, OSError, AssertionError) as e:
            self.client_error = e
        finally:
            b.close()
            thread.join()

    def _serve(self, sock: socket.socket, ctx: ssl.SSLContext | None, plain_reply: bytes) -> None:
        try:
            if ctx is None:
                sock.recv(4096)
                sock.sendall(plain_reply)
                return
            with ctx.wrap_socket(sock, server_side=True) as s:
                self.server_peer = s.getpeercert()
                s.sendall(b"!")
                s.recv(1)  # until the client closes
        except (ssl.SSLError, OSError) as e:
            self.server_error = e
        finally:
            sock.close()

    @property
    def ok(self) -> bool:
        return self.client_error is None and self.server_error is None


# --- TLS contexts and handshakes ---------------------------------------------------------------

def test_tls_modes_are_the_three_of_the_config() -> None:
    assert TLS_MODES == ("off", "optional", "require")


def test_server_and_client_contexts_negotiate_tls13_and_show_the_bookie_id(ca: TestPKI) -> None:
    """Client side: CA checked, hostname not (the id is); TLS 1.3 minimum on both."""
    server, client = server_tls(ca), client_tls(ca.ca_file)
    for ctx in (server.context, client.context):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert server.context.verify_mode == ssl.CERT_NONE
    assert client.context.verify_mode == ssl.CERT_REQUIRED and not client.context.check_hostname
    hs = Handshake(server.context, client.context)
    assert hs.ok, (hs.client_error, hs.server_error)
    assert hs.version == "TLSv1.3"
    assert hs.client_peer is not None and bookie_ids_of(hs.client_peer) == [BOOKIE]
    check_bookie_identity(hs.client_peer, BOOKIE, host_port="127.0.0.1:3181")


def test_mutual_tls_gives_the_server_the_client_principal(ca: TestPKI) -> None:
    server = server_tls(ca, client_auth=True)
    assert server.context.verify_mode == ssl.CERT_REQUIRED
    hs = Handshake(server.context, client_tls(ca.ca_file, ca.client("alice")).context)
    assert hs.ok, (hs.client_error, hs.server_error)
    assert hs.server_peer is not None and principal_of(hs.server_peer) == "alice"
    assert bookie_ids_of(hs.server_peer) == []


def _expired_bookie(ca: TestPKI) -> tuple[str, str]:
    cert, key = ca.expiring_bookie(BOOKIE, 1.0)
    with open(cert, "rb") as f:
        not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
    while time.time() <= not_after + 0.5:  # wait the certificate out (about a second)
        time.sleep(0.1)
    return cert, key


def test_handshake_refusals_are_described(ca: TestPKI) -> None:
    """Each way a handshake fails gives its own reason, for the AuthenticationError the wire raises."""
    other = ca.other_ca()
    mtls_server = server_tls(ca, client_auth=True).context
    tls12 = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    tls12.check_hostname, tls12.verify_mode = False, ssl.CERT_NONE
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    expired_cert, expired_key = _expired_bookie(ca)
    expired = ReloadingTLS(server_side=True, cert_file=expired_cert, key_file=expired_key, ca_file=None).context
    cases = [  # (server context, client context, side whose error is described, expected words)
        (server_tls(ca).context, client_tls(other.ca_file).context, "client", "not signed by a trusted CA"),
        (expired, client_tls(ca.ca_file).context, "client", "certificate has expired"),
        (mtls_server, client_tls(ca.ca_file).context, "client", "requires a client certificate"),
        (mtls_server, client_tls(ca.ca_file).context, "server", "sent no client certificate"),
        (mtls_server, client_tls(ca.ca_file, other.client("mallory")).context, "client",
         "refused our certificate: not signed by a CA it trusts"),
        (mtls_server, client_tls(ca.ca_file, other.client("mallory")).context, "server", "not signed by a trusted CA"),
        (server_tls(ca).context, tls12, "client", "no TLS version in common"),
        (server_tls(ca).context, tls12, "server", "no TLS version in common"),
        (None, client_tls(ca.ca_file).context, "client", "does not speak TLS"),
    ]
    for server_ctx, client_ctx, side, words in cases:
        hs = Handshake(server_ctx, client_ctx, plain_reply=b"HTTP/1.1 400 Bad Request\r\n\r\n")
        error = hs.client_error if side == "client" else hs.server_error
        assert error is not None, (words, side)
        assert words in describe_tls_failure(error, peer=BOOKIE), (words, side, error)


def test_describe_names_a_closed_connection_and_a_timeout() -> None:
    assert "closed the connection" in describe_tls_failure(ConnectionResetError(), peer=BOOKIE)
    assert "closed the connection" in describe_tls_failure(ssl.SSLEOFError(), peer=BOOKIE)
    assert "timed out" in describe_tls_failure(TimeoutError(), peer=BOOKIE)
    assert describe_tls_failure(ValueError("x"), peer=BOOKIE) == "ValueError: x"


def test_a_client_certificate_cannot_serve_as_a_bookie(ca: TestPKI) -> None:
    """A rogue bookie holding a valid client certificate: refused by its EKU (clientAuth only)
    in the handshake, and even without that, it names no bookie id."""
    cert, key = ca.client("rogue")
    rogue = ReloadingTLS(server_side=True, cert_file=cert, key_file=key, ca_file=None)
    hs = Handshake(rogue.context, client_tls(ca.ca_file).context)
    assert isinstance(hs.client_error, ssl.SSLCertVerificationError)
    assert "not for this use (unsuitable certificate purpose)" in describe_tls_failure(hs.client_error, peer=BOOKIE)
    mtls = Handshake(server_tls(ca, client_auth=True).context, client_tls(ca.ca_file, (cert, key)).context)
    assert mtls.ok and mtls.server_peer is not None  # the same certificate as a verified client's
    with pytest.raises(AuthenticationError, match=f"bookie {BOOKIE} at {BOOKIE}: its TLS certificate names no bookie"):
        check_bookie_identity(mtls.server_peer, BOOKIE, host_port=BOOKIE)


IDENTITY_CASES = [  # (SAN entries, bookie id routed to, passes?, words of the refusal)
    ((("URI", f"bookie://{BOOKIE}"),), BOOKIE, True, ""),
    ((("DNS", "x"), ("URI", f"bookie://{OTHER_BOOKIE}"), ("URI", f"bookie://{BOOKIE}")), BOOKIE, True, ""),
    ((("URI", f"bookie://{OTHER_BOOKIE}"),), BOOKIE, False,
     f"bookie {BOOKIE} at 10.0.0.1:3181: its TLS certificate names bookie://{OTHER_BOOKIE}, not bookie://{BOOKIE}"),
    ((("DNS", "127.0.0.1"), ("IP Address", "127.0.0.1")), BOOKIE, False, "names no bookie id"),
    ((("URI", f"http://{BOOKIE}"),), BOOKIE, False, "names no bookie id"),
    ((("URI", f"bookie://{BOOKIE}x"),), BOOKIE, False, f"names bookie://{BOOKIE}x"),
    ((), BOOKIE, False, "names no bookie id"),
]


@pytest.mark.parametrize("sans,bookie_id,passes,words", IDENTITY_CASES)
def test_check_bookie_identity(sans: tuple[tuple[str, str], ...], bookie_id: str, passes: bool, words: str) -> None:
    peercert = {"subject": ((("commonName", "x"),),), "subjectAltName": sans}
    if passes:
        check_bookie_identity(peercert, bookie_id, host_port="10.0.0.1:3181")
    else:
        with pytest.raises(AuthenticationError, match=words.replace(".", r"\.")):
            check_bookie_identity(peercert, bookie_id, host_port="10.0.0.1:3181")


def test_a_real_certificate_for_another_bookie_is_refused(ca: TestPKI) -> None:
    hs = Handshake(server_tls(ca, OTHER_BOOKIE).context, client_tls(ca.ca_file).context)
    assert hs.ok and hs.client_peer is not None
    with pytest.raises(AuthenticationError, match=f"names bookie://{OTHER_BOOKIE}, not bookie://{BOOKIE}"):
        check_bookie_identity(hs.client_peer, BOOKIE, host_port=BOOKIE)


@pytest.mark.parametrize("subject,principal", [
    (((("commonName", "alice"),),), "alice"),
    (((("organizationName", "o"),), (("commonName", "a"),), (("commonName", "b"),)), "b"),
    (((("organizationName", "o"),),), None),
    ((), None),
])
def test_principal_is_the_subject_common_name(subject: tuple[Any, ...], principal: str | None) -> None:
    assert principal_of({"subject": subject}) == principal


def test_construction_errors_name_the_file_and_reason(ca: TestPKI, tmp_path: Path) -> None:
    cert, key = ca.bookie(BOOKIE)
    _, other_key = ca.bookie(BOOKIE)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    missing = str(tmp_path / "missing.pem")
    cases = [  # (kwargs, words)
        (dict(server_side=True, cert_file=None, key_file=None, ca_file=None), "needs tls_cert_file"),
        (dict(server_side=True, cert_file=cert, key_file=None, ca_file=None), "go together"),
        (dict(server_side=False, cert_file=None, key_file=None, ca_file=None), "needs tls_ca_file"),
        (dict(server_side=True, cert_file=cert, key_file=key, ca_file=None, client_auth=True), "tls_client_auth"),
        (dict(server_side=True, cert_file=missing, key_file=key, ca_file=None), f"{missing}: cannot be read"),
        (dict(server_side=True, cert_file=str(garbage), key_file=key, ca_file=None), f"{garbage}: no PEM certificate"),
        (dict(server_side=True, cert_file=cert, key_file=missing, ca_file=None), f"key {missing}: cannot be read"),
        (dict(server_side=True, cert_file=cert, key_file=other_key, ca_file=None), "key does not match"),
        (dict(server_side=True, cert_file=cert, key_file=str(garbage), ca_file=None), f"key {garbage}: not a usable"),
        (dict(server_side=False, cert_file=None, key_file=None, ca_file=str(garbage)), f"CA file {garbage}: no PEM"),
        (dict(server_side=False, cert_file=None, key_file=None, ca_file=ca.ca_file, reload_interval_s=0), "> 0"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            ReloadingTLS(**kwargs)  # type: ignore[arg-type]


# --- reloading ----------------------------------------------------------------------------------

@pytest.mark.parametrize("now,last,interval,check", [(0.0, 0.0, 60.0, False), (59.9, 0.0, 60.0, False),
                                                     (60.0, 0.0, 60.0, True), (1000.0, 999.0, 0.5, True)])
def test_files_are_stat_ed_at_most_once_per_interval(now: float, last: float, interval: float, check: bool) -> None:
    assert should_check(now=now, last_check=last, interval_s=interval) is check


@pytest.fixture
def live(ca: TestPKI, tmp_path: Path) -> Iterator[tuple[ReloadingTLS, str, str]]:
    """A bookie's TLS on files at fixed paths (as its config names them), checked every 1 s
    of the `now` the test passes."""
    cert, key = ca.bookie(BOOKIE)
    live_cert, live_key = str(tmp_path / "bookie.pem"), str(tmp_path / "bookie-key.pem")
    install(cert, live_cert)
    install(key, live_key)
    yield (ReloadingTLS(server_side=True, cert_file=live_cert, key_file=live_key, ca_file=None, reload_interval_s=1.0),
           live_cert, live_key)


def _serial_served(server: ReloadingTLS, ca: TestPKI) -> int:
    hs = Handshake(server.context, client_tls(ca.ca_file).context)
    assert hs.ok and hs.client_peer is not None
    return int(hs.client_peer["serialNumber"], 16)


def _serial_of(cert: str) -> int:
    with open(cert, "rb") as f:
        return x509.load_pem_x509_certificate(f.read()).serial_number


def test_a_new_pair_is_picked_up_after_the_interval(ca: TestPKI, live: tuple[ReloadingTLS, str, str]) -> None:
    server, live_cert, live_key = live
    t = time.monotonic()
    first = server.context
    assert not server.maybe_reload(t + 1.0)  # nothing changed
    new_cert, new_key = ca.bookie(BOOKIE)
    install(new_key, live_key)
    install(new_cert, live_cert)
    assert not server.maybe_reload(t + 1.5)  # changed, but checked half an interval ago
    assert server.maybe_reload(t + 2.0)
    assert (server.reloads, server.reload_failures, server.last_error) == (1, 0, None)
    assert server.context is not first
    assert _serial_served(server, ca) == _serial_of(new_cert)
    assert Handshake(first, client_tls(ca.ca_file).context).ok  # what open connections hold still works


def test_a_mismatched_pair_keeps_the_old_context_and_is_counted_once(
        ca: TestPKI, live: tuple[ReloadingTLS, str, str], caplog: pytest.LogCaptureFixture) -> None:
    """Counted when still mismatched at the next check; logged once; the old pair serves on."""
    server, live_cert, live_key = live
    t = time.monotonic()
    old, old_serial = server.context, _serial_of(live_cert)
    new_cert, new_key = ca.bookie(BOOKIE)
    install(new_cert, live_cert)  # the certificate rolled, and its key never follows
    with caplog.at_level(logging.WARNING, logger="bookkeeper.security"):
        assert not server.maybe_reload(t + 1.0)
        assert (server.reload_failures, server.last_error) == (0, None)  # perhaps a roll half done
        assert not server.maybe_reload(t + 2.0)
        assert not server.maybe_reload(t + 3.0)  # the same bad files: not counted again
    assert (server.reloads, server.reload_failures) == (0, 1)
    assert server.last_error is not None and "key does not match" in server.last_error
    assert [r.levelname for r in caplog.records] == ["WARNING"] and live_cert in caplog.records[0].getMessage()
    assert server.context is old and _serial_served(server, ca) == old_serial
    install(new_key, live_key)  # the key at last: now the pair loads
    assert server.maybe_reload(t + 4.0)
    assert (server.reloads, server.reload_failures, server.last_error) == (1, 1, None)
    assert _serial_served(server, ca) == _serial_of(new_cert)


def test_a_roll_caught_between_certificate_and_key_is_not_a_failure(
        ca: TestPKI, live: tuple[ReloadingTLS, str, str]) -> None:
    server, live_cert, live_key = live
    t = time.monotonic()
    new_cert, new_key = ca.bookie(BOOKIE)
    install(new_cert, live_cert)
    assert not server.maybe_reload(t + 1.0)  # the check falls between the two renames
    install(new_key, live_key)
    assert server.maybe_reload(t + 2.0)
    assert (server.reloads, server.reload_failures, server.last_error) == (1, 0, None)
    assert _serial_served(server, ca) == _serial_of(new_cert)


@pytest.mark.parametrize("damage,words", [("garbage", "no PEM certificate"), ("delete", "cannot be read"),
                                          ("truncate", "no PEM certificate")])
def test_a_bad_new_file_keeps_the_old_context(live: tuple[ReloadingTLS, str, str], damage: str, words: str) -> None:
    server, live_cert, _ = live
    old = server.context
    if damage == "delete":
        os.unlink(live_cert)
    else:
        text = Path(live_cert).read_text()
        Path(live_cert).write_text("junk\n" if damage == "garbage" else text[:len(text) // 2])
    t = time.monotonic()
    assert not server.maybe_reload(t + 1.0) and not server.maybe_reload(t + 2.0)
    assert server.context is old and server.reload_failures == 1
    assert server.last_error is not None and words in server.last_error and live_cert in server.last_error


def test_a_ca_roll_through_a_two_ca_bundle(ca: TestPKI, tmp_path: Path) -> None:
    """The client's CA file becomes a bundle of the old and new CA: bookies of both are trusted;
    then only the new one: the old CA's bookies are refused."""
    new_ca = ca.other_ca()
    live_ca = str(tmp_path / "ca.pem")
    install(ca.ca_file, live_ca)
    client = client_tls(live_ca, reload_interval_s=1.0)
    t = time.monotonic()
    assert not Handshake(server_tls(new_ca).context, client.context).ok
    install(ca.bundle(new_ca), live_ca)
    assert client.maybe_reload(t + 1.0)
    assert Handshake(server_tls(new_ca).context, client.context).ok
    assert Handshake(server_tls(ca).context, client.context).ok
    install(new_ca.ca_file, live_ca)
    assert client.maybe_reload(t + 2.0)
    assert not Handshake(server_tls(ca).context, client.context).ok
    assert client.reloads == 2


def test_days_to_expiry(ca: TestPKI) -> None:
    cert, key = ca.bookie(BOOKIE, days=30)
    server = ReloadingTLS(server_side=True, cert_file=cert, key_file=key, ca_file=None)
    with open(cert, "rb") as f:
        not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
    assert server.days_to_expiry(now=not_after - 86400) == pytest.approx(1.0)
    assert server.days_to_expiry(now=not_after + 2 * 86400) == pytest.approx(-2.0)
    assert 29.9 < (server.days_to_expiry() or 0) <= 30.0
    assert client_tls(ca.ca_file).days_to_expiry() is None


def test_contexts_work_with_uvloop_start_tls(ca: TestPKI) -> None:
    """The wire's way: a plain connection upgraded by loop.start_tls on both sides (START_TLS),
    the server with its ReloadingTLS context, the client with its own."""
    server, client = server_tls(ca, client_auth=True), client_tls(ca.ca_file, ca.client("alice"))

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future[dict[str, Any]] = loop.create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(9)  # "START_TLS"
            writer.write(b"OK")
            await writer.drain()
            await writer.start_tls(server.context)
            seen.set_result(writer.get_extra_info("peercert"))
            writer.write(b"!")
            await writer.drain()
            writer.close()
        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"START_TLS")
        assert await reader.readexactly(2) == b"OK"
        await writer.start_tls(client.context)
        peer = writer.get_extra_info("peercert")
        assert await reader.readexactly(1) == b"!"
        writer.close()
        srv.close()
        await srv.wait_closed()
        return peer, await seen
    bookie_cert, client_cert = uvloop.run(main())
    check_bookie_identity(bookie_cert, BOOKIE, host_port=f"127.0.0.1:{BOOKIE}")
    assert principal_of(client_cert) == "alice"


# --- tokens -------------------------------------------------------------------------------------

def test_token_format() -> None:
    token = mint_token(subject="alice", ttl_s=60, key_id="k1", secret=SECRET, now=NOW)
    version, body, mac = token.split(".")
    assert version == "bk1" and "=" not in token
    assert json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))) == {
        "sub": "alice", "exp": int(NOW) + 60, "kid": "k1"}
    expected = base64.urlsafe_b64encode(hmac.new(SECRET, f"bk1.{body}".encode(), hashlib.sha256).digest())
    assert mac == expected.rstrip(b"=").decode()


def _keys_file(path: Path, keys: dict[str, bytes]) -> str:
    path.write_text("[keys]\n" + "".join(f'"{k}" = "{base64.b64encode(v).decode()}"\n' for k, v in keys.items()))
    path.chmod(0o600)
    return str(path)


def test_token_verification_table(tmp_path: Path) -> None:
    keys = TokenKeys(_keys_file(tmp_path / "keys.toml", {"k1": SECRET, "k2": b"t" * 40}))

    def mint(**kw: Any) -> str:
        args: dict[str, Any] = dict(subject="alice", ttl_s=60, key_id="k1", secret=SECRET, now=NOW)
        return mint_token(**{**args, **kw})

    def body(claims: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    good = mint()
    _, good_body, good_mac = good.split(".")
    forged_body = body({"sub": "root", "exp": int(NOW) + 60, "kid": "k1"})
    cases = [  # (token, now, reason or None for valid)
        (good, NOW, None),
        (mint(key_id="k2", secret=b"t" * 40), NOW, None),
        (good, NOW + 59, None),
        (good, NOW + 60, "expired at 2027-01-15T08:01:00Z"),
        (mint(secret=b"x" * 32), NOW, "bad signature"),
        (f"bk1.{forged_body}.{good_mac}", NOW, "bad signature"),
        (good[:-2] + ("AA" if not good.endswith("AA") else "BB"), NOW, "bad signature"),
        (f"bk1.{good_body}.{good_mac}é", NOW, "bad signature"),
        (mint(key_id="k3"), NOW, "unknown key id k3"),
        ("", NOW, "malformed token"),
        ("bk1", NOW, "malformed token"),
        (f"bk2.{good_body}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{good_body}.{good_mac}.x", NOW, "malformed token"),
        (f"bk1.!!!.{good_mac}", NOW, "malformed token"),
        (f"bk1.{base64.urlsafe_b64encode(b'not json').decode()}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body({'sub': 'a', 'kid': 'k1'})}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body({'sub': 'a', 'exp': '1', 'kid': 'k1'})}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body({'sub': 'a', 'exp': True, 'kid': 'k1'})}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body({'sub': '', 'exp': 1, 'kid': 'k1'})}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body({'sub': 'a', 'exp': 1, 'kid': 'k 1'})}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body({'sub': 'a', 'exp': 1, 'kid': 'k1', 'admin': True})}.{good_mac}", NOW, "malformed token"),
        (f"bk1.{body([1, 2])}.{good_mac}", NOW, "malformed token"),
        (good + "A" * 5000, NOW, "malformed token"),
    ]
    for token, now, reason in cases:
        if reason is None:
            claims = keys.verify(token, now=now)
            assert claims.subject == "alice" and claims.expires_at == NOW + 60
        else:
            with pytest.raises(AuthenticationError) as e:
                keys.verify(token, now=now)
            assert str(e.value) == reason, token


@pytest.mark.parametrize("kwargs,words", [
    (dict(subject=""), "subject"), (dict(ttl_s=0), "ttl_s"), (dict(key_id="a b"), "key id"),
    (dict(secret=b"short"), ">= 32 bytes"),
])
def test_mint_refuses_bad_arguments(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        mint_token(**{**dict(subject="a", ttl_s=1, key_id="k", secret=SECRET), **kwargs})  # type: ignore[arg-type]


def test_unverified_claims_are_read_without_a_key() -> None:
    claims = unverified_claims(mint_token(subject="bob", ttl_s=10, key_id="k.9", secret=SECRET, now=NOW))
    assert (claims.subject, claims.expires_at, claims.key_id) == ("bob", NOW + 10, "k.9")


@pytest.mark.parametrize("text,words", [
    ("[keys\n", "not TOML"),
    ("", "non-empty [keys] table"),
    ("[keys]\n", "non-empty [keys] table"),
    ('keys = "x"\n', "non-empty [keys] table"),
    ('[keys]\nk1 = "' + base64.b64encode(b"x" * 31).decode() + '"\n', "key k1: 31 bytes, needs >= 32"),
    ('[keys]\nk1 = "not base64!"\n', "key k1: not a base64 string"),
    ("[keys]\nk1 = 5\n", "key k1: not a base64 string"),
    ('[keys]\n"k 1" = "' + base64.b64encode(SECRET).decode() + '"\n', "key id 'k 1'"),
    ('[keys]\nk1 = "' + base64.b64encode(SECRET).decode() + '"\n[other]\n', "unknown top-level key(s) ['other']"),
])
def test_keys_file_errors_are_named(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(ConfigError) as e:
        TokenKeys(str(path))
    assert words in str(e.value) and str(path) in str(e.value)


def test_a_world_readable_keys_file_is_refused(tmp_path: Path) -> None:
    path = _keys_file(tmp_path / "keys.toml", {"k1": SECRET})
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable or writable by every user .mode 0644.: chmod 600"):
        TokenKeys(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        TokenKeys(str(tmp_path / "missing.toml"))


def test_keys_rotate_by_reload_and_a_bad_file_keeps_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    keys = TokenKeys(_keys_file(path, {"old": SECRET}), reload_interval_s=1.0)
    t = time.monotonic()
    old_token = mint_token(subject="a", ttl_s=60, key_id="old", secret=SECRET)
    new_token = mint_token(subject="a", ttl_s=60, key_id="new", secret=b"n" * 32)
    with pytest.raises(AuthenticationError, match="unknown key id new"):
        keys.verify(new_token)
    _keys_file(path, {"old": SECRET, "new": b"n" * 32})  # rotation: both at once
    assert keys.maybe_reload(t + 1.0)
    assert keys.verify(old_token).key_id == "old" and keys.verify(new_token).key_id == "new"
    path.write_text("[keys]\nnew = 'short'\n")
    assert not keys.maybe_reload(t + 2.0) and not keys.maybe_reload(t + 3.0)
    assert keys.reload_failures == 1 and keys.last_error is not None and "not a base64 string" in keys.last_error
    assert keys.verify(old_token).key_id == "old"  # the bad file changed nothing
    _keys_file(path, {"new": b"n" * 32})  # the old key retired
    assert keys.maybe_reload(t + 4.0)
    assert keys.key_ids == ["new"] and keys.reloads == 2 and keys.last_error is None
    with pytest.raises(AuthenticationError, match="unknown key id old"):
        keys.verify(old_token)


def test_generate_keys_file(tmp_path: Path) -> None:
    path = str(tmp_path / "keys.toml")
    generate_keys_file(path, "k1")
    generate_keys_file(path, "k.2")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    keys = TokenKeys(path)
    assert keys.key_ids == ["k.2", "k1"]
    secrets = [keys.secret("k1"), keys.secret("k.2")]
    assert all(s is not None and len(s) == 32 for s in secrets) and secrets[0] != secrets[1]
    with pytest.raises(ConfigError, match="key id k1 exists already"):
        generate_keys_file(path, "k1")
    with pytest.raises(ConfigError, match="key id 'a b'"):
        generate_keys_file(path, "a b")
    assert TokenKeys(path).secret("k1") == secrets[0]  # the refusals left the file as it was


def test_token_from_setting(tmp_path: Path) -> None:
    assert token_from_setting("bk1.abc.def")() == "bk1.abc.def"
    path = tmp_path / "token"
    path.write_text("first\n")
    get = token_from_setting(f"file:{path}")
    assert get() == "first"
    path.write_text("renewed\n")
    assert get() == "renewed"
    for value, words in [("", "auth_token is empty"), (f"file:{tmp_path / 'nope'}", "cannot be read")]:
        with pytest.raises(ConfigError, match=words):
            token_from_setting(value)
    path.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        get()


# --- authorization ------------------------------------------------------------------------------

def _authz(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_roles_table(tmp_path: Path) -> None:
    policy = AuthzPolicy(_authz(tmp_path / "authz.toml", '[principals]\nalice = ["write", "read"]\n'
                                '"ops" = ["admin"]\n"*" = ["read"]\n'))
    cases = [  # (principal, role, allowed)
        ("alice", "write", True), ("alice", "read", True), ("alice", "recover", False), ("alice", "admin", False),
        ("ops", "admin", True), ("ops", "read", True), ("ops", "write", False),
        ("nobody", "read", True), ("nobody", "write", False),
    ]
    for principal, role, allowed in cases:
        assert (role in policy.roles(principal)) is allowed, (principal, role)
        if allowed:
            policy.check(principal, role)
        else:
            with pytest.raises(AuthorizationError) as e:
                policy.check(principal, role)
            assert str(e.value) == f"principal {principal!r} lacks role {role!r}"
    with pytest.raises(ValueError, match="unknown role 'delete'"):
        policy.check("alice", "delete")


def test_without_a_file_every_principal_has_every_role() -> None:
    policy = AuthzPolicy(None)
    assert policy.roles("anyone") == frozenset(ROLES) and not policy.enabled
    assert not policy.maybe_reload(time.monotonic() + 100)
    policy.check("anyone", "admin")


def test_an_empty_policy_grants_nothing(tmp_path: Path) -> None:
    policy = AuthzPolicy(_authz(tmp_path / "authz.toml", ""))
    assert policy.roles("alice") == frozenset()


@pytest.mark.parametrize("text,words", [
    ("[principals\n", "not TOML"),
    ('[principals]\nalice = ["write", "delete"]\n', "principal 'alice': unknown role(s) ['delete']"),
    ('[principals]\nalice = "write"\n', "principal 'alice': roles must be a list of strings"),
    ("[principals]\nalice = [1]\n", "principal 'alice': roles must be a list of strings"),
    ('principals = ["alice"]\n', "principals must be a table"),
    ('[users]\nalice = ["read"]\n', "unknown top-level key(s) ['users']"),
    ('[principals]\n"" = ["read"]\n', "an empty principal name"),
])
def test_authz_file_errors_are_named(tmp_path: Path, text: str, words: str) -> None:
    path = _authz(tmp_path / "authz.toml", text)
    with pytest.raises(ConfigError) as e:
        AuthzPolicy(path)
    assert words in str(e.value) and path in str(e.value)


def test_authz_reload_bumps_the_generation_and_a_bad_file_keeps_the_policy(tmp_path: Path) -> None:
    path = tmp_path / "authz.toml"
    policy = AuthzPolicy(_authz(path, '[principals]\nalice = ["read"]\n'), reload_interval_s=1.0)
    t = time.monotonic()
    assert policy.generation == 0
    _authz(path, '[principals]\nalice = ["read", "write"]\n')
    assert not policy.maybe_reload(t + 0.5) and policy.maybe_reload(t + 1.0)
    assert policy.generation == 1 and policy.roles("alice") == {"read", "write"}
    _authz(path, '[principals]\nalice = ["root"]\n')
    assert not policy.maybe_reload(t + 2.0) and not policy.maybe_reload(t + 3.0)
    assert policy.generation == 1 and policy.reload_failures == 1 and policy.roles("alice") == {"read", "write"}
    assert policy.last_error is not None and "unknown role(s) ['root']" in policy.last_error


# --- AUTH plug-ins ------------------------------------------------------------------------------

PLUGIN = '''
from bookkeeper.security.auth import AuthStep


class Server:
    name = "shared-secret"

    def new_session(self, peercert):
        return self

    def step(self, payload):
        return AuthStep(done=True, principal=payload.decode())


class Client:
    name = "shared-secret"

    def new_session(self):
        return self


class Broken:
    def __init__(self):
        raise RuntimeError("no config")
'''


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "bk_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bk_test_plugin"
    sys.modules.pop("bk_test_plugin", None)


def test_provider_loading(tmp_path: Path, plugin_module: str) -> None:
    keys = _keys_file(tmp_path / "keys.toml", {"k1": SECRET})
    assert isinstance(load_server_provider("mtls", keys_file=None, reload_interval_s=60), MtlsServerProvider)
    token_server = load_server_provider("token", keys_file=keys, reload_interval_s=60)
    assert isinstance(token_server, TokenServerProvider) and token_server.keys.key_ids == ["k1"]
    assert isinstance(load_client_provider("mtls", token=None), MtlsClientProvider)
    assert isinstance(load_client_provider("token", token="bk1.a.b"), TokenClientProvider)
    for spec in (f"{plugin_module}:Server", f"{plugin_module}.Server"):
        provider = load_server_provider(spec, keys_file=None, reload_interval_s=60)
        assert provider.name == "shared-secret"
        assert provider.new_session(None).step(b"carol") == AuthStep(done=True, principal="carol")
    assert load_client_provider(f"{plugin_module}:Client", token=None).name == "shared-secret"


@pytest.mark.parametrize("spec,words", [
    ("", "not mtls, token or a dotted path"),
    ("kerberos", "not mtls, token or a dotted path"),
    ("no_such_module_xyz:Provider", "module no_such_module_xyz cannot be imported"),
    ("bookkeeper.security.auth:Nope", "module bookkeeper.security.auth has no Nope"),
    ("collections:OrderedDict", "OrderedDict lacks the ServerAuthProvider shape"),
    ("bk_test_plugin:Client", "Client lacks the ServerAuthProvider shape"),
    ("bk_test_plugin:Broken", "Broken() failed: RuntimeError: no config"),
    ("token", "auth_provider = token needs auth_token_keys_file"),
])
def test_bad_server_provider_specs_are_named(plugin_module: str, spec: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_server_provider(spec, keys_file=None, reload_interval_s=60)
    assert words in str(e.value)
    assert spec == "token" or repr(spec) in str(e.value)


@pytest.mark.parametrize("spec,words", [("token", "needs auth_token"), ("bk_test_plugin:Server", "lacks the "
                                                                                              "ClientAuthProvider")])
def test_bad_client_provider_specs_are_named(plugin_module: str, spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_client_provider(spec, token=None)


def test_mtls_session(ca: TestPKI) -> None:
    hs = Handshake(server_tls(ca, client_auth=True).context, client_tls(ca.ca_file, ca.client("alice")).context)
    assert hs.ok and hs.server_peer is not None
    client = MtlsClientProvider().new_session()
    first = client.first()
    step = MtlsServerProvider().new_session(hs.server_peer).step(first)
    assert (step.done, step.principal, first, client.step(step.reply), client.renew_after_s()) == (
        True, "alice", b"", None, None)
    assert step.expires_at == ssl.cert_time_to_seconds(hs.server_peer["notAfter"])
    for peercert, words in [(None, "no verified client certificate"), ({}, "no verified client certificate"),
                            ({"subject": ((("organizationName", "o"),),), "notAfter": "x"}, "no subject commonName")]:
        with pytest.raises(AuthenticationError, match=words):
            MtlsServerProvider().new_session(peercert).step(b"")


def test_token_session(tmp_path: Path) -> None:
    keys = TokenKeys(_keys_file(tmp_path / "keys.toml", {"k1": SECRET}))
    server = TokenServerProvider(keys)
    now = time.time()
    token_file = tmp_path / "token"
    token_file.write_text(mint_token(subject="svc", ttl_s=1000, key_id="k1", secret=SECRET, now=now))
    client = TokenClientProvider(token_from_setting(f"file:{token_file}"), clock=lambda: now)
    session = client.new_session()
    assert session.renew_after_s() is None  # nothing sent yet
    step = server.new_session(None).step(session.first())
    assert (step.done, step.principal, step.expires_at) == (True, "svc", float(int(now) + 1000))
    assert session.step(step.reply) is None
    assert session.renew_after_s() == pytest.approx(int(now) + 1000 - now - 60)
    token_file.write_text(mint_token(subject="svc2", ttl_s=1000, key_id="k1", secret=SECRET, now=now))
    assert server.new_session(None).step(client.new_session().first()).principal == "svc2"  # renewed on disk
    for payload, words in [(b"\xff\xfe", "malformed token"), (b"bk1.x.y", "malformed token"),
                           (mint_token(subject="a", ttl_s=1, key_id="k1", secret=SECRET, now=now - 10).encode(),
                            "expired at")]:
        with pytest.raises(AuthenticationError, match=words):
            server.new_session(None).step(payload)
    opaque = TokenClientProvider(lambda: "opaque-token").new_session()
    assert opaque.first() == b"opaque-token" and opaque.renew_after_s() is None


@pytest.mark.parametrize("left,delay", [(3600.0, 3540.0), (100.0, 90.0), (10.0, 9.0), (0.0, 0.0), (-5.0, 0.0)])
def test_renew_a_margin_before_expiry(left: float, delay: float) -> None:
    assert renew_delay_s(expires_at=NOW + left, now=NOW) == pytest.approx(delay)


# --- pki and the commands -----------------------------------------------------------------------

def _openssl_text(cert: str) -> str:
    return subprocess.run(["openssl", "x509", "-in", cert, "-noout", "-text"], check=True, capture_output=True,
                          text=True).stdout


def _openssl_verify(ca_file: str, cert: str) -> bool:
    return subprocess.run(["openssl", "verify", "-CAfile", ca_file, cert], capture_output=True).returncode == 0


def test_pki_certificates_as_openssl_reads_them(tmp_path: Path) -> None:
    ca_cert, ca_key = pki.make_ca(str(tmp_path / "ca"), common_name="test CA")
    bookie = pki.issue_bookie_cert(ca_cert, ca_key, str(tmp_path / "out"), bookie_id="bk1.example:3181",
                                   hosts=["bk1.example", "10.0.0.7", "::1"], days=10)
    client = pki.issue_client_cert(ca_cert, ca_key, str(tmp_path / "out"), principal="alice@x")
    server = pki.issue_server_cert(ca_cert, ca_key, str(tmp_path / "out"), hosts=["zk1.example"])
    ca_text = _openssl_text(ca_cert)
    assert "CA:TRUE" in ca_text and "Certificate Sign" in ca_text and "Subject: CN = test CA" in ca_text
    expected = {  # cert: (words present, words absent)
        bookie[0]: (["URI:bookie://bk1.example:3181", "DNS:bk1.example", "IP Address:10.0.0.7",
                     "IP Address:0:0:0:0:0:0:0:1",
                     "TLS Web Server Authentication, TLS Web Client Authentication", "CA:FALSE", "prime256v1",
                     "ecdsa-with-SHA256", "Subject: CN = bk1.example:3181"], []),
        client[0]: (["Subject: CN = alice@x", "TLS Web Client Authentication", "prime256v1"],
                    ["URI:", "Server Authentication", "Subject Alternative Name"]),
        server[0]: (["DNS:zk1.example", "TLS Web Server Authentication"], ["URI:", "Client Authentication"]),
    }
    for cert, (present, absent) in expected.items():
        text = _openssl_text(cert)
        assert all(w in text for w in present), (cert, [w for w in present if w not in text])
        assert not any(w in text for w in absent), (cert, [w for w in absent if w in text])
        assert _openssl_verify(ca_cert, cert)
    for key in (ca_key, bookie[1], client[1], server[1]):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(bookie[0]).st_mode) == 0o644
    assert Path(bookie[0]).name == "bookie-bk1.example_3181.pem" and Path(client[0]).name == "client-alice_x.pem"
    with open(bookie[0], "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds() == pytest.approx(10 * 86400 + 3600,
                                                                                                  abs=2)


def test_pki_refuses_bad_input(tmp_path: Path) -> None:
    ca_cert, ca_key = pki.make_ca(str(tmp_path / "ca"), common_name="a")
    other_cert, other_key = pki.make_ca(str(tmp_path / "other"), common_name="b")
    out = str(tmp_path / "out")
    cases = [
        (lambda: pki.issue_bookie_cert(ca_cert, other_key, out, bookie_id=BOOKIE, hosts=[]), "does not belong"),
        (lambda: pki.issue_bookie_cert(str(tmp_path / "no.pem"), ca_key, out, bookie_id=BOOKIE, hosts=[]),
         "no.pem"),
        (lambda: pki.issue_bookie_cert(ca_cert, ca_cert, out, bookie_id=BOOKIE, hosts=[]), f"CA key {ca_cert}"),
        (lambda: pki.issue_bookie_cert(ca_cert, ca_key, out, bookie_id="a b:1", hosts=[]), "expected HOST:PORT"),
        (lambda: pki.issue_bookie_cert(ca_cert, ca_key, out, bookie_id=BOOKIE, hosts=["bad host"]), "'bad host'"),
        (lambda: pki.issue_client_cert(ca_cert, ca_key, out, principal=""), "non-empty principal"),
        (lambda: pki.issue_server_cert(ca_cert, ca_key, out, hosts=[]), "at least one host"),
        (lambda: pki.issue_client_cert(ca_cert, ca_key, out, principal="a", days=0), "days must be > 0"),
        (lambda: pki.make_ca(str(tmp_path / "ca"), common_name="again"), "ca.pem exists"),
    ]
    for call, words in cases:
        with pytest.raises(ConfigError, match=words):
            call()
    assert not _openssl_verify(other_cert, pki.issue_client_cert(ca_cert, ca_key, out, principal="x")[0])


def _bk(argv: list[str]) -> int:
    import argparse
    common = argparse.ArgumentParser(add_help=False)
    parser = argparse.ArgumentParser(prog="bk")
    add_security_parsers(parser.add_subparsers(dest="command", required=True), common)
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_bk_tls_and_bk_token_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "pki")

    def pair(argv: list[str]) -> tuple[str, str]:
        assert _bk(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split("=", 1)[0] for line in lines] == ["cert", "key"]
        return lines[0].split("=", 1)[1], lines[1].split("=", 1)[1]
    ca_cert, _ = pair(["tls", "ca", "--dir", d, "--common-name", "ops CA"])
    bookie_cert, bookie_key = pair(["tls", "issue", "--ca-dir", d, "--bookie-id", BOOKIE, "--host", "127.0.0.1",
                                    "--dir", str(tmp_path / "b1")])
    client_cert, client_key = pair(["tls", "client", "--ca-dir", d, "--principal", "alice", "--days", "2"])
    server_cert, _ = pair(["tls", "server", "--ca-dir", d, "--host", "zk1", "--host", "10.1.1.1"])
    assert "URI:bookie://127.0.0.1:3181" in _openssl_text(bookie_cert) and "DNS:zk1" in _openssl_text(server_cert)
    hs = Handshake(ReloadingTLS(server_side=True, cert_file=bookie_cert, key_file=bookie_key, ca_file=ca_cert,
                                client_auth=True).context,
                   client_tls(ca_cert, (client_cert, client_key)).context)
    assert hs.ok and hs.server_peer is not None and principal_of(hs.server_peer) == "alice"

    keys = str(tmp_path / "keys.toml")
    assert _bk(["token", "keygen", "--keys-file", keys, "--kid", "k1"]) == 0
    assert capsys.readouterr().out == f"added key id k1 to {keys}\n"
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o600
    assert _bk(["token", "create", "--keys-file", keys, "--kid", "k1", "--subject", "svc", "--ttl-s", "600"]) == 0
    token = capsys.readouterr().out.strip()
    claims = TokenKeys(keys).verify(token)
    assert claims.subject == "svc" and 590 < claims.expires_at - time.time() <= 600
    out = str(tmp_path / "svc.token")
    assert _bk(["token", "create", "--keys-file", keys, "--kid", "k1", "--subject", "svc", "--ttl-s", "60",
                "--out", out]) == 0
    assert token not in capsys.readouterr().out and stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert TokenKeys(keys).verify(token_from_setting(f"file:{out}")()).subject == "svc"
    for argv, words in [(["token", "create", "--keys-file", keys, "--kid", "k9", "--subject", "s", "--ttl-s", "1"],
                         "no key id k9"),
                        (["token", "create", "--keys-file", keys, "--kid", "k1", "--subject", "s", "--ttl-s", "0"],
                         "ttl_s must be > 0"),
                        (["token", "keygen", "--keys-file", keys, "--kid", "k1"], "exists already"),
                        (["tls", "client", "--ca-dir", str(tmp_path / "nope"), "--principal", "a"], "CA certificate")]:
        with pytest.raises(ConfigError, match=words):
            _bk(argv)


def test_test_pki_without_trustme_makes_its_ca_with_pki(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bk bench cluster --tls` uses TestPKI in installs without the test requirements."""
    monkeypatch.setitem(sys.modules, "trustme", None)  # `import trustme` raises ImportError
    own = TestPKI(str(tmp_path / "pki"), organization="no trustme")
    assert "Subject: CN = no trustme" in _openssl_text(own.ca_file)
    hs = Handshake(server_tls(own).context, client_tls(own.ca_file).context)
    assert hs.ok and hs.client_peer is not None and bookie_ids_of(hs.client_peer) == [BOOKIE]


def test_a_token_nested_past_the_recursion_limit_is_malformed() -> None:
    """Found by review: json.loads of a deeply nested claims part raised RecursionError, which
    escaped as the plug-in failing (a traceback per unauthenticated attempt)."""
    import base64

    from bookkeeper.security.tokens import unverified_claims

    body = base64.urlsafe_b64encode(b"[" * 3000).rstrip(b"=").decode()
    with pytest.raises(AuthenticationError, match="^malformed token$"):
        unverified_claims(f"bk1.{body}.sig")


def test_a_ledgers_state_repr_does_not_show_its_master_key() -> None:
    """A bookie's per-ledger state lands in logs through its repr: the key stays out of it."""
    from bookkeeper._ext.shardpath import LedgerState

    key = hashlib.sha1(b"secret").digest()
    text = repr(LedgerState(key, False, 4, 7))
    assert key.hex() not in text and repr(key) not in text and "<20 bytes>" in text and "lac=4" in text
