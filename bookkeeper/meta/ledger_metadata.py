"""Ledger metadata and its versioned, documented serialization (docs/metadata.md).

Format history (the `format_version` field of the JSON object):
  1 - first version: ensembles as [{"first_entry_id", "bookies"}], custom metadata
      base64, password digest hex (sha256 of the password). Optional key
      "writer_ensembles" (the segments as the fenced writer left them, same shape as
      "ensembles"), set when recovery begins; readers that do not know it may ignore it.
      Optional key "password" (base64): the ledger's password in the clear, kept so that
      auto-recovery (which copies entries to new bookies: it needs the master key, and the
      MAC key to verify MAC digests) can work on any ledger, as Apache BookKeeper keeps it.
      Keys added later, in the same format (a reader ignores keys it does not know, so
      no version bump was needed and older readers keep reading newer znodes):
      "sealed_password" (issue 23): the password sealed to the cluster's public key
      (bookkeeper/meta/sealing.py), written instead of "password" whenever the cluster has
      published a key; "password" (clear) remains only on a cluster without one, until
      `bk zk secure` seals it. "creator" (issue 23): the principal that created the ledger.
      "password_digest" may be a salted scrypt, `scrypt$N$r$p$<salt b64>$<hash b64>`, told
      from a sha256 one by its prefix; check_password reads both. `bk ledger metadata`
      prints neither the password nor its sealed form.
"""
from __future__ import annotations

import base64
import dataclasses
import enum
import binascii
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from bookkeeper.errors import MetadataFormatError

FORMAT_VERSION = 1
# scrypt's cost: 2^14 x 8 uses 16 MiB and ~27 ms of one core here, per ledger create and open
# (the digest is checked before any bookie is asked); the parameters travel in each digest, so
# raising them later leaves older digests verifiable.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1
SCRYPT_PREFIX = "scrypt$"  # a salted digest; any other is format 1's sha256
_SCRYPT_MAXMEM = 64 * 1024 * 1024


class DigestType(enum.Enum):
    """How each entry is checksummed: CRC32C, or a MAC keyed with the password."""

    CRC32C = "CRC32C"
    MAC = "MAC"
    DUMMY = "DUMMY"


class LedgerState(enum.Enum):
    OPEN = "OPEN"
    IN_RECOVERY = "IN_RECOVERY"
    CLOSED = "CLOSED"


def _segments_json(segments: dict[int, list[str]]) -> list[dict[str, Any]]:
    return [{"first_entry_id": k, "bookies": list(v)} for k, v in sorted(segments.items())]


def _segments(raw: list[dict[str, Any]]) -> dict[int, list[str]]:
    return {int(s["first_entry_id"]): list(s["bookies"]) for s in raw}


def _legacy_digest(password: bytes) -> str:
    return hashlib.sha256(b"bookkeeper-py:" + password).hexdigest()


def _scrypt(password: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, dklen=32, maxmem=_SCRYPT_MAXMEM)


def password_digest(password: bytes) -> str:
    """What metadata keeps of a password: enough to check it, never the password. Salted (a
    fresh 16-byte salt) and slow (scrypt): one who reads the metadata can neither look the
    password up in a table nor try many guesses a second. Compare with check_password, never ==."""
    salt = os.urandom(16)
    hashed = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    return f"{SCRYPT_PREFIX}{SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${base64.b64encode(salt).decode()}${base64.b64encode(hashed).decode()}"


def check_password(password: bytes, digest: str) -> bool:
    """Whether password is the one `digest` was made of: a scrypt digest (format 2) or a sha256
    one (format 1); compared in constant time. A digest in neither form matches nothing."""
    if digest.startswith(SCRYPT_PREFIX):
        try:
            _, n, r, p, salt, hashed = digest.split("$")
            want = base64.b64decode(hashed, validate=True)
            got = _scrypt(password, base64.b64decode(salt, validate=True), int(n), int(r), int(p))
        except (ValueError, binascii.Error):
            return False
        return hmac.compare_digest(got, want)
    return hmac.compare_digest(_legacy_digest(password).encode(), digest.encode())


@dataclass(frozen=True, slots=True)
class LedgerMetadata:
    """Immutable snapshot of one ledger's metadata; updates build a new one (replace)."""

    ledger_id: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    digest: DigestType
    password_digest: str
    ensembles: dict[int, list[str]]
    state: LedgerState = LedgerState.OPEN
    last_entry_id: int = -1
    length: int = 0
    custom_metadata: dict[str, bytes] = field(default_factory=dict)
    ctime: int = field(default_factory=lambda: int(time.time() * 1000))
    writer_ensembles: dict[int, list[str]] | None = None  # set by recovery: the fenced writer's segments
    password: bytes | None = field(default=None, repr=False)  # in the clear: the creator's, or format 1's stored one
    sealed_password: str | None = field(default=None, repr=False)  # sealed to the cluster key (meta/sealing.py)
    creator: str = ""  # the principal that created the ledger ("" before format 2)
    version: int = -1  # the znode version this snapshot was read at; not serialized

    @property
    def is_closed(self) -> bool:
        return self.state is LedgerState.CLOSED

    def ensemble_for(self, entry_id: int) -> list[str]:
        """The ensemble of the segment that holds entry_id."""
        last = max(self.ensembles)
        if entry_id >= last:  # the common case: the writer's current segment
            return self.ensembles[last]
        chosen = None
        for first in sorted(self.ensembles):
            if first <= entry_id:
                chosen = self.ensembles[first]
        if chosen is None:
            chosen = self.ensembles[min(self.ensembles)]
        return chosen

    @property
    def last_ensemble(self) -> list[str]:
        return self.ensembles[max(self.ensembles)]

    def replace(self, **changes: Any) -> LedgerMetadata:
        return dataclasses.replace(self, **changes)

    def to_json_dict(self, *, secrets: bool = False) -> dict[str, Any]:
        """The JSON shape of `bk ledger metadata`; with secrets=True, of the stored znode."""
        out = {
            "format_version": FORMAT_VERSION,
            "ledger_id": self.ledger_id,
            "state": self.state.value,
            "ensemble_size": self.ensemble_size,
            "write_quorum": self.write_quorum,
            "ack_quorum": self.ack_quorum,
            "last_entry_id": self.last_entry_id,
            "length": self.length,
            "digest": self.digest.value,
            "password_digest": self.password_digest,
            "ensembles": _segments_json(self.ensembles),
            "custom_metadata": {k: base64.b64encode(v).decode() for k, v in self.custom_metadata.items()},
            "ctime": self.ctime,
            **({"writer_ensembles": _segments_json(self.writer_ensembles)} if self.writer_ensembles else {}),
            **({"creator": self.creator} if self.creator else {}),
        }
        if secrets and self.sealed_password is not None:
            out["sealed_password"] = self.sealed_password
        elif secrets and self.password is not None:
            out["password"] = base64.b64encode(self.password).decode()
        return out

    def serialize(self) -> bytes:
        return json.dumps(self.to_json_dict(secrets=True), sort_keys=True).encode()

    @classmethod
    def deserialize(cls, data: bytes, *, version: int = -1) -> LedgerMetadata:
        """Parse a stored znode; refuses formats newer than this code knows."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or not isinstance(d.get("custom_metadata", {}), dict):
                raise ValueError("not a JSON object of the documented shape")
            if not d["ensembles"]:
                raise ValueError("no ensembles")
            fmt = d["format_version"]
            if fmt > FORMAT_VERSION:
                raise MetadataFormatError(f"ledger metadata format {fmt} is newer than supported {FORMAT_VERSION}")
            return cls(
                ledger_id=int(d["ledger_id"]),
                ensemble_size=int(d["ensemble_size"]),
                write_quorum=int(d["write_quorum"]),
                ack_quorum=int(d["ack_quorum"]),
                digest=DigestType(d["digest"]),
                password_digest=d["password_digest"],
                ensembles=_segments(d["ensembles"]),
                state=LedgerState(d["state"]),
                last_entry_id=int(d["last_entry_id"]),
                length=int(d["length"]),
                custom_metadata={k: base64.b64decode(v) for k, v in d.get("custom_metadata", {}).items()},
                ctime=int(d["ctime"]),
                writer_ensembles=_segments(d["writer_ensembles"]) if "writer_ensembles" in d else None,
                password=base64.b64decode(d["password"]) if "password" in d else None,
                sealed_password=str(d["sealed_password"]) if "sealed_password" in d else None,
                creator=str(d.get("creator", "")),
                version=version,
            )
        except (KeyError, ValueError, TypeError, OverflowError, RecursionError, binascii.Error) as e:
            raise MetadataFormatError(f"corrupt ledger metadata: {e!r}"[:500]) from e
