"""Entry-log batch encoding of a checkpoint (ext/bookkeeper/_ext/entrylog.pyx: SortedEntries),
checked against the layout ledger_storage.py reads back: record u32 length | u64 ledger | i64
entry | data, index key u64 ledger | u64 entry, index value u32 log | u64 data offset | u32 length."""
from __future__ import annotations

import random
import struct
import sys

import pytest

from bookkeeper._ext.entrylog import RECORD_HEADER_BYTES, SortedEntries
from bookkeeper.bookie.storage.ledger_storage import _IDX_KEY, _IDX_VAL


def _sorted(entries: dict[tuple[int, int], bytes], skip: set[int] | None = None, slice_n: int = 1 << 30) -> SortedEntries:
    batch = SortedEntries(entries, skip)
    while not batch.gather(slice_n):
        pass
    batch.sort()
    return batch


def test_encode_lays_out_records_and_index_in_ledger_then_entry_order() -> None:
    """Records come sorted by (ledger, entry) from the given offset; each index value points at
    its data; the per-ledger bytes are the records laid out of each ledger."""
    rng = random.Random(7)
    entries = {(lid, eid): rng.randbytes(rng.randrange(0, 300)) for lid in (9, 2, 5) for eid in rng.sample(range(50), 20)}
    start = 4096
    batch = _sorted(entries, slice_n=7)  # gathered 7 at a time: the slices cover the dict once
    assert batch.remaining == len(entries)
    records, index, end, per = batch.encode(3, start, 1 << 30, 1 << 30)
    assert end == start + len(records) and batch.remaining == 0
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
    assert per == {lid: sum(len(d) + RECORD_HEADER_BYTES for (l, _), d in entries.items() if l == lid) for lid in (9, 2, 5)}


def test_encode_stops_near_max_bytes_or_max_entries_and_continues_where_it_stopped() -> None:
    """Chunks of about max_bytes, or max_entries (at least one record each), cover every entry
    once, in order, at consecutive offsets: what a checkpoint writes chunk by chunk is what one
    call would write."""
    entries = {(1, e): bytes([e % 256]) * 1000 for e in range(50)}
    whole, whole_index, whole_end, _ = _sorted(entries).encode(2, 100, 1 << 30, 1 << 30)
    for max_bytes, max_entries, per_call in ((4096, 1 << 30, 5), (1 << 30, 3, 3)):
        batch = _sorted(entries)
        chunks, index, pos, calls = [], [], 100, 0
        while batch.remaining:
            left = batch.remaining
            records, idx, pos, per = batch.encode(2, pos, max_bytes, max_entries)
            assert left - batch.remaining == min(per_call, left)  # 1020-byte records: the fifth crosses 4096 bytes
            assert per == {1: len(records)}
            chunks.append(records)
            index += idx
            calls += 1
        assert b"".join(chunks) == whole and index == whole_index and pos == whole_end and calls == -(-50 // per_call)
    one = _sorted(entries)
    one.encode(2, 0, 1, 1 << 30)
    assert one.remaining == 49  # always at least one record


def test_skipped_ledgers_are_left_out_and_references_are_dropped_once_laid_out() -> None:
    """A dropped ledger's entries are not gathered; an entry laid out holds no extra reference
    (a full cache's payloads are freed with the dict, not kept by the batch)."""
    payload = bytes(range(200)) + b"unique-to-this-test"
    entries = {(1, 0): payload, (2, 0): b"x", (2, 1): b"y", (3, 5): b"z"}
    base = sys.getrefcount(payload)
    batch = SortedEntries(entries, {2})
    assert batch.gather(100)
    assert sys.getrefcount(payload) == base + 1
    batch.sort()
    _records, index, _end, per = batch.encode(1, 0, 1 << 30, 1 << 30)
    assert [_IDX_KEY.unpack(k) for k, _ in index] == [(1, 0), (3, 5)] and set(per) == {1, 3}
    assert sys.getrefcount(payload) == base


def test_misuse_is_refused() -> None:
    """Sorting before every entry was gathered, encoding before sorting, or a dict that changed
    between gather slices are errors, not a partial checkpoint."""
    entries = {(1, e): b"d" for e in range(10)}
    batch = SortedEntries(entries)
    with pytest.raises(RuntimeError, match="encode before sort"):
        batch.encode(1, 0, 1 << 20, 10)
    assert not batch.gather(3)
    with pytest.raises(RuntimeError, match="sort before"):
        batch.sort()
    entries[(2, 0)] = b"new"
    with pytest.raises(RuntimeError, match="changed"):
        batch.gather(3)


def test_nothing_to_encode_is_empty() -> None:
    """An empty checkpoint gathers nothing and has nothing to lay out."""
    batch = _sorted({})
    assert batch.remaining == 0


def test_arguments_that_would_spin_a_flush_are_refused() -> None:
    """A non-positive gather limit or max_entries would make no progress (a caller's loop
    would spin): refused."""
    batch = SortedEntries({(1, 0): b"x"})
    with pytest.raises(ValueError, match="positive limit"):
        batch.gather(0)
    assert batch.gather(1) is False and batch.gather(1) is True
    batch.sort()
    with pytest.raises(ValueError, match="positive max_entries"):
        batch.encode(1, 0, 1 << 20, 0)
    assert batch.remaining == 1
