"""The `token` provider's tokens and the keys they are signed with.

Token text (format `bk1`, the only version so far):

    bk1.<base64url(JSON {"sub": subject, "exp": unix seconds, "kid": key id})>.<base64url(MAC)>

MAC = HMAC-SHA256(secret of kid, ASCII of "bk1." + the middle part); base64url without
padding; the JSON is compact with sorted keys. Why HMAC and not a public-key signature: the
bookies that verify are the same operators' hosts that mint, and a MAC verifies in a
microsecond. Why a key id: keys rotate: add a new kid to the keys file on every bookie, mint
with it, and remove the old kid once the tokens signed with it have expired.

Keys file (TOML, mode 0600, never world-readable; `bk token keygen` writes it):

    [keys]
    k2026a = "base64 of >= 32 random bytes"
    k2026b = "..."

Key ids are 1-64 of `A-Z a-z 0-9 _ . -`. Verification compares the MAC with
hmac.compare_digest (Pulsar's CVE-2023-51437 compared with ==), checks the MAC before
anything else the token claims, and refuses an expired token (CVE-2023-31007 kept them).
"""
from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

from bookkeeper.errors import AuthenticationError, ConfigError
from bookkeeper.security.reload import LoadError, ReloadCounters, Reloading

TOKEN_VERSION = "bk1"
MIN_SECRET_BYTES = 32
MAX_TOKEN_CHARS = 4096
KEY_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """What a verified token says: who, until when (epoch seconds), signed with which key."""

    subject: str
    expires_at: float
    key_id: str


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, body: str) -> str:
    return _b64url(hmac.new(secret, f"{TOKEN_VERSION}.{body}".encode("ascii"), hashlib.sha256).digest())


def utc_iso(epoch_s: float) -> str:
    """Epoch seconds as `2026-11-27T01:02:03Z` (how expiries are named in errors)."""
    return datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def mint_token(*, subject: str, ttl_s: float, key_id: str, secret: bytes, now: float | None = None) -> str:
    """A token for `subject` valid `ttl_s` seconds from `now` (epoch s), signed with `secret`."""
    if not subject:
        raise ValueError("a token needs a non-empty subject")
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    if not KEY_ID_RE.fullmatch(key_id):
        raise ValueError(f"key id {key_id!r}: 1-64 of A-Z a-z 0-9 _ . -")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a token secret needs >= {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    exp = int((time.time() if now is None else now) + ttl_s)
    body = _b64url(json.dumps({"sub": subject, "exp": exp, "kid": key_id}, separators=(",", ":"),
                              sort_keys=True).encode())
    return f"{TOKEN_VERSION}.{body}.{_mac(secret, body)}"


MAX_EXP = 253_402_300_799  # 9999-12-31T23:59:59Z: any later expiry is no date a float or a datetime holds


def unverified_claims(token: str) -> TokenClaims:
    """The claims of a token WITHOUT checking its MAC: only for a client deciding when to renew
    its own token. AuthenticationError("malformed token") if it is not a `bk1` token."""
    parts = token.split(".") if len(token) <= MAX_TOKEN_CHARS else []
    if len(parts) != 3 or parts[0] != TOKEN_VERSION:
        raise AuthenticationError("malformed token")
    try:
        claims = json.loads(_unb64url(parts[1]))
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise AuthenticationError("malformed token") from None
    if (not isinstance(claims, dict) or set(claims) != {"sub", "exp", "kid"} or not isinstance(claims["sub"], str)
            or not claims["sub"] or type(claims["exp"]) is not int or not 0 <= claims["exp"] <= MAX_EXP
            or not isinstance(claims["kid"], str) or not KEY_ID_RE.fullmatch(claims["kid"])):
        raise AuthenticationError("malformed token")
    return TokenClaims(subject=claims["sub"], expires_at=float(claims["exp"]), key_id=claims["kid"])


def parse_keys(text: str, path: str) -> dict[str, bytes]:
    """The `[keys]` table of a keys file: kid -> secret; LoadError naming what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LoadError(f"keys file {path}: not TOML: {e}") from None
    extra = sorted(set(doc) - {"keys"})
    if extra:
        raise LoadError(f"keys file {path}: unknown top-level key(s) {extra}: only a [keys] table")
    table = doc.get("keys")
    if not isinstance(table, dict) or not table:
        raise LoadError(f"keys file {path}: needs a non-empty [keys] table of key id = \"base64 secret\"")
    keys = {}
    for kid, value in table.items():
        if not KEY_ID_RE.fullmatch(kid):
            raise LoadError(f"keys file {path}: key id {kid!r}: 1-64 of A-Z a-z 0-9 _ . -")
        try:
            secret = base64.b64decode(value, validate=True) if isinstance(value, str) else None
        except binascii.Error:
            secret = None
        if secret is None:
            raise LoadError(f"keys file {path}: key {kid}: not a base64 string")
        if len(secret) < MIN_SECRET_BYTES:
            raise LoadError(f"keys file {path}: key {kid}: {len(secret)} bytes, needs >= {MIN_SECRET_BYTES}")
        keys[kid] = secret
    return keys


def read_keys_file(path: str) -> dict[str, bytes]:
    """Read and parse a keys file, refusing one that others than its owner's group can read."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read()
    except OSError as e:
        raise LoadError(f"keys file {path}: cannot be read: {e.strerror or e}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise LoadError(f"keys file {path}: readable or writable by every user (mode {stat.S_IMODE(mode):04o}): "
                        f"chmod 600 it")
    try:
        return parse_keys(data.decode("utf-8"), path)
    except UnicodeDecodeError:
        raise LoadError(f"keys file {path}: not UTF-8 text") from None


class TokenKeys(ReloadCounters):
    """The secrets tokens are verified with, re-read when the keys file changes (per shard or
    per process; `maybe_reload` is a stat at most once per interval)."""

    _reloading: Reloading[dict[str, bytes]]

    def __init__(self, path: str, reload_interval_s: float = 60.0) -> None:
        if reload_interval_s <= 0:
            raise ConfigError(f"tls_reload_interval_s must be > 0, got {reload_interval_s}")
        self.path = path
        try:
            self._reloading = Reloading([path], lambda: read_keys_file(path), what=f"token keys file {path}",
                                        reload_interval_s=reload_interval_s)
        except LoadError as e:
            raise ConfigError(f"auth_token_keys_file: {e}") from None




    @property
    def key_ids(self) -> list[str]:
        return sorted(self._reloading.value)

    def maybe_reload(self, now: float | None = None) -> bool:
        """Re-read the keys file if it changed (`now`: monotonic s); a bad file keeps the old keys."""
        return self._reloading.maybe_reload(now)

    def secret(self, kid: str) -> bytes | None:
        return self._reloading.value.get(kid)

    def verify(self, token: str, now: float | None = None) -> TokenClaims:
        """The claims of a valid token, else AuthenticationError with the reason: "malformed
        token", "unknown key id K", "bad signature" or "expired at <UTC>" (`now`: epoch s)."""
        claims = unverified_claims(token)
        secret = self.secret(claims.key_id)
        if secret is None:
            raise AuthenticationError(f"unknown key id {claims.key_id}")
        _, body, mac = token.split(".")
        if not mac.isascii() or not hmac.compare_digest(_mac(secret, body).encode(), mac.encode()):
            raise AuthenticationError("bad signature")
        if claims.expires_at <= (time.time() if now is None else now):
            raise AuthenticationError(f"expired at {utc_iso(claims.expires_at)}")
        return claims


def token_from_setting(value: str) -> Callable[[], str]:
    """The client's `auth_token`: the token itself, or `file:/path`, re-read at each call (a token
    renewed on disk goes out with the next AUTH exchange). ConfigError for an empty setting or
    an unreadable or empty file (read once here, so a wrong path fails at connect)."""
    if not value:
        raise ConfigError("auth_token is empty: give the token or file:/path")
    if not value.startswith("file:"):
        token = value.strip()
        return lambda: token
    path = value[len("file:"):]

    def read() -> str:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"auth_token file {path}: cannot be read: {getattr(e, 'strerror', None) or e}"
                              ) from None
        if not token:
            raise ConfigError(f"auth_token file {path}: empty")
        return token
    read()
    return read


def _write_private(path: str, text: str) -> None:
    """Write `text` to `path` atomically (a temp file renamed over it), mode 0600."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def generate_keys_file(path: str, key_id: str) -> None:
    """Add a new random 32-byte key `key_id` to the keys file at `path` (made if absent), 0600.

    The existing keys stay (rotation: several at once); comments in the file do not."""
    if not KEY_ID_RE.fullmatch(key_id):
        raise ConfigError(f"key id {key_id!r}: 1-64 of A-Z a-z 0-9 _ . -")
    try:
        keys = read_keys_file(path) if os.path.exists(path) else {}
    except LoadError as e:
        raise ConfigError(str(e)) from None
    if key_id in keys:
        raise ConfigError(f"keys file {path}: key id {key_id} exists already")
    keys[key_id] = secrets.token_bytes(MIN_SECRET_BYTES)
    lines = ["# Token signing keys (bk token keygen): key id = base64 secret. Keep this file 0600.", "[keys]"]
    lines += [f'"{kid}" = "{base64.b64encode(secret).decode("ascii")}"' for kid, secret in keys.items()]
    _write_private(path, "\n".join(lines) + "\n")
