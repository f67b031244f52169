"""Entry digests: every entry carries a checksum (CRC32C) or MAC, verified on read.

Layout of a stored entry (what the bookie keeps and returns, big-endian):
  u64 ledger_id | i64 entry_id | i64 lac | u64 length | digest | data
`length` is the ledger length including this entry; `lac` is the writer's LAC when
it sent the entry (piggybacked, as in Apache BookKeeper). The digest covers the
32-byte header and the data: a bookie cannot misfile or alter an entry unseen.
CRC32C: 4 bytes. MAC: 20 bytes, HMAC-SHA1 keyed from the password (BookKeeper's MAC).
"""
from __future__ import annotations

import hashlib

from bookkeeper._ext.client import DIGEST_CRC32C, DIGEST_DUMMY, DIGEST_MAC, check_entry, encode_entry
from bookkeeper.errors import DigestMismatchError
from bookkeeper.meta.ledger_metadata import DigestType

HEADER_BYTES = 32
_KIND = {DigestType.CRC32C: DIGEST_CRC32C, DigestType.MAC: DIGEST_MAC, DigestType.DUMMY: DIGEST_DUMMY}


MAX_SHARED_KEYS = 1024  # distinct derived keys shared between handles; past it the table starts again
_shared_keys: dict[bytes, bytes] = {}


def shared_key(key: bytes) -> bytes:
    """One bytes object per distinct derived key (master key, MAC key) for the whole process:
    ledgers written with one password share it. Why: 53 bytes fewer per handle for each key,
    and one object every add reads that stays in the CPU's caches instead of one per handle
    that does not (10^4 open handles: issue 26). Keys, not passwords: each is a SHA-1 of one."""
    shared = _shared_keys.get(key)
    if shared is None:
        if len(_shared_keys) >= MAX_SHARED_KEYS:
            _shared_keys.clear()
        shared = _shared_keys[key] = key
    return shared


def master_key(password: bytes) -> bytes:
    """The 20-byte key bookies check on adds and fencing (never all zeros in practice)."""
    return shared_key(hashlib.sha1(b"ledger" + password).digest())


class DigestManager:
    """Encodes and verifies the entries of one ledger (the codec itself is Cython: client.pyx)."""

    def __init__(self, ledger_id: int, digest: DigestType, password: bytes) -> None:
        self.ledger_id = ledger_id
        self.digest = digest
        self.kind = _KIND[digest]
        self.mac_key = shared_key(hashlib.sha1(b"mac" + password).digest())
        self.size = {DigestType.CRC32C: 4, DigestType.MAC: 20, DigestType.DUMMY: 0}[digest]

    def encode(self, entry_id: int, lac: int, length: int, data: bytes) -> bytes:
        encoded: bytes = encode_entry(self.kind, self.mac_key, self.ledger_id, entry_id, lac, length, data)
        return encoded

    def verify(self, payload: bytes | memoryview, entry_id: int) -> tuple[bytes, int, int]:
        """Check a stored entry (any buffer: the read path passes a view of the receive buffer);
        returns (data, lac, length), data copied out as bytes, or raises DigestMismatchError."""
        try:
            checked: tuple[bytes, int, int] = check_entry(self.kind, self.mac_key, self.ledger_id, entry_id, payload)
        except ValueError as e:
            raise DigestMismatchError(str(e)) from None
        return checked
