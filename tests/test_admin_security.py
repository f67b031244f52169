"""The admin HTTP made safe (issue 23): HTTPS with the bookie's certificate (reloaded from
disk), bearer tokens or client certificates, roles from the authz file, liveness open for
probes, refusals counted in /metrics, and its client `bookkeeper.bookie.admin_client`.

The decisions (which role a request needs, which principal a credential gives) are table
tests over real key and authz files; the rest runs against real bookie processes
(LocalCluster) with certificates from bookkeeper.testing.pki.

Reference: issue 23 items 1, 2, 3, 5; docs/api.md section 10; RFC 6750 (bearer tokens).
"""
from __future__ import annotations

import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from bookkeeper.bookie.admin_client import AdminHTTPError, admin_request, admin_trust, split_host_port
from bookkeeper.bookie.admin_security import AdminGuard, NoCredential, bearer_token, required_role
from bookkeeper.errors import AuthenticationError, AuthorizationError, BookieUnavailableError, ConfigError
from bookkeeper.security.authz import AuthzPolicy
from bookkeeper.security.tokens import TokenKeys, generate_keys_file, mint_token, read_keys_file
from bookkeeper.testing.cluster import LocalBookie, LocalCluster
from bookkeeper.testing.pki import TestPKI, install
from bookkeeper.testing.waiting import wait_until

AUTHZ = """
[principals]
ops = ["admin", "read"]
viewer = ["read"]
writer = ["write"]
"""


# -- the decisions -------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "role"), [
    ("GET", "/heartbeat", None), ("POST", "/heartbeat", None), ("GET", "/api/v1/bookie/is_ready", None),
    ("GET", "/metrics", "read"), ("GET", "/api/v1/bookie/state", "read"), ("HEAD", "/api/v1/bookie/info", "read"),
    ("GET", "/api/v1/autorecovery/status", "read"), ("GET", "/nope", "read"),
    ("POST", "/api/v1/bookie/gc", "admin"), ("PUT", "/api/v1/bookie/gc", "admin"),
    ("PUT", "/api/v1/bookie/state/readonly", "admin"), ("DELETE", "/api/v1/bookie/state", "admin"),
    ("GET", "/api/v1/bookie/add_trace", "read"), ("POST", "/api/v1/bookie/add_trace", "admin"),
])
def test_the_role_a_request_needs(method: str, path: str, role: str | None) -> None:
    assert required_role(method, path) == role


@pytest.mark.parametrize(("header", "token", "error"), [
    ("Bearer abc.def", "abc.def", None), ("bearer  abc ", "abc", None),
    (None, None, "no credential"), ("", None, "no credential"),
    ("Basic dXNlcjpwdw==", None, "not 'Bearer <token>'"), ("Bearer ", None, "not 'Bearer <token>'"),
    ("abc.def", None, "not 'Bearer <token>'"),
])
def test_the_bearer_token_of_a_header(header: str | None, token: str | None, error: str | None) -> None:
    if error is None:
        assert bearer_token(header) == token
        return
    with pytest.raises(AuthenticationError, match=error) as e:
        bearer_token(header)
    assert isinstance(e.value, NoCredential) == (error == "no credential")
    assert "dXNlcjpwdw" not in str(e.value) and "abc.def" not in str(e.value)


@pytest.fixture(scope="module")
def keys_and_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenKeys, AuthzPolicy, bytes]:
    d = tmp_path_factory.mktemp("guard")
    keys_file = str(d / "keys.toml")
    generate_keys_file(keys_file, "k1")
    (d / "authz.toml").write_text(AUTHZ)
    return TokenKeys(keys_file), AuthzPolicy(str(d / "authz.toml")), read_keys_file(keys_file)["k1"]


CLIENT_CERT = {"subject": ((("organizationName", "tests"),), (("commonName", "ops"),))}
NAMELESS_CERT = {"subject": ((("organizationName", "tests"),),)}


def _credential(kind: str, secret: bytes) -> str | None:
    """The Authorization header of each case (tokens minted now)."""
    if kind == "good":
        return "Bearer " + mint_token(subject="viewer", ttl_s=60, key_id="k1", secret=secret)
    if kind == "expired":
        return "Bearer " + mint_token(subject="viewer", ttl_s=1, key_id="k1", secret=secret, now=time.time() - 10)
    if kind == "forged":
        return "Bearer " + mint_token(subject="ops", ttl_s=60, key_id="k1", secret=b"x" * 32)
    if kind == "unknown kid":
        return "Bearer " + mint_token(subject="ops", ttl_s=60, key_id="k9", secret=secret)
    if kind == "garbage":
        return "Bearer bk1.nonsense"
    return None


@pytest.mark.parametrize(("provider", "header", "cert", "client_auth", "asked", "expect"), [
    # no provider: everyone is anonymous (tls_client_auth still wants a certificate)
    ("", None, None, False, False, "anonymous"),
    ("", "forged", None, False, False, "anonymous"),
    ("", None, None, True, True, "!no client certificate (tls_client_auth"),
    ("", None, CLIENT_CERT, True, True, "anonymous"),
    # token: a bearer token, each bad case its reason
    ("token", "good", None, False, False, "viewer"),
    ("token", None, None, False, False, "!no credential: send 'Authorization: Bearer <token>' (auth_provider = token"),
    ("token", "expired", None, False, False, "!token refused: expired at "),
    ("token", "forged", None, False, False, "!token refused: bad signature"),
    ("token", "unknown kid", None, False, False, "!token refused: unknown key id k9"),
    ("token", "garbage", None, False, False, "!token refused: malformed token"),
    ("token", None, CLIENT_CERT, False, False, "!no credential"),
    # mtls: the verified certificate's CN
    ("mtls", None, CLIENT_CERT, False, True, "ops"),
    ("mtls", "good", None, False, True, "!no credential: send a client certificate"),
    ("mtls", None, NAMELESS_CERT, False, True, "!names no principal"),
    ("mtls", None, None, False, False, "!cannot ask for a client certificate"),
    # a plug-in: whatever the bookie can check, a token first
    ("my.plugin:Auth", "good", CLIENT_CERT, False, True, "viewer"),
    ("my.plugin:Auth", None, CLIENT_CERT, False, True, "ops"),
    ("my.plugin:Auth", None, None, False, True, "!'Authorization: Bearer <token>' or a client certificate"),
])
def test_who_a_request_is(keys_and_policy: tuple[TokenKeys, AuthzPolicy, bytes], provider: str,
                          header: str | None, cert: dict[str, Any] | None, client_auth: bool, asked: bool,
                          expect: str) -> None:
    keys, policy, secret = keys_and_policy
    guard = AdminGuard(provider=provider, keys=keys if provider != "mtls" else None, policy=policy, tls_on=True,
                       client_cert_required=client_auth, client_certs_asked=asked)
    authorization = _credential(header, secret) if header else None
    if not expect.startswith("!"):
        assert guard.authenticate(authorization, cert) == expect
        return
    with pytest.raises(AuthenticationError) as e:
        guard.authenticate(authorization, cert)
    assert expect[1:] in str(e.value)
    assert authorization is None or authorization.split()[1] not in str(e.value)  # never the token


def test_a_plugin_without_keys_or_a_ca_says_what_the_bookie_lacks(
        keys_and_policy: tuple[TokenKeys, AuthzPolicy, bytes]) -> None:
    _keys, policy, _secret = keys_and_policy
    guard = AdminGuard(provider="my.plugin:Auth", keys=None, policy=policy, tls_on=False,
                       client_cert_required=False, client_certs_asked=False)
    with pytest.raises(NoCredential, match="a plug-in the admin HTTP cannot run: give the bookie auth_token_keys_file"):
        guard.authenticate("Bearer x", None)
    assert any("no credential can reach it" in w for w in guard.config_warnings())
    token_in_clear = AdminGuard(provider="token", keys=_keys, policy=policy, tls_on=False,
                                client_cert_required=False, client_certs_asked=False)
    assert any("clear text" in w for w in token_in_clear.config_warnings())


@pytest.mark.parametrize(("principal", "role", "allowed"), [
    ("ops", "admin", True), ("ops", "read", True), ("viewer", "read", True), ("viewer", "admin", False),
    ("writer", "read", False), ("anonymous", "read", False), ("stranger", "admin", False),
])
def test_roles_come_from_the_authz_file(keys_and_policy: tuple[TokenKeys, AuthzPolicy, bytes], principal: str,
                                        role: str, allowed: bool) -> None:
    keys, policy, _ = keys_and_policy
    guard = AdminGuard(provider="token", keys=keys, policy=policy, tls_on=True, client_cert_required=False,
                       client_certs_asked=False)
    if allowed:
        guard.authorize(principal, role)
        return
    with pytest.raises(AuthorizationError, match=f"principal '{principal}' lacks role '{role}'"):
        guard.authorize(principal, role)


@pytest.mark.parametrize(("text", "expect"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("[::1]:80", ("::1", 80)), ("bookie-1.example:8443", ("bookie-1.example", 8443)),
    ("localhost", None), (":8000", None), ("127.0.0.1:0", None), ("127.0.0.1:70000", None), ("h:http", None),
])
def test_host_port(text: str, expect: tuple[str, int] | None) -> None:
    if expect is not None:
        assert split_host_port(text) == expect
        return
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port(text)


def test_the_client_never_sends_a_token_in_clear_text_to_another_host() -> None:
    """Refused before connecting (nothing listens there: no connection is attempted)."""
    with pytest.raises(ConfigError, match="refusing to send the bearer token in clear text to 192.0.2.1:9"):
        admin_request("192.0.2.1:9", "GET", "/metrics", token="bk1.secret.token")
    with pytest.raises(BookieUnavailableError, match="cannot reach the admin HTTP at 127.0.0.1:9"):
        admin_request("127.0.0.1:9", "GET", "/metrics", token="bk1.secret.token", timeout_s=5)


@pytest.mark.parametrize(("settings", "expect"), [
    ({}, {"token": ""}),
    ({"auth_token": "t"}, {"token": "t"}),
    ({"tls_ca_file": "ca.pem", "auth_token": "t"}, {"token": "t", "tls_ca_file": "ca.pem", "tls_cert_file": "",
                                                   "tls_key_file": ""}),
    ({"tls": "off", "tls_ca_file": "ca.pem"}, {"token": ""}),
    ({"tls": "optional", "tls_ca_file": "ca.pem", "tls_cert_file": "c.pem", "tls_key_file": "k.pem"},
     {"token": "", "tls_ca_file": "ca.pem", "tls_cert_file": "c.pem", "tls_key_file": "k.pem"}),
])
def test_admin_trust_from_the_client_settings(settings: dict[str, str], expect: dict[str, str]) -> None:
    assert admin_trust(settings) == expect


# -- a real bookie: HTTPS, tokens, roles ---------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(str(tmp_path_factory.mktemp("admin-pki")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki: TestPKI) -> Iterator[LocalCluster]:
    """One bookie: tls = require, auth_provider = token, the authz file above; files re-read
    every 0.2 s (the certificate test replaces its certificate)."""
    d = tmp_path_factory.mktemp("admin-sec")
    (d / "authz.toml").write_text(AUTHZ)
    c = LocalCluster(d, bookies=1, shards=2, http_ports=True, pki=pki,
                     bookie_trust={"auth_provider": "token", "authz_file": str(d / "authz.toml"),
                                   "tls_reload_interval_s": 0.2})
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def bookie(cluster: LocalCluster) -> LocalBookie:
    return cluster.bookies[0]


def addr(b: LocalBookie) -> str:
    return f"127.0.0.1:{b.http_port}"


def client_ctx(ca_file: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def raw(b: LocalBookie, ctx: ssl.SSLContext, method: str, path: str, *,
        token: str | None = None) -> tuple[int, dict[str, str], Any]:
    """One HTTPS request with http.client: status, headers and the JSON body (or text)."""
    import http.client
    import json

    conn = http.client.HTTPSConnection("127.0.0.1", b.http_port, context=ctx, timeout=30)
    try:
        conn.request(method, path, body=b"" if method != "GET" else None,
                     headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        body = r.read()
        headers = {k.lower(): v for k, v in r.getheaders()}
        return r.status, headers, json.loads(body) if headers["content-type"] == "application/json" else body.decode()
    finally:
        conn.close()


def refused(cluster: LocalCluster, b: LocalBookie, pki: TestPKI) -> dict[str, float]:
    """bookkeeper_admin_http_refused_total by reason, scraped with a `read` token."""
    text = admin_request(addr(b), "GET", "/metrics", tls_ca_file=pki.ca_file, token=cluster.token("viewer"))
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "bookkeeper_admin_http_refused_total"}


def test_https_with_the_ca_works_and_fails_without_it(cluster: LocalCluster, bookie: LocalBookie,
                                                      pki: TestPKI) -> None:
    """The right CA: served, the host name checked against the certificate's SANs. No CA (plain
    HTTP): a plain 400 saying HTTPS. Another CA, a name the certificate lacks, TLS 1.2: each
    handshake refused with its reason, and counted."""
    before = refused(cluster, bookie, pki)
    state = admin_request(addr(bookie), "GET", "/api/v1/bookie/state", tls_ca_file=pki.ca_file,
                          token=cluster.token("viewer"))
    assert state["bookie_id"] == bookie.bookie_id
    with pytest.raises(AdminHTTPError) as plain:
        admin_request(addr(bookie), "GET", "/api/v1/bookie/state")
    assert plain.value.status == 400 and "serves HTTPS only" in plain.value.reason
    with pytest.raises(AuthenticationError, match="TLS handshake failed: .*not signed by a trusted CA"):
        admin_request(addr(bookie), "GET", "/heartbeat", tls_ca_file=pki.other_ca().ca_file)
    with pytest.raises(AuthenticationError, match="Hostname mismatch"):
        admin_request(f"localhost:{bookie.http_port}", "GET", "/heartbeat", tls_ca_file=pki.ca_file)
    old = client_ctx(pki.ca_file)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", bookie.http_port), timeout=30) as s:
        with pytest.raises(ssl.SSLError):
            old.wrap_socket(s, server_hostname="127.0.0.1")
    wait_until("the three refused handshakes counted",
               lambda: refused(cluster, bookie, pki)["tls_handshake"] >= before["tls_handshake"] + 3)
    assert refused(cluster, bookie, pki)["plain_http"] == before["plain_http"] + 1


def test_liveness_is_open(bookie: LocalBookie, pki: TestPKI) -> None:
    """Probes hold no secret: /heartbeat and /api/v1/bookie/is_ready answer without a token."""
    assert admin_request(addr(bookie), "GET", "/heartbeat", tls_ca_file=pki.ca_file) == "OK\n"
    assert admin_request(addr(bookie), "GET", "/api/v1/bookie/is_ready", tls_ca_file=pki.ca_file) == \
        {"ready": True, "state": "writable"}


def test_bk_environment_reaches_it(cluster: LocalCluster, bookie: LocalBookie, pki: TestPKI, tmp_path: Path) -> None:
    """What `bk bookie ...` sends, from BK_TLS_CA_FILE and BK_AUTH_TOKEN (a token file re-read
    at each request, as a renewed token on disk should be)."""
    from bookkeeper.cli.common import client_settings

    token_file = tmp_path / "token"
    token_file.write_text(cluster.token("viewer") + "\n")
    env = {"BK_TLS_CA_FILE": pki.ca_file, "BK_AUTH_TOKEN": f"file:{token_file}"}
    info = admin_request(addr(bookie), "GET", "/api/v1/bookie/info", **admin_trust(client_settings(env)))
    assert info["bookie_id"] == bookie.bookie_id
    token_file.write_text(cluster.token("writer"))
    with pytest.raises(AdminHTTPError, match="principal 'writer' lacks role 'read'"):
        admin_request(addr(bookie), "GET", "/api/v1/bookie/info", **admin_trust(client_settings(env)))


def test_acting_needs_an_admin_token(cluster: LocalCluster, bookie: LocalBookie, pki: TestPKI) -> None:
    """POST/PUT without a token: 401 naming why (and the Bearer challenge); a bad token: 401
    with its reason, never the token; a `read` token: 403 naming principal and role; an
    `admin` token: done."""
    ctx = client_ctx(pki.ca_file)
    status, headers, body = raw(bookie, ctx, "POST", "/api/v1/bookie/gc")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    assert body["error"] == ("not authenticated: no credential: send 'Authorization: Bearer <token>' "
                             "(auth_provider = token on this bookie)")
    secret = read_keys_file(cluster.token_keys_file)[LocalCluster.TOKEN_KEY_ID]
    bad = {"token refused: bad signature": mint_token(subject="ops", ttl_s=60, key_id=LocalCluster.TOKEN_KEY_ID,
                                                      secret=os.urandom(32)),
           "token refused: expired at ": mint_token(subject="ops", ttl_s=10, key_id=LocalCluster.TOKEN_KEY_ID,
                                                    secret=secret, now=time.time() - 60),
           "token refused: unknown key id nope": mint_token(subject="ops", ttl_s=60, key_id="nope", secret=secret)}
    for reason, token in bad.items():
        with pytest.raises(AdminHTTPError) as e:
            admin_request(addr(bookie), "POST", "/api/v1/bookie/gc", tls_ca_file=pki.ca_file, token=token)
        assert e.value.status == 401 and reason in e.value.reason and token not in e.value.reason
    status, _, body = raw(bookie, ctx, "POST", "/api/v1/bookie/gc", token=cluster.token("viewer"))
    assert (status, body) == (403, {"error": "principal 'viewer' lacks role 'admin'", "principal": "viewer",
                                    "role": "admin"})
    with pytest.raises(AdminHTTPError, match="HTTP 403 principal 'viewer' lacks role 'admin'"):
        admin_request(addr(bookie), "PUT", "/api/v1/bookie/state/readonly", body={"readonly": True},
                      tls_ca_file=pki.ca_file, token=cluster.token("viewer"))
    ops = cluster.token("ops")
    gc = admin_request(addr(bookie), "POST", "/api/v1/bookie/gc", tls_ca_file=pki.ca_file, token=ops)
    assert gc["shards_failed"] == [] and len(gc["shards"]) == 2
    for on in (True, False):
        switch = admin_request(addr(bookie), "PUT", "/api/v1/bookie/state/readonly", body={"readonly": on},
                               tls_ca_file=pki.ca_file, token=ops)
        assert switch["readonly"] is on


def test_reading_state_needs_the_read_role(cluster: LocalCluster, bookie: LocalBookie, pki: TestPKI) -> None:
    """/metrics and /api/v1/... need `read`: none without a token (401), not a `write`-only
    principal (403); each refusal counted by reason; an unknown route is 404 only once known."""
    ctx = client_ctx(pki.ca_file)
    before = refused(cluster, bookie, pki)
    assert raw(bookie, ctx, "GET", "/metrics")[0] == 401
    assert raw(bookie, ctx, "GET", "/nope")[0] == 401
    status, _, body = raw(bookie, ctx, "GET", "/metrics", token=cluster.token("writer"))
    assert (status, body["role"], body["principal"]) == (403, "read", "writer")
    assert raw(bookie, ctx, "GET", "/api/v1/bookie/info", token=cluster.token("writer"))[0] == 403
    assert raw(bookie, ctx, "GET", "/api/v1/autorecovery/status", token=cluster.token("stranger"))[0] == 403
    assert raw(bookie, ctx, "GET", "/nope", token=cluster.token("viewer"))[0] == 404
    assert raw(bookie, ctx, "GET", "/api/v1/bookie/gc", token=cluster.token("viewer"))[0] == 405
    # An add trace is read with `read`, started only with `admin` (it makes shards keep records).
    assert raw(bookie, ctx, "GET", "/api/v1/bookie/add_trace", token=cluster.token("viewer"))[0] == 200
    status, _, body = raw(bookie, ctx, "POST", "/api/v1/bookie/add_trace", token=cluster.token("viewer"))
    assert (status, body.get("role")) == (403, "admin")
    status, _, info = raw(bookie, ctx, "GET", "/api/v1/bookie/info", token=cluster.token("viewer"))
    assert status == 200 and info["bookie_id"] == bookie.bookie_id
    after = refused(cluster, bookie, pki)
    assert after["no_credential"] - before["no_credential"] == 2
    assert after["forbidden"] - before["forbidden"] == 4


def test_one_forced_gc_at_a_time_with_admin_tokens(cluster: LocalCluster, bookie: LocalBookie,
                                                   pki: TestPKI) -> None:
    """100 concurrent GC POSTs over HTTPS with an admin token run one pass: with the shards
    stopped the first cannot end, every other meets it (409); then it answers 200."""
    ops = cluster.token("ops")

    def post() -> tuple[int, Any]:
        try:
            return 200, admin_request(addr(bookie), "POST", "/api/v1/bookie/gc", tls_ca_file=pki.ca_file,
                                      token=ops, timeout_s=120)
        except AdminHTTPError as e:
            return e.status, e.reason

    shards = bookie.shard_pids()
    assert len(shards) == 2
    for pid in shards:
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(16) as pool:
            posts = [pool.submit(post) for _ in range(100)]
            wait_until("99 of 100 GC POSTs answered", lambda: sum(f.done() for f in posts) >= 99, timeout_s=120)
            answered = [f for f in posts if f.done()]
            for pid in shards:
                os.kill(pid, signal.SIGCONT)
            ran = [f.result() for f in posts if f not in answered]
    finally:
        for pid in shards:
            os.kill(pid, signal.SIGCONT)
    busy = [f.result() for f in answered]
    assert {status for status, _ in busy} == {409}
    assert all("a forced GC pass is running since" in reason for _, reason in busy)
    assert len(ran) == 1 and ran[0][0] == 200 and ran[0][1]["shards_failed"] == [] and len(ran[0][1]["shards"]) == 2
    wait_until("ready again", lambda: admin_request(addr(bookie), "GET", "/api/v1/bookie/is_ready",
                                                    tls_ca_file=pki.ca_file)["ready"])


def _served_certificate(b: LocalBookie, ca_file: str) -> bytes:
    with socket.create_connection(("127.0.0.1", b.http_port), timeout=30) as s:
        with client_ctx(ca_file).wrap_socket(s, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(cert_file: str) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding

    return x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).public_bytes(Encoding.DER)


def test_a_certificate_replaced_on_disk_is_served_to_the_next_connection(cluster: LocalCluster, bookie: LocalBookie,
                                                                       pki: TestPKI) -> None:
    """The pair is replaced by rename as an operator's roll does: the next connection gets the
    new certificate, with no restart; a connection opened before keeps its own and is served."""
    cert_file, key_file = bookie.conf["tls_cert_file"], bookie.conf["tls_key_file"]
    assert _served_certificate(bookie, pki.ca_file) == _der(cert_file)
    early = client_ctx(pki.ca_file).wrap_socket(socket.create_connection(("127.0.0.1", bookie.http_port), timeout=30),
                                                server_hostname="127.0.0.1")
    try:
        new_cert, new_key = pki.bookie(bookie.bookie_id)
        assert _der(new_cert) != _der(cert_file)
        install(new_key, key_file)
        install(new_cert, cert_file)
        wait_until("the new certificate served", lambda: _served_certificate(bookie, pki.ca_file) == _der(new_cert),
                   timeout_s=30)
        assert early.getpeercert(binary_form=True) != _der(new_cert)
        early.sendall(b"GET /heartbeat HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while chunk := early.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 200 OK") and answer.endswith(b"OK\n")
    finally:
        early.close()


def test_mtls_principals_come_from_client_certificates(cluster: LocalCluster, pki: TestPKI) -> None:
    """A bookie with auth_provider = mtls (and tls_client_auth): liveness without a
    certificate; other routes need one signed by its CA, whose CN is the principal."""
    b = cluster.add_bookie(auth_provider="mtls", tls_client_auth=True)
    try:
        assert admin_request(addr(b), "GET", "/heartbeat", tls_ca_file=pki.ca_file) == "OK\n"
        with pytest.raises(AdminHTTPError, match="HTTP 401 not authenticated: no client certificate"):
            admin_request(addr(b), "GET", "/api/v1/bookie/state", tls_ca_file=pki.ca_file)
        ops_cert, ops_key = pki.client("ops")
        state = admin_request(addr(b), "GET", "/api/v1/bookie/state", tls_ca_file=pki.ca_file,
                              tls_cert_file=ops_cert, tls_key_file=ops_key)
        assert state["bookie_id"] == b.bookie_id
        status, _, body = raw(b, client_ctx(pki.ca_file, pki.client("viewer")), "POST", "/api/v1/bookie/gc")
        assert (status, body["principal"], body["role"]) == (403, "viewer", "admin")
        stranger = pki.other_ca().client("ops")
        with pytest.raises(AuthenticationError, match="TLS handshake failed"):
            admin_request(addr(b), "GET", "/api/v1/bookie/state", tls_ca_file=pki.ca_file,
                          tls_cert_file=stranger[0], tls_key_file=stranger[1])
    finally:
        b.stop()


def test_no_token_reaches_the_log(bookie: LocalBookie) -> None:
    """Every token these tests sent, good and bad: none is in the bookie's log."""
    log = (bookie.dir / "bookie.log").read_text(errors="replace")
    assert f"BOOKIE READY {bookie.bookie_id}" in log
    assert "bk1." not in log


def test_the_admin_client_follows_no_redirect_so_its_token_goes_nowhere_else() -> None:
    """Found by review: urllib follows a redirect and carries the Authorization header to
    wherever it points. A redirect is now an error answer; the target never hears a request."""
    import http.server
    import threading

    heard: list[str | None] = []

    class Target(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            heard.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    target = http.server.HTTPServer(("127.0.0.1", 0), Target)

    class Redirect(Target):
        def do_POST(self) -> None:
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{target.server_port}/steal")
            self.end_headers()

    source = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (target, source)]
    for t in threads:
        t.start()
    try:
        with pytest.raises(AdminHTTPError) as e:
            admin_request(f"127.0.0.1:{source.server_port}", "POST", "/api/v1/bookie/gc", token="bk1.x.y", timeout_s=5)
        assert e.value.status == 307 and heard == []
    finally:
        for s in (target, source):
            s.shutdown()
            s.server_close()
