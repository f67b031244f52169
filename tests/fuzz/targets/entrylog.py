"""Entry-log records (bookkeeper/bookie/storage/entrylog.py read_records, which compaction and
recovery read entry logs with; the records laid out by SortedEntries (sorted_entries) in
ext/bookkeeper/_ext/entrylog.pyx): a log's bytes after a crash or on a damaged disk.

Input: the log's bytes after its magic, up to its committed size. Properties: every record
read lies within the committed size and re-encodes (SortedEntries.encode) to exactly the bytes read,
with the index pointing at its data; reading in chunks of any size reads the same records.
Anything else is a crash.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from bookkeeper._ext.entrylog import RECORD_HEADER_BYTES
from bookkeeper.bookie.storage.entrylog import _IDX_VAL, LOG_MAGIC, read_records, sorted_entries

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-entrylog-"))
_LOG = _DIR / "0.log"
atexit.register(shutil.rmtree, _DIR, True)


def _encode(entries: dict[tuple[int, int], bytes], pos: int) -> tuple[bytes, list[tuple[bytes, bytes]], int]:
    """entries laid out as one chunk of records from log offset pos (log 1)."""
    batch = sorted_entries(entries)
    if not batch.remaining:
        return b"", [], pos
    out, index, end, _per = batch.encode(1, pos, 1 << 30, 1 << 30)
    return out, index, end


def one_input(data: bytes) -> None:
    _LOG.write_bytes(LOG_MAGIC + data)
    limit = len(LOG_MAGIC) + len(data)
    try:
        records = list(read_records(_LOG, limit))
        chunk = 16 + (data[0] if data else 0)
        assert list(read_records(_LOG, limit, chunk_bytes=chunk)) == records, f"chunks of {chunk} read differently"
    finally:
        _LOG.unlink()
    at = len(LOG_MAGIC)
    for lid, eid, offset, payload in records:
        assert offset == at + RECORD_HEADER_BYTES and offset + len(payload) <= limit, f"record at {offset}"
        if eid < 0:  # the index keys entry ids >= 0: compaction never copies such a record
            return
        out, index, end = _encode({(lid, eid): payload}, at)
        assert out == data[at - len(LOG_MAGIC):end - len(LOG_MAGIC)], f"record at {at} re-encodes differently"
        assert _IDX_VAL.unpack(index[0][1]) == (1, offset, len(payload))
        at = end


def seeds() -> list[bytes]:
    keys = [(7, e) for e in range(6)] + [(9, 0)]
    entries = {k: b"entry %d:%d " % k * (1 + k[1]) for k in keys}
    out, _, _ = _encode(entries, len(LOG_MAGIC))
    one, _, _ = _encode({(7, 0): b""}, len(LOG_MAGIC))
    return [out, one, out[:-5], out + bytes(12)]
