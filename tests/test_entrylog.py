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
    records, index, end = encode_batch(dict(entries), 3, start)
    assert end == start + len(records)
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


def test_encode_batch_of_nothing_is_empty() -> None:
    """An empty checkpoint writes no bytes and indexes nothing."""
    assert encode_batch({}, 1, 8) == (b"", [], 8)
