"""Entry-log batch encoding of a checkpoint (ext/bookkeeper/_ext/entrylog.pyx), checked against
the layout ledger_storage.py reads back: record u32 length | u64 ledger | i64 entry | data, index
key u64 ledger | u64 entry, index value u32 log | u64 data offset | u32 length."""
from __future__ import annotations

import random
import struct

from bookkeeper._ext.entrylog import RECORD_HEADER_BYTES, encode_batch
from bookkeeper.bookie.storage.ledger_storage import _IDX_KEY, _IDX_VAL


def test_encode_batch_lays_out_records_and_index_in_ledger_then_entry_order() -> None:
    """Records come sorted by (ledger, entry) from the given offset; each index value points at its data."""
    rng = random.Random(7)
    entries = {(lid, eid): rng.randbytes(rng.randrange(0, 300)) for lid in (9, 2, 5) for eid in rng.sample(range(50), 20)}
    start = 4096
    records, index, end, nxt = encode_batch(sorted(entries), 0, entries, 3, start, 1 << 30)
    assert end == start + len(records) and nxt == len(entries)
    assert len(index) == len(entries)
    keys = [(_IDX_KEY.unpack(k)) for k, _ in index]
    assert keys == sorted(entries)
    at = 0
    for (k, v), key in zip(index, sorted(entries)):
        log_id, offset, length = _IDX_VAL.unpack(v)
        data = entries[key]
        assert (log_id, length) == (3, len(data))
        assert struct.unpack_from(">IQq", records, at) == (len(data), key[0], key[1])
        assert offset == start + at + RECORD_HEADER_BYTES
        assert records[offset - start:offset - start + length] == data
        at += RECORD_HEADER_BYTES + len(data)
    assert at == len(records)


def test_encode_batch_stops_near_max_bytes_and_continues_where_it_stopped() -> None:
    """Chunks of about max_bytes (at least one record each) cover every entry once, in order, at
    consecutive offsets: what a checkpoint writes chunk by chunk is what one call would write."""
    entries = {(1, e): bytes([e % 256]) * 1000 for e in range(50)}
    keys = sorted(entries)
    whole, whole_index, whole_end, _ = encode_batch(keys, 0, entries, 2, 100, 1 << 30)
    chunks, index, pos, start, calls = [], [], 100, 0, 0
    while start < len(keys):
        records, idx, pos, nxt = encode_batch(keys, start, entries, 2, pos, 4096)
        assert nxt - start == 5  # 1020-byte records: the fifth crosses 4096 bytes
        chunks.append(records)
        index += idx
        start, calls = nxt, calls + 1
    assert b"".join(chunks) == whole and index == whole_index and pos == whole_end and calls == 10
    assert encode_batch(keys, 0, entries, 2, 0, 1)[3] == 1  # always at least one record


def test_encode_batch_of_nothing_is_empty() -> None:
    """An empty checkpoint writes no bytes and indexes nothing."""
    assert encode_batch([], 0, {}, 1, 8, 1 << 20) == (b"", [], 8, 0)
