"""Entry-log files and the index's view of them, shared by storage and compaction.

Entry log record (big-endian): u32 length | u64 ledger_id | i64 entry_id | data.
Entry log file header: 8 bytes magic 'BKELOG01' (version 1: this layout).
Index key: u64 ledger | u64 entry; value: u32 log | u64 data offset | u32 length.
Log record (LMDB `logs` db, key u32 log id): u64 committed size | (u64 ledger, u64 bytes)*.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

LOG_MAGIC = b"BKELOG01"
_IDX_KEY = struct.Struct(">QQ")  # entry ids stored are >= 0
_IDX_VAL = struct.Struct(">IQI")  # log id, offset of the data, length (records: _ext/entrylog.pyx)
_LOG_KEY = struct.Struct(">I")
_LOG_SIZE = struct.Struct(">Q")
_LOG_PAIR = struct.Struct(">QQ")
_REC_HEAD = struct.Struct(">IQq")


@dataclass(frozen=True, slots=True)
class LogInfo:
    """One entry log's committed size and bytes per ledger (records included).

    Immutable: writers (flush, compaction, under the flush lock) replace a log's info, so
    the loop thread reads a consistent one without a lock.
    """

    path: Path
    size: int
    ledgers: dict[int, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        return _LOG_SIZE.pack(self.size) + b"".join(_LOG_PAIR.pack(l, n) for l, n in self.ledgers.items())

    @staticmethod
    def decode(path: Path, raw: bytes) -> LogInfo:
        size = _LOG_SIZE.unpack_from(raw)[0]
        pairs = _LOG_PAIR.iter_unpack(memoryview(raw)[_LOG_SIZE.size:])
        return LogInfo(path, size, dict(pairs))

    def plus(self, added: dict[int, int], size: int) -> LogInfo:
        merged = dict(self.ledgers)
        for lid, n in added.items():
            merged[lid] = merged.get(lid, 0) + n
        return LogInfo(self.path, size, merged)


def read_records(path: Path, limit: int, *, chunk_bytes: int = 1 << 20) -> Iterable[tuple[int, int, int, bytes]]:
    """(ledger, entry, data offset, data) of every whole record in the first `limit` bytes of an
    entry log, in file order. Past its committed size a log may hold a torn tail or copies no
    index entry took: nothing there is read."""
    with open(path, "rb", buffering=0) as f:
        if f.read(len(LOG_MAGIC)) != LOG_MAGIC:
            raise ValueError(f"{path} is not an entry log (bad magic)")
        buf, base = b"", len(LOG_MAGIC)
        while True:
            more = f.read(max(0, min(chunk_bytes, limit - base - len(buf))))
            buf = buf + more if buf else more
            at = 0
            while len(buf) - at >= _REC_HEAD.size:
                length, lid, eid = _REC_HEAD.unpack_from(buf, at)
                end = at + _REC_HEAD.size + length
                if end > len(buf):
                    break
                yield lid, eid, base + at + _REC_HEAD.size, buf[at + _REC_HEAD.size:end]
                at = end
            base += at
            buf = buf[at:]
            if not more:
                return
