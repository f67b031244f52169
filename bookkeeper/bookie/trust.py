"""What a shard decides about trust, sans I/O: which role an op needs, when a peer is backed
off, how an AUTH payload splits, how a refusal is classed for /metrics; and the shard's
trust objects built from its config.

Lives in: every shard process (bookkeeper/bookie/server.py asks; bookkeeper/bookie/shard.py
builds `ShardTrust` and reloads its files). The wire itself: docs/protocol.md, START_TLS (6),
AUTH (7), Authorization.
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from bookkeeper.config import BookieConfig
from bookkeeper.proto import Flag, Op
from bookkeeper.security.auth import ServerAuthProvider, load_server_provider
from bookkeeper.security.authz import AuthzPolicy
from bookkeeper.security.tls import ReloadingTLS

PRE_AUTH_FRAME_BYTES = 64 * 1024  # the largest frame a peer may send before it is authenticated
_U32 = struct.Struct(">I")


@dataclass
class ShardTrust:
    """A shard's TLS mode and context, AUTH provider and roles policy (all off by default: the
    in-process driver and a plain bookie)."""

    tls_mode: str = "off"
    tls: ReloadingTLS | None = None
    provider: ServerAuthProvider | None = None
    authz: AuthzPolicy = field(default_factory=lambda: AuthzPolicy(None))
    auth_timeout_s: float = 10.0
    max_unauthenticated: int = 1_000
    backoff: Backoff = field(default_factory=lambda: Backoff())

    @property
    def gated(self) -> bool:
        """Whether a new connection must prove something (TLS, AUTH) before its ops are served."""
        return self.tls_mode == "require" or self.provider is not None


def shard_trust(cfg: BookieConfig) -> ShardTrust:
    """A shard's trust objects from the bookie config; ConfigError names a bad file or spec."""
    tls = None
    if cfg.tls != "off":
        tls = ReloadingTLS(server_side=True, cert_file=cfg.tls_cert_file, key_file=cfg.tls_key_file,
                           ca_file=cfg.tls_ca_file or None, client_auth=cfg.tls_client_auth,
                           reload_interval_s=cfg.tls_reload_interval_s)
    provider = None
    if cfg.auth_provider:
        provider = load_server_provider(cfg.auth_provider, keys_file=cfg.auth_token_keys_file or None,
                                        reload_interval_s=cfg.tls_reload_interval_s)
    return ShardTrust(tls_mode=cfg.tls, tls=tls, provider=provider,
                      authz=AuthzPolicy(cfg.authz_file or None, cfg.tls_reload_interval_s),
                      auth_timeout_s=cfg.auth_timeout_s, max_unauthenticated=cfg.max_unauthenticated_connections)


def required_role(op: int, flags: int) -> str | None:
    """The role an op needs (docs/protocol.md, Authorization).

    | op              | flag         | role    |
    |-----------------|--------------|---------|
    | ADD_ENTRY       | -            | write   |
    | ADD_ENTRY       | RECOVERY_ADD | recover |
    | READ_ENTRY      | - / LONG_POLL| read    |
    | READ_ENTRY      | FENCE        | recover |
    | READ_LAC        | -            | read    |
    | READ_LAC        | FENCE        | recover |
    | WRITE_LAC       | -            | write   |
    | GET_BOOKIE_INFO | -            | none    |
    | WHOAMI          | -            | none (the connection's own principal and roles) |
    | other           | -            | none (answered UNKNOWN_OP, or the AUTH exchange) |

    Why a recovery add needs `recover`, not `write`: recovery rewrites another writer's
    ledger; `write` is the right to write one's own (and to claim a new ledger id)."""
    if op == Op.ADD_ENTRY:
        return "recover" if flags & Flag.RECOVERY_ADD else "write"
    if op in (Op.READ_ENTRY, Op.READ_LAC):
        return "recover" if flags & Flag.FENCE else "read"
    if op == Op.WRITE_LAC:
        return "write"
    return None


ADD_WRITE, ADD_RECOVER = 1, 2  # BookieProtocol.add_roles bits, read by the C add path per receive buffer


def add_roles(roles: frozenset[str]) -> int:
    """The add-path bits of a role set: which adds the C loop may take without asking Python."""
    return (ADD_WRITE if "write" in roles else 0) | (ADD_RECOVER if "recover" in roles else 0)


def split_auth_payload(payload: bytes) -> tuple[str, bytes]:
    """An AUTH request's payload: `u8 n`, the plug-in's name (n ASCII bytes), its payload.
    ValueError saying what is wrong with a malformed one."""
    if not payload:
        raise ValueError("malformed AUTH payload: empty (expected u8 n, the plug-in name, its payload)")
    n = payload[0]
    name = payload[1:1 + n]
    if n == 0 or len(name) != n or not name.isascii():
        raise ValueError(f"malformed AUTH payload: the plug-in name ({n} bytes announced) is missing, "
                         f"short or not ASCII")
    return name.decode("ascii"), payload[1 + n:]


def auth_payload(name: str, body: bytes) -> bytes:
    """The inverse of split_auth_payload (what a client sends)."""
    raw = name.encode("ascii")
    return bytes([len(raw)]) + raw + body


_REASON_CLASSES = (  # (start of the reason, class), first match wins
    ("TLS required", "tls_required"),
    ("authentication required", "required"),
    ("unknown plug-in", "unknown_plugin"),
    ("malformed", "malformed"),
    ("unknown key id", "unknown_key"),
    ("bad signature", "bad_signature"),
    ("expired", "expired"),
    ("no verified client certificate", "no_certificate"),
    ("no client certificate", "no_certificate"),
)


def reason_class(reason: str) -> str:
    """A refusal's class for the `reason` label of bookkeeper_auth_failures_total: a bounded
    set, never the reason itself (it may carry a principal, a time or a key id).

    | reason starts with                 | class          |
    |------------------------------------|----------------|
    | TLS required                       | tls_required   |
    | authentication required            | required       |
    | unknown plug-in                    | unknown_plugin |
    | malformed                          | malformed      |
    | unknown key id                     | unknown_key    |
    | bad signature                      | bad_signature  |
    | expired                            | expired        |
    | no (verified) client certificate   | no_certificate |
    | anything else                      | other          |
    """
    for start, cls in _REASON_CLASSES:
        if reason.startswith(start):
            return cls
    return "other"


class Backoff:
    """Repeat offenders' addresses, sans I/O: after `threshold` failures (AUTH refused, TLS
    handshake failed) within `window_s`, an address's new connections are closed at once
    for `first_s`, doubling with each further block up to `max_s`; an address quiet for a
    window starts over. At most `max_addresses` are remembered, the least recently seen
    forgotten first, so a spray of addresses costs bounded memory.

    Why per address and not per principal: an offender has no principal yet; why a
    growing period: a peer that retries in a loop costs the shard a handshake or a token
    check each time, and legitimate clients with a bad credential fail anyway.
    """

    def __init__(self, *, threshold: int = 10, window_s: float = 60.0, first_s: float = 1.0, max_s: float = 60.0,
                 max_addresses: int = 10_000) -> None:
        self.threshold = threshold
        self.window_s = window_s
        self.first_s = first_s
        self.max_s = max_s
        self.max_addresses = max_addresses
        # address -> [window start, failures in window, blocked until, current period]
        self._table: OrderedDict[str, list[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def blocked(self, address: str, now: float) -> bool:
        """Whether a new connection from `address` is to be closed at once."""
        entry = self._table.get(address)
        return entry is not None and now < entry[2]

    def failed(self, address: str, now: float) -> float:
        """Count a failure of `address`; returns until when it is blocked (0.0: it is not)."""
        table = self._table
        entry = table.pop(address, None) or [now, 0.0, 0.0, 0.0]
        if now - entry[0] >= self.window_s:  # a new window
            entry[0], entry[1] = now, 0.0
            if now - entry[2] >= self.window_s:  # quiet for a window since its last block: starts over
                entry[3] = 0.0
        entry[1] += 1
        if entry[1] >= self.threshold:
            entry[3] = min(self.max_s, entry[3] * 2) if entry[3] else self.first_s
            entry[2] = now + entry[3]
            entry[0], entry[1] = now, 0.0
        table[address] = entry  # the most recently seen last
        while len(table) > self.max_addresses:
            table.popitem(last=False)
        return entry[2] if entry[2] > now else 0.0
