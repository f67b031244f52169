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
import hmac
import struct

import crc32c

from bookkeeper.errors import DigestMismatchError
from bookkeeper.meta.ledger_metadata import DigestType

_HEADER = struct.Struct(">QqqQ")
HEADER_BYTES = _HEADER.size


def master_key(password: bytes) -> bytes:
    """The 20-byte key bookies check on adds and fencing (never all zeros in practice)."""
    return hashlib.sha1(b"ledger" + password).digest()


class DigestManager:
    """Encodes and verifies the entries of one ledger."""

    def __init__(self, ledger_id: int, digest: DigestType, password: bytes) -> None:
        self.ledger_id = ledger_id
        self.digest = digest
        self._mac_key = hashlib.sha1(b"mac" + password).digest()
        self.size = {DigestType.CRC32C: 4, DigestType.MAC: 20, DigestType.DUMMY: 0}[digest]

    def _compute(self, header: bytes, data: bytes | memoryview) -> bytes:
        if self.digest is DigestType.CRC32C:
            return struct.pack(">I", crc32c.crc32c(data, crc32c.crc32c(header)))
        if self.digest is DigestType.MAC:
            m = hmac.new(self._mac_key, header, hashlib.sha1)
            m.update(data)
            return m.digest()
        return b""

    def encode(self, entry_id: int, lac: int, length: int, data: bytes) -> bytes:
        header = _HEADER.pack(self.ledger_id, entry_id, lac, length)
        return b"".join((header, self._compute(header, data), data))

    def verify(self, payload: bytes, entry_id: int) -> tuple[bytes, int, int]:
        """Check a stored entry; returns (data, lac, length) or raises DigestMismatchError."""
        if len(payload) < HEADER_BYTES + self.size:
            raise DigestMismatchError(f"entry {self.ledger_id}:{entry_id} is truncated ({len(payload)} bytes)")
        ledger_id, eid, lac, length = _HEADER.unpack_from(payload)
        if ledger_id != self.ledger_id or eid != entry_id:
            raise DigestMismatchError(f"entry {self.ledger_id}:{entry_id} came back as {ledger_id}:{eid}")
        view = memoryview(payload)
        data = view[HEADER_BYTES + self.size:]
        expect = self._compute(payload[:HEADER_BYTES], data)
        if not hmac.compare_digest(expect, payload[HEADER_BYTES:HEADER_BYTES + self.size]):
            raise DigestMismatchError(f"entry {self.ledger_id}:{entry_id} failed its {self.digest.value} check")
        return bytes(data), lac, length
