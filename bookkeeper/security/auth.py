"""AUTH exchange plug-ins, sans-I/O: the wire carries their payloads, they decide.

An exchange is a plug-in name and rounds of payloads: the client sends `first()`, the server
answers each payload with an `AuthStep`; a step `done` with a principal authenticates the
connection until `expires_at` (the wire closes it then unless a new exchange on the open
connection renews it, which a client starts `renew_after_s()` from now). A failed step raises
`AuthenticationError(reason)`; the wire adds the bookie's and the plug-in's names.

Built-ins:
- `mtls`: the principal is the verified client certificate's subject commonName
  (`principal_of`); the certificate's notAfter is the expiry. The client sends nothing.
- `token`: the client sends a `bk1` token (bookkeeper.security.tokens); the bookie verifies
  it with its keys file; the token's `exp` is the expiry. The client renews a margin before.
- `package.module:ClassName` (or `package.module.ClassName`): one's own, built with no
  arguments, with the shape of the Protocols below.
"""
from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

from bookkeeper.errors import AuthenticationError, ConfigError
from bookkeeper.security.tls import PeerCert, cert_expires_at, principal_of
from bookkeeper.security.tokens import TokenKeys, token_from_setting, unverified_claims

RENEW_MARGIN_MAX_S = 60.0  # renew a token at most this long before it expires...
RENEW_MARGIN_FRACTION = 0.1  # ...and at least this share of its remaining life before


@dataclass(frozen=True, slots=True)
class AuthStep:
    """The server's answer to one payload: `reply` to send back; `done` with a `principal`:
    authenticated until `expires_at` (epoch s; None: no expiry)."""

    done: bool
    reply: bytes = b""
    principal: str | None = None
    expires_at: float | None = None


class ServerAuthSession(Protocol):
    def step(self, payload: bytes) -> AuthStep: ...


@runtime_checkable
class ServerAuthProvider(Protocol):
    name: str

    def new_session(self, peercert: PeerCert | None) -> ServerAuthSession: ...


class ClientAuthSession(Protocol):
    def first(self) -> bytes: ...

    def step(self, reply: bytes) -> bytes | None: ...

    def renew_after_s(self) -> float | None: ...


@runtime_checkable
class ClientAuthProvider(Protocol):
    name: str

    def new_session(self) -> ClientAuthSession: ...


class _MtlsServerSession:
    def __init__(self, peercert: PeerCert | None) -> None:
        self._peercert = peercert

    def step(self, payload: bytes) -> AuthStep:
        if not self._peercert:
            raise AuthenticationError("no verified client certificate (the bookie needs tls_client_auth, "
                                      "the client tls_cert_file and tls_key_file)")
        principal = principal_of(self._peercert)
        if not principal:
            raise AuthenticationError("the client certificate has no subject commonName to be its principal")
        return AuthStep(done=True, principal=principal, expires_at=cert_expires_at(self._peercert))


class MtlsServerProvider:
    """`mtls` on the bookie: the principal is the verified client certificate's subject CN."""

    name = "mtls"

    def new_session(self, peercert: PeerCert | None) -> ServerAuthSession:
        return _MtlsServerSession(peercert)


class _TokenServerSession:
    def __init__(self, keys: TokenKeys) -> None:
        self._keys = keys

    def step(self, payload: bytes) -> AuthStep:
        try:
            token = payload.decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationError("malformed token") from None
        self._keys.maybe_reload()
        claims = self._keys.verify(token)
        return AuthStep(done=True, principal=claims.subject, expires_at=claims.expires_at)


class TokenServerProvider:
    """`token` on the bookie: verifies `bk1` tokens with `keys` (exposed for its reload counters)."""

    name = "token"

    def __init__(self, keys: TokenKeys) -> None:
        self.keys = keys

    def new_session(self, peercert: PeerCert | None) -> ServerAuthSession:
        return _TokenServerSession(self.keys)


class _MtlsClientSession:
    def first(self) -> bytes:
        return b""

    def step(self, reply: bytes) -> bytes | None:
        return None

    def renew_after_s(self) -> float | None:
        return None


class MtlsClientProvider:
    """`mtls` on the client: the TLS handshake already showed the certificate; nothing to send."""

    name = "mtls"

    def new_session(self) -> ClientAuthSession:
        return _MtlsClientSession()


def renew_delay_s(*, expires_at: float, now: float) -> float:
    """How long from `now` until a credential expiring at `expires_at` should be renewed: a margin
    before it (a tenth of what is left, at most RENEW_MARGIN_MAX_S); 0 if already due."""
    left = expires_at - now
    return max(0.0, left - min(RENEW_MARGIN_MAX_S, RENEW_MARGIN_FRACTION * left))


class _TokenClientSession:
    def __init__(self, token: Callable[[], str], clock: Callable[[], float]) -> None:
        self._token = token
        self._clock = clock
        self._sent: str | None = None

    def first(self) -> bytes:
        self._sent = self._token()
        return self._sent.encode("ascii")

    def step(self, reply: bytes) -> bytes | None:
        return None

    def renew_after_s(self) -> float | None:
        if self._sent is None:
            return None
        try:
            claims = unverified_claims(self._sent)
        except AuthenticationError:
            return None  # not a bk1 token (a custom bookie provider): no expiry known here
        return renew_delay_s(expires_at=claims.expires_at, now=self._clock())


class TokenClientProvider:
    """`token` on the client: sends the token of its `auth_token` setting, read at each exchange."""

    name = "token"

    def __init__(self, token: Callable[[], str], clock: Callable[[], float] = time.time) -> None:
        self._token = token
        self._clock = clock

    def new_session(self) -> ClientAuthSession:
        return _TokenClientSession(self._token, self._clock)


def _import_class(spec: str, setting: str) -> Any:
    """The class a dotted path names (`pkg.mod:Class` or `pkg.mod.Class`), or ConfigError."""
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr or not sep:
        raise ConfigError(f"{setting} {spec!r}: not mtls, token or a dotted path package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{setting} {spec!r}: module {module_name} cannot be imported: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"{setting} {spec!r}: module {module_name} has no {attr}")
    return cls


def _positional_params(fn: Any) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _instantiate(spec: str, setting: str, protocol: type, new_session_args: int) -> Any:
    """Build the class `spec` names and check it has the protocol's shape: a `name` and a
    `new_session` taking (peercert) on the bookie, nothing on the client (which catches a
    client class configured on a bookie and the reverse)."""
    cls = _import_class(spec, setting)
    try:
        provider = cls()
    except Exception as e:
        raise ConfigError(f"{setting} {spec!r}: {_qualname(cls)}() failed: {type(e).__name__}: {e}") from None
    if (not isinstance(provider, protocol)
            or _positional_params(getattr(provider, "new_session")) not in (new_session_args, None)):
        shape = "new_session(peercert)" if new_session_args else "new_session()"
        raise ConfigError(f"{setting} {spec!r}: {_qualname(cls)} lacks the {protocol.__name__} shape "
                          f"(a name and {shape})")
    return provider


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)


def load_server_provider(spec: str, *, keys_file: str | None, reload_interval_s: float) -> ServerAuthProvider:
    """The bookie's provider for `auth_provider = spec`; ConfigError naming a bad spec."""
    if spec == "mtls":
        return MtlsServerProvider()
    if spec == "token":
        if not keys_file:
            raise ConfigError("auth_provider = token needs auth_token_keys_file")
        return TokenServerProvider(TokenKeys(keys_file, reload_interval_s))
    return cast(ServerAuthProvider, _instantiate(spec, "auth_provider", ServerAuthProvider, 1))


def load_client_provider(spec: str, *, token: str | None) -> ClientAuthProvider:
    """The client's provider for `auth_provider = spec`; ConfigError naming a bad spec."""
    if spec == "mtls":
        return MtlsClientProvider()
    if spec == "token":
        if not token:
            raise ConfigError("auth_provider = token needs auth_token (the token or file:/path)")
        return TokenClientProvider(token_from_setting(token))
    return cast(ClientAuthProvider, _instantiate(spec, "auth_provider", ClientAuthProvider, 0))
