"""Ledger metadata and its versioned, documented serialization (docs/metadata.md).

Format history (the `format_version` field of the JSON object):
  1 - first version: ensembles as [{"first_entry_id", "bookies"}], custom metadata
      base64, password digest hex (sha256 of the password). Optional key
      "writer_ensembles" (the segments as the fenced writer left them, same shape as
      "ensembles"), set when recovery begins; readers that do not know it may ignore it.
      Optional key "password" (base64): the ledger's password, kept so that auto-recovery
      (which copies entries to new bookies: it needs the master key, and the MAC key to
      verify MAC digests) can work on any ledger, as Apache BookKeeper keeps it. Anyone who
      can read the metadata can read it: ZooKeeper ACLs are the protection. `bk ledger
      metadata` never prints it.
"""
from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from bookkeeper.errors import BKError

FORMAT_VERSION = 1


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


def password_digest(password: bytes) -> str:
    """What metadata keeps of a password: enough to check it, never the password."""
    return hashlib.sha256(b"bookkeeper-py:" + password).hexdigest()


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
    password: bytes | None = field(default=None, repr=False)  # for auto-recovery; None: created before it was kept
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
        }
        if secrets and self.password is not None:
            out["password"] = base64.b64encode(self.password).decode()
        return out

    def serialize(self) -> bytes:
        return json.dumps(self.to_json_dict(secrets=True), sort_keys=True).encode()

    @classmethod
    def deserialize(cls, data: bytes, *, version: int = -1) -> LedgerMetadata:
        """Parse a stored znode; refuses formats newer than this code knows."""
        try:
            d = json.loads(data)
            fmt = d["format_version"]
            if fmt > FORMAT_VERSION:
                raise BKError(f"ledger metadata format {fmt} is newer than supported {FORMAT_VERSION}")
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
                version=version,
            )
        except (KeyError, ValueError, TypeError) as e:
            raise BKError(f"corrupt ledger metadata: {e}") from e
