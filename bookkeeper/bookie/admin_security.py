"""Who may use a bookie's admin HTTP, and over what: its TLS and its authentication, the same
as the bookie's wire (docs/security.md, docs/api.md section 10).

Lives in: the supervisor process, under the admin HTTP's worker threads (bookkeeper/bookie/admin.py).

TLS: served whenever the bookie's `tls` is not `off`, `optional` included. `optional` exists
so that clients of the wire can move to TLS one by one during a rolling migration; the admin
HTTP has no such population of old clients (its callers are `bk`, probes and a scraper,
configured per host), and serving it in clear text for the migration's duration would expose
its tokens and its acting routes for exactly as long. A plain HTTP request to the TLS port is
answered with a plain 400 saying so, not a reset. Each accepted connection is wrapped with the
context current at that moment (the bookie's certificate, reloaded from disk), TLS 1.3.

Authentication follows the bookie's `auth_provider`: `token` takes `Authorization: Bearer
<token>` checked with `auth_token_keys_file`; `mtls` the verified client certificate's subject
commonName (a client certificate is asked for, not demanded, in the handshake: see liveness
below); a plug-in class (its exchange needs the wire) takes either, as the bookie is configured
for them; none: every caller is `anonymous`. With `tls_client_auth` a verified client
certificate is needed as well, as it is on the wire. Roles come from `authz_file`, as on the
wire: every route that acts (POST, PUT) needs `admin`; every GET that reveals state
(`/metrics`, `/api/v1/...`) needs `read`. Liveness (`/heartbeat`, `/api/v1/bookie/is_ready`)
stays open: a probe (systemd, a load balancer, Kubernetes) must work without holding a secret,
and those two say no more than whether the bookie serves. 401 when the credential is missing or
invalid (its reason in the answer), 403 when the principal lacks the role (both named). Each
refusal is counted by reason; no token is ever logged.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any

from bookkeeper.errors import AuthenticationError
from bookkeeper.security.authz import ANONYMOUS, AuthzPolicy
from bookkeeper.security.tls import ReloadingTLS, principal_of
from bookkeeper.security.tokens import TokenKeys

if TYPE_CHECKING:
    from bookkeeper.config import BookieConfig

log = logging.getLogger("bookkeeper.bookie")

OPEN_ROUTES = frozenset({"/heartbeat", "/api/v1/bookie/is_ready"})
# Refusals, as /metrics counts them: a failed TLS handshake, plain HTTP on the TLS port, no
# credential, a credential that did not verify, a principal without the role, the pool full.
REFUSAL_REASONS = ("tls_handshake", "plain_http", "no_credential", "bad_credential", "forbidden", "busy",
                   "cross_site")
TLS_RECORD_HANDSHAKE = 0x16  # the first byte of every TLS ClientHello


def required_role(method: str, path: str) -> str | None:
    """The role a request needs: none for liveness, `read` to look, `admin` to act."""
    if path in OPEN_ROUTES:
        return None
    return "read" if method in ("GET", "HEAD") else "admin"


class NoCredential(AuthenticationError):
    """A request without the credential the bookie asks for (counted apart from a bad one)."""


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; AuthenticationError otherwise
    (the header's value is never repeated: it may hold a secret)."""
    if not authorization:
        raise NoCredential("no credential: send 'Authorization: Bearer <token>'")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("the Authorization header is not 'Bearer <token>'")
    return token.strip()


class AdminGuard:
    """Authentication and authorization of admin HTTP requests (thread-safe: the admin HTTP's
    workers share one). The files are re-read as the bookie's shards re-read them."""

    def __init__(self, *, provider: str, keys: TokenKeys | None, policy: AuthzPolicy, tls_on: bool,
                 client_cert_required: bool, client_certs_asked: bool) -> None:
        self.provider = provider
        self.keys = keys
        self.policy = policy
        self.tls_on = tls_on
        self.client_cert_required = client_cert_required
        self.client_certs_asked = client_certs_asked
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: BookieConfig) -> AdminGuard:
        keys = TokenKeys(cfg.auth_token_keys_file, cfg.tls_reload_interval_s) if cfg.auth_token_keys_file else None
        policy = AuthzPolicy(cfg.authz_file or None, cfg.tls_reload_interval_s)
        tls_on = cfg.tls != "off"
        guard = cls(provider=cfg.auth_provider, keys=keys, policy=policy, tls_on=tls_on,
                    client_cert_required=cfg.tls_client_auth and tls_on,
                    client_certs_asked=asks_client_certs(cfg))
        for warning in guard.config_warnings():
            log.warning("admin HTTP: %s", warning)
        return guard

    def config_warnings(self) -> list[str]:
        """What in the configuration leaves the admin HTTP weaker than the operator may think."""
        out = []
        if self.takes_bearer and not self.tls_on:
            out.append("bearer tokens reach it in clear text (tls = off): set tls so they travel encrypted")
        if self.provider and not self.takes_bearer and not self.client_certs_asked:
            out.append(f"auth_provider = {self.provider} but no credential can reach it ({self._no_credential()}): "
                       f"every route but liveness is refused")
        return out

    @property
    def takes_bearer(self) -> bool:
        return self.provider == "token" or (self._plugin and self.keys is not None)

    @property
    def _plugin(self) -> bool:
        return self.provider not in ("", "token", "mtls")

    def authenticate(self, authorization: str | None, peercert: dict[str, Any] | None) -> str:
        """The principal of a request, or AuthenticationError with the reason (no secret in it)."""
        if self.client_cert_required and not peercert:
            raise NoCredential("no client certificate (tls_client_auth = true on this bookie)")
        if not self.provider:
            return ANONYMOUS
        if self.provider == "token" or (authorization and self.takes_bearer):
            return self._token_principal(authorization)
        if peercert:
            return _certificate_principal(peercert)
        raise NoCredential(f"no credential: {self._no_credential()}")

    def _token_principal(self, authorization: str | None) -> str:
        if not authorization:
            raise NoCredential(f"no credential: {self._no_credential()}")
        token = bearer_token(authorization)
        assert self.keys is not None  # takes_bearer: the config needs the keys file with token
        with self._lock:
            self.keys.maybe_reload()
        try:
            return self.keys.verify(token).subject
        except AuthenticationError as e:
            raise AuthenticationError(f"token refused: {e}") from None

    def _no_credential(self) -> str:
        """What a caller should have sent, as this bookie is configured."""
        ways = []
        if self.takes_bearer:
            ways.append("'Authorization: Bearer <token>'")
        if self.provider != "token" and self.client_certs_asked:
            ways.append("a client certificate signed by the bookie's tls_ca_file")
        if ways:
            return f"send {' or '.join(ways)} (auth_provider = {self.provider} on this bookie)"
        if self.provider == "mtls":
            return ("auth_provider = mtls, but this admin HTTP cannot ask for a client certificate "
                    f"({'tls = off' if not self.tls_on else 'no tls_ca_file'} on this bookie)")
        return (f"auth_provider = {self.provider} is a plug-in the admin HTTP cannot run: give the bookie "
                f"auth_token_keys_file (bearer tokens) or tls with tls_ca_file (client certificates)")

    def authorize(self, principal: str, role: str) -> None:
        """AuthorizationError naming the principal and the role unless the policy grants it."""
        with self._lock:
            self.policy.maybe_reload()
        self.policy.check(principal, role)



class Refusals:
    """Requests and connections the admin HTTP refused, by reason (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REFUSAL_REASONS, 0)

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        """Every reason, zeros included (so each series exists from the first scrape)."""
        with self._lock:
            return dict(self._counts)


def _certificate_principal(peercert: dict[str, Any]) -> str:
    principal = principal_of(peercert)
    if not principal:
        raise AuthenticationError("the client certificate names no principal (no subject commonName)")
    return principal


def asks_client_certs(cfg: BookieConfig) -> bool:
    """Whether the admin HTTP's handshake asks for a client certificate: when one can be
    verified (TLS on, a CA) and something would use it (mtls, a plug-in, tls_client_auth)."""
    wanted = cfg.auth_provider not in ("", "token") or cfg.tls_client_auth
    return cfg.tls != "off" and bool(cfg.tls_ca_file) and wanted


class PlainHTTPOnTLS(Exception):
    """A peer sent plain HTTP to the TLS port."""


class AdminTLS:
    """The admin HTTP's TLS: the bookie's certificate, re-read when it changes; every accepted
    connection is wrapped with the context current then. A client certificate is asked for
    but not demanded (CERT_OPTIONAL): liveness answers without one, authentication decides."""

    def __init__(self, cfg: BookieConfig, *, ask_client_cert: bool) -> None:
        self._tls = ReloadingTLS(
            server_side=True, cert_file=cfg.tls_cert_file, key_file=cfg.tls_key_file,
            ca_file=cfg.tls_ca_file or None, client_auth=ask_client_cert,
            reload_interval_s=cfg.tls_reload_interval_s)
        self._ask_client_cert = ask_client_cert
        self._lock = threading.Lock()
        self._optional: ssl.SSLContext | None = None  # the context already made CERT_OPTIONAL

    def context(self) -> ssl.SSLContext:
        """The context for the next connection (reloaded first if its files changed)."""
        with self._lock:
            self._tls.maybe_reload()
            ctx = self._tls.context
            if self._ask_client_cert and ctx is not self._optional:
                ctx.verify_mode = ssl.CERT_OPTIONAL
                self._optional = ctx
            return ctx

    def accept(self, sock: socket.socket, *, timeout_s: float) -> ssl.SSLSocket:
        """The connection after its TLS handshake (run here, on a worker thread, with a
        deadline: a peer that never completes it cannot hold up the accepting thread).
        Raises PlainHTTPOnTLS for a plain-text peer, ssl.SSLError/OSError for a failed handshake."""
        sock.settimeout(timeout_s)
        first = sock.recv(1, socket.MSG_PEEK)
        if first and first[0] != TLS_RECORD_HANDSHAKE:
            raise PlainHTTPOnTLS()
        tls_sock = self.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            tls_sock.do_handshake()
        except BaseException:
            _close_lingering(tls_sock)
            raise
        return tls_sock


LINGER_S = 0.5
LINGER_BYTES = 64 * 1024


def _close_lingering(tls_sock: ssl.SSLSocket) -> None:
    """Close a connection whose handshake failed so that its peer reads why. In TLS 1.3 a
    client finishes its side first and sends its request at once; closing with that request
    unread makes the kernel send a reset, which can reach the client before it reads the
    alert OpenSSL already wrote (it then sees "connection reset", not "certificate refused").
    So: end our side, read and drop what is in flight for a moment, then close."""
    try:
        tls_sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_S
        drained = 0
        while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
            tls_sock.settimeout(left)
            if not (chunk := tls_sock.recv(4096)):
                break
            drained += len(chunk)
    except (OSError, ValueError):
        pass  # the peer is gone already: nothing left to protect
    finally:
        tls_sock.close()
