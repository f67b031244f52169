"""Entry-log files and the index's view of them, shared by storage and compaction.

Entry log record (big-endian): u32 length | u64 ledger_id | i64 entry_id | data.
Entry log file header: 8 bytes magic 'BKELOG01' (version 1: this layout).
Index key: u64 ledger | u64 entry; value: u32 log | u64 data offset | u32 length.
Log record (LMDB `logs` db, key u32 log id): u64 committed size | (u64 ledger, u64 bytes)*.
"""
from __future__ import annotations

import itertools
import struct
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from bookkeeper._ext.entrylog import SortedEntries

LOG_MAGIC = b"BKELOG01"
_IDX_KEY = struct.Struct(">QQ")  # entry ids stored are >= 0
_IDX_VAL = struct.Struct(">IQI")  # log id, offset of the data, length (records: _ext/entrylog.pyx)
_LOG_KEY = struct.Struct(">I")
_LOG_SIZE = struct.Struct(">Q")
_LOG_PAIR = struct.Struct(">QQ")
_REC_HEAD = struct.Struct(">IQq")
# Entries gathered, or laid out and indexed, per GIL-held step of a flush or a compaction copy
# (SortedEntries): ~0.5-1 ms each here, what the shard's loop may wait for one (issue 28).
FLUSH_SLICE_ENTRIES = 4096


def sorted_entries(entries: dict[tuple[int, int], bytes], skip: Container[int] | None = None) -> SortedEntries:
    """entries (but the ledgers in skip) gathered a slice at a time and sorted, ready to
    encode: the GIL changes hands between slices (worker threads: flush, compaction)."""
    batch = SortedEntries(entries, skip)
    while not batch.gather(FLUSH_SLICE_ENTRIES):
        pass
    batch.sort()
    return batch


@dataclass(frozen=True, slots=True)
class LogInfo:
    """One entry log's committed size and bytes per ledger (records included), the latter
    as its LMDB record holds them: (u64 ledger, u64 bytes) pairs, 16 bytes a ledger (a dict
    of ints was ~85 bytes a ledger, most of what a stored ledger cost a shard after its state).

    Immutable: writers (flush, compaction, under the flush lock) replace a log's info, so
    the loop thread reads a consistent one without a lock.
    """

    path: Path
    size: int
    pairs: bytes = b""

    @staticmethod
    def of(path: Path, size: int, ledgers: dict[int, int]) -> LogInfo:
        return LogInfo(path, size, _pack_pairs(ledgers))

    @property
    def ledgers(self) -> dict[int, int]:
        """Bytes per ledger."""
        return dict(_LOG_PAIR.iter_unpack(self.pairs))

    def live_bytes(self, held: Container[int]) -> int:
        """The bytes of the ledgers in `held`."""
        return sum(n for lid, n in _LOG_PAIR.iter_unpack(self.pairs) if lid in held)

    def encode(self) -> bytes:
        return _LOG_SIZE.pack(self.size) + self.pairs

    @staticmethod
    def decode(path: Path, raw: bytes) -> LogInfo:
        size = _LOG_SIZE.unpack_from(raw)[0]
        return LogInfo(path, size, bytes(memoryview(raw)[_LOG_SIZE.size:]))

    def plus(self, added: dict[int, int], size: int) -> LogInfo:
        merged = self.ledgers
        for lid, n in added.items():
            merged[lid] = merged.get(lid, 0) + n
        return LogInfo(self.path, size, _pack_pairs(merged))


def _pack_pairs(ledgers: dict[int, int]) -> bytes:
    return struct.pack(f">{2 * len(ledgers)}Q", *itertools.chain.from_iterable(ledgers.items()))


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
