"""Streams without a cluster: roll and retention decisions as decision tables, the record-set
format (round trips, and every truncation and corruption refused), positions.

Reference: DistributedLog's log segment rolling (maxLogSegmentBytes, rolling interval) and
retention (retentionPeriodHours); issue 11; docs/streams.md.
"""
from __future__ import annotations

import itertools
import random
import struct

import pytest
import zstandard

from bookkeeper import errors
from bookkeeper.meta.streams import Segment, check_name
from bookkeeper.stream import Position, policy, recordset
from bookkeeper.stream.policy import RollReason, roll_reason


@pytest.mark.parametrize("records,size,age,max_records,max_bytes,max_age,expected", [
    (0, 0, 0.0, None, None, None, None),
    (0, 10**9, 10**6, 1, 1, 1.0, None),                 # an empty segment never rolls
    (5, 100, 1.0, None, None, None, None),              # no limit set: never
    (9, 100, 1.0, 10, None, None, None),
    (10, 100, 1.0, 10, None, None, RollReason.RECORDS),
    (11, 100, 1.0, 10, None, None, RollReason.RECORDS),
    (1, 999, 1.0, None, 1000, None, None),
    (1, 1000, 1.0, None, 1000, None, RollReason.BYTES),
    (1, 10, 59.9, None, None, 60.0, None),
    (1, 10, 60.0, None, None, 60.0, RollReason.AGE),
    (10, 1000, 60.0, 10, 1000, 60.0, RollReason.RECORDS),  # records are checked first
    (1, 1000, 60.0, 10, 1000, 60.0, RollReason.BYTES),
])
def test_roll_reason_decision_table(records, size, age, max_records, max_bytes, max_age, expected) -> None:
    """A segment rolls at the first limit reached, never while empty, never on a limit that is off."""
    assert roll_reason(records=records, size_bytes=size, age_s=age, max_records=max_records,
                       max_bytes=max_bytes, max_age_s=max_age) is expected


def seg(seq: int, state: str = "closed", size: int = 100, closed_ms: int = 0) -> Segment:
    return Segment(seq=seq, ledger_id=seq, state=state, size_bytes=size, closed_ms=closed_ms)


def test_retention_by_bytes_deletes_the_oldest_prefix_and_keeps_the_newest() -> None:
    """Over retention_max_bytes the oldest closed segments go until the rest fit; the newest never."""
    segs = [seg(1), seg(2), seg(3), seg(4, "open")]
    assert policy.expired(segs, now_ms=0, max_age_s=None, max_bytes=250) == [1, 2]
    assert policy.expired(segs, now_ms=0, max_age_s=None, max_bytes=400) == []
    assert policy.expired(segs, now_ms=0, max_age_s=None, max_bytes=1) == [1, 2, 3]
    assert policy.expired([seg(1), seg(2)], now_ms=0, max_age_s=None, max_bytes=1) == [1]


def test_retention_by_age_uses_the_close_time() -> None:
    """A closed segment expires max_age_s after it closed; younger ones and all later stay."""
    segs = [seg(1, closed_ms=1000), seg(2, closed_ms=5000), seg(3, closed_ms=2000), seg(4, "open")]
    assert policy.expired(segs, now_ms=11_000, max_age_s=10, max_bytes=None) == [1]
    assert policy.expired(segs, now_ms=16_000, max_age_s=10, max_bytes=None) == [1, 2, 3]
    assert policy.expired(segs, now_ms=16_000, max_age_s=None, max_bytes=None) == []


def test_retention_finishes_interrupted_deletions_and_stops_at_an_open_segment() -> None:
    """Truncated leftovers always go; nothing at or after an open segment is expired."""
    segs = [seg(1, "truncated"), seg(2, "open"), seg(3)]
    assert policy.expired(segs, now_ms=10**9, max_age_s=1, max_bytes=1) == [1]


def test_truncate_before_keeps_the_segment_holding_the_position() -> None:
    """truncate(before=pos) takes closed segments below pos's segment only."""
    segs = [seg(1), seg(2, "truncated"), seg(4), seg(5, "open")]
    assert policy.before(segs, 4) == [1, 2]
    assert policy.before(segs, 1) == []
    assert policy.before(segs, 99) == [1, 2, 4]


@pytest.mark.parametrize("codec", [recordset.CODEC_NONE, recordset.CODEC_ZSTD])
def test_record_set_round_trip(codec: int) -> None:
    """Records, header counts and txids come back as written, compressed or not."""
    rng = random.Random(7)
    records = [(1000 + 3 * i, rng.randbytes(rng.randrange(0, 300))) for i in range(50)]
    rs = recordset.decode(recordset.encode(records, records_before=17, codec=codec))
    assert rs.records == records and rs.records_before == 17 and rs.last_txid == records[-1][0] and not rs.control
    assert recordset.decode_header(recordset.encode(records, records_before=17, codec=codec))[:3] == (50, 17, 1147)


def test_control_entry_carries_counts_and_no_records() -> None:
    """A control entry decodes to no records, flagged, with the segment's counts so far."""
    rs = recordset.decode(recordset.encode_control(records_before=9, last_txid=41))
    assert rs.records == [] and rs.control and rs.records_before == 9 and rs.last_txid == 41


@pytest.mark.parametrize("codec", [recordset.CODEC_NONE, recordset.CODEC_ZSTD])
def test_every_truncation_of_a_record_set_is_refused(codec: int) -> None:
    """Cut anywhere, a set raises ProtocolError (never partial records)."""
    entry = recordset.encode([(1, b"abc"), (2, b""), (3, b"xyz" * 10)], records_before=0, codec=codec)
    for cut in range(len(entry)):
        with pytest.raises(errors.ProtocolError):
            recordset.decode(entry[:cut])


def test_stray_bytes_and_unknown_versions_are_refused() -> None:
    """Trailing garbage, a newer version or an unknown codec: ProtocolError naming the problem."""
    entry = recordset.encode([(1, b"abc")], records_before=0)
    with pytest.raises(errors.ProtocolError, match="stray"):
        recordset.decode(entry + b"\0")
    with pytest.raises(errors.ProtocolError, match="version 2"):
        recordset.decode(b"\x02" + entry[1:])
    with pytest.raises(errors.ProtocolError, match="codec"):
        recordset.decode(entry[:1] + b"\x02" + entry[2:])


def _zstd_frame(declared: int, raw: bytes) -> bytes:
    """A zstd frame whose header declares `declared` bytes, holding one raw block of `raw`:
    what a hostile writer can put in a ledger, which zstandard itself never makes."""
    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", declared)  # single segment, 8-byte size
    return header + struct.pack("<I", 1 | len(raw) << 3)[:3] + raw  # last block, raw


def _set(flags: int, count: int, body: bytes) -> bytes:
    return struct.pack(">BBIQq", recordset.VERSION, flags, count, 0, 1) + body


_RECORD_OF_20000 = struct.pack(">qI", 1, 20000) + b"a" * 20000
_UNSIZED = zstandard.ZstdCompressor(write_content_size=False).compress(_RECORD_OF_20000)


@pytest.mark.parametrize("entry, max_bytes, error", [
    # a 1 KiB set declaring 1 TiB: refused from the header, nothing allocated
    (_set(recordset.CODEC_ZSTD, 1, _zstd_frame(1 << 40, b"a" * 1000)), 5 << 20, "declares 1099511627776 bytes"),
    # declared just over the bound
    (_set(recordset.CODEC_ZSTD, 1, zstandard.ZstdCompressor().compress(_RECORD_OF_20000)), 20000, "declares 20012"),
    # no declared size: inflating stops at the bound
    (_set(recordset.CODEC_ZSTD, 1, _UNSIZED), 10000, "at most 10000 bytes"),
    # a declared size the frame does not hold
    (_set(recordset.CODEC_ZSTD, 1, _zstd_frame(4096, b"a" * 100)), 5 << 20, "does not decompress"),
    # not a zstd frame at all
    (_set(recordset.CODEC_ZSTD, 1, b"not zstd"), 5 << 20, "not a zstd frame"),
    # a second frame after the first
    (_set(recordset.CODEC_ZSTD, 1, zstandard.ZstdCompressor().compress(_RECORD_OF_20000) * 2), 5 << 20,
     "does not decompress"),
    # 2**32 - 1 records in a 1 KiB body, compressed or not: refused before any is read
    (_set(recordset.CODEC_NONE, 0xFFFFFFFF, b"z" * 1024), 5 << 20, "declares 4294967295 records"),
    (_set(recordset.CODEC_ZSTD, 0xFFFFFFFF, zstandard.ZstdCompressor().compress(b"z" * 1024)), 5 << 20,
     "declares 4294967295 records"),
])
def test_declared_sizes_are_checked_against_the_bytes(entry: bytes, max_bytes: int, error: str) -> None:
    """What a set declares (its decompressed size, its record count) is checked against the
    bound and the bytes before anything is allocated for it: ProtocolError naming the problem."""
    with pytest.raises(errors.ProtocolError, match=error):
        recordset.decode(entry, max_bytes=max_bytes)


def test_a_set_at_the_bound_decodes() -> None:
    """The bound is inclusive: a body of exactly max_bytes, declared or not, decodes."""
    for body in (zstandard.ZstdCompressor().compress(_RECORD_OF_20000), _UNSIZED):
        rs = recordset.decode(_set(recordset.CODEC_ZSTD, 1, body), max_bytes=len(_RECORD_OF_20000))
        assert rs.records == [(1, b"a" * 20000)]


def test_positions_order_like_a_reader_meets_records() -> None:
    """Segment first, then entry, then slot; str() round-trips through parse."""
    ps = [Position(s, e, k) for s, e, k in itertools.product((1, 2, 10), (0, 1, 11), (0, 2))]
    assert sorted(ps, key=str) != ps and sorted(ps) == ps
    for p in ps:
        assert Position.parse(str(p)) == p
    assert str(Position(3, 17, 0)) == "3:17:0"


@pytest.mark.parametrize("text", ["", "1:2", "1:2:3:4", "a:b:c", "-1:0:0", "1:2:x", "1: 2:3", "¹:2:3"])
def test_bad_position_strings_are_refused_clearly(text: str) -> None:
    """Anything but three non-negative decimal integers is an InvalidPositionError (a ValueError too)."""
    with pytest.raises(errors.InvalidPositionError, match="SEQ:ENTRY:SLOT"):
        Position.parse(text)
    with pytest.raises(ValueError):
        Position.parse(text)


@pytest.mark.parametrize("name", ["", ".", "..", "-x", "a/b", "a b", "x" * 201, "é"])
def test_bad_stream_names_are_refused(name: str) -> None:
    """Names become znodes: only letters, digits, '.', '_', '-', starting with a letter or digit."""
    with pytest.raises(errors.InvalidStreamNameError):
        check_name("stream", name)
