"""Frame codec of the bookie wire protocol (bookkeeper.proto, ext/bookkeeper/_ext/wire.pyx).

Pure in-memory tests: no sockets, no ZooKeeper, no bookie processes.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bookkeeper.proto import (
    DEFAULT_MAX_FRAME_BYTES,
    ENTRY_HEADER_BYTES,
    MASTER_KEY_BYTES,
    NO_KEY,
    PROTOCOL_VERSION,
    REQUEST_HEADER_BYTES,
    RESPONSE_HEADER_BYTES,
    FrameError,
    Flag,
    Op,
    Status,
    encode_request,
    encode_responses,
    entry_header,
    parse_requests,
    parse_responses,
    shard_for_ledger,
)

MAX = DEFAULT_MAX_FRAME_BYTES
KEY = bytes(range(1, MASTER_KEY_BYTES + 1))
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


def entry_payload(ledger_id: int, entry_id: int, lac: int, length: int, data: bytes = b"") -> bytes:
    """A digest-framed entry as the client builds it: u64 ledger | i64 entry | i64 lac | u64 length | rest."""
    return struct.pack(">QqqQ", ledger_id, entry_id, lac, length) + data


def sample_requests() -> list[tuple]:
    """(op, flags, request_id, ledger_id, entry_id, master_key, aux, payload) covering edge values."""
    return [
        (Op.ADD_ENTRY, Flag.NONE, 1, 7, 0, KEY, 0, entry_payload(7, 0, -1, 5, b"\x00hello")),
        (Op.ADD_ENTRY, Flag.RECOVERY_ADD, 2, U64_MAX, I64_MAX, KEY, 2**32 - 1,
         entry_payload(U64_MAX, I64_MAX, I64_MAX - 1, U64_MAX, os.urandom(300))),
        (Op.READ_ENTRY, Flag.FENCE | Flag.LONG_POLL, U64_MAX, 0, -1, NO_KEY, 1000, b""),
        (Op.READ_LAC, Flag.FENCE, 3, 42, I64_MIN, KEY, 0, b"x"),
        (Op.GET_BOOKIE_INFO, 0xFFFF, 4, 1, 2, NO_KEY, 7, b"\xff" * 31),
    ]


def sample_responses() -> list[tuple]:
    """(op, status, request_id, ledger_id, entry_id, lac, payload) covering edge values."""
    return [
        (Op.ADD_ENTRY, Status.OK, 1, 7, 0, -1, b""),
        (Op.READ_ENTRY, Status.OK, U64_MAX, U64_MAX, I64_MAX, I64_MIN, entry_payload(9, 3, 2, 10, b"abc")),
        (Op.READ_ENTRY, Status.NO_SUCH_ENTRY, 2, 3, -1, -1, b""),
        (Op.READ_LAC, Status.FENCED, 5, 6, 7, 8, b"\x00" * 17),
        (Op.GET_BOOKIE_INFO, 0xFFFF, 0, 0, 0, 0, os.urandom(1000)),
    ]


def expected_request(r: tuple) -> tuple:
    """The parsed tuple for request r, with blob_lac derived from the payload per the spec."""
    op, flags, rid, lid, eid, key, aux, payload = r
    blob_lac = struct.unpack_from(">q", payload, 16)[0] if len(payload) >= ENTRY_HEADER_BYTES else -1
    return (int(op), int(flags), rid, lid, eid, key, aux, payload, blob_lac)


def expected_response(r: tuple) -> tuple:
    op, status, rid, lid, eid, lac, payload = r
    return (int(op), int(status), rid, lid, eid, lac, payload)


def frame_of(body_len: int, version: int = PROTOCOL_VERSION, total: int | None = None) -> bytes:
    """Raw bytes: u32 length=body_len, version byte, then zero padding up to `total` bytes."""
    head = struct.pack(">IB", body_len, version)
    size = body_len + 4 if total is None else total
    return head + bytes(max(0, size - len(head)))


# -- constants -------------------------------------------------------------------


def test_header_sizes_match_documented_layout() -> None:
    """Header sizes follow the layout in wire.pyx: request 56 B, response 40 B, key 20 B, entry header 32 B."""
    assert REQUEST_HEADER_BYTES == 4 + 1 + 1 + 2 + 8 + 8 + 8 + 20 + 4 == 56
    assert RESPONSE_HEADER_BYTES == 4 + 1 + 1 + 2 + 8 + 8 + 8 + 8 == 40
    assert MASTER_KEY_BYTES == 20 and NO_KEY == bytes(20)
    assert ENTRY_HEADER_BYTES == 32
    assert PROTOCOL_VERSION == 1
    assert DEFAULT_MAX_FRAME_BYTES == 5 * 1024 * 1024


# -- request round trips ------------------------------------------------------------


@pytest.mark.parametrize("req", sample_requests(), ids=lambda r: f"{Op(r[0]).name}-{len(r[7])}B")
def test_request_round_trip_preserves_every_field(req: tuple) -> None:
    """encode_request then parse_requests returns every field unchanged (protocol.md request layout)."""
    frame = encode_request(*req)
    assert len(frame) == REQUEST_HEADER_BYTES + len(req[7])
    frames, consumed = parse_requests(frame, MAX)
    assert consumed == len(frame)
    assert frames == [expected_request(req)]


def test_request_byte_layout_is_big_endian_as_documented() -> None:
    """The request header is u32 len | u8 ver | u8 op | u16 flags | u64 rid | u64 lid | i64 eid | key | u32 aux, big-endian."""
    frame = encode_request(Op.READ_ENTRY, Flag.FENCE, 0x0102030405060708, 0x1112131415161718, -2, KEY,
                           0xA1B2C3D4, b"PAY")
    length, ver, op, flags, rid, lid, eid = struct.unpack_from(">IBBHQQq", frame, 0)
    assert length == len(frame) - 4
    assert (ver, op, flags) == (1, Op.READ_ENTRY, Flag.FENCE)
    assert (rid, lid, eid) == (0x0102030405060708, 0x1112131415161718, -2)
    assert frame[32:52] == KEY
    assert struct.unpack_from(">I", frame, 52)[0] == 0xA1B2C3D4
    assert frame[56:] == b"PAY"


def test_request_accepts_bytearray_and_memoryview_payload_and_buffer() -> None:
    """Payloads and receive buffers may be any contiguous byte buffer (bytes, bytearray, memoryview)."""
    payload = entry_payload(1, 2, 3, 4, b"data")
    f1 = encode_request(Op.ADD_ENTRY, 0, 9, 1, 2, KEY, 0, bytearray(payload))
    f2 = encode_request(Op.ADD_ENTRY, 0, 9, 1, 2, KEY, 0, memoryview(payload))
    assert f1 == f2 == encode_request(Op.ADD_ENTRY, 0, 9, 1, 2, KEY, 0, payload)
    for buf in (bytearray(f1), memoryview(f1)):
        frames, consumed = parse_requests(buf, MAX)
        assert consumed == len(f1)
        assert frames[0][7] == payload and frames[0][8] == 3


@pytest.mark.parametrize("key", [b"", b"short", bytes(19), bytes(21)])
def test_encode_request_rejects_master_key_not_20_bytes(key: bytes) -> None:
    """master_key must be exactly 20 bytes (encode_request contract)."""
    with pytest.raises(ValueError):
        encode_request(Op.ADD_ENTRY, 0, 1, 1, 0, key, 0, b"")


# -- response round trips -----------------------------------------------------------


def test_response_batch_round_trip_preserves_every_field() -> None:
    """encode_responses of a batch then parse_responses returns every response unchanged, in order."""
    responses = sample_responses()
    buf = encode_responses(responses)
    assert len(buf) == sum(RESPONSE_HEADER_BYTES + len(r[6]) for r in responses)
    frames, consumed = parse_responses(buf, MAX)
    assert consumed == len(buf)
    assert frames == [expected_response(r) for r in responses]


@pytest.mark.parametrize("resp", sample_responses(), ids=lambda r: f"{Op(r[0]).name}-{r[1]}")
def test_single_response_round_trip(resp: tuple) -> None:
    """One response encoded alone parses back to itself (protocol.md response layout)."""
    buf = encode_responses([resp])
    frames, consumed = parse_responses(buf, MAX)
    assert (frames, consumed) == ([expected_response(resp)], len(buf))


def test_response_byte_layout_is_big_endian_as_documented() -> None:
    """The response header is u32 len | u8 ver | u8 op | u16 status | u64 rid | u64 lid | i64 eid | i64 lac."""
    buf = encode_responses([(Op.READ_LAC, Status.TIMEOUT, 0x0102030405060708, 5, -1, -7, b"zz")])
    assert struct.unpack_from(">IBBHQQqq", buf, 0) == (
        len(buf) - 4, 1, Op.READ_LAC, Status.TIMEOUT, 0x0102030405060708, 5, -1, -7)
    assert buf[40:] == b"zz"


@pytest.mark.parametrize("wrap", [bytearray, memoryview], ids=["bytearray", "memoryview"])
def test_encode_responses_non_bytes_payload_is_encoded_faithfully_or_refused(wrap: type) -> None:
    """A payload that is not bytes is either encoded with its own bytes or refused (TypeError), never garbage."""
    data = b"hello world, this is the payload"
    try:
        buf = encode_responses([(Op.READ_ENTRY, Status.OK, 1, 2, 3, 4, wrap(data))])
    except TypeError:
        return
    frames, consumed = parse_responses(buf, MAX)
    assert consumed == len(buf)
    assert frames[0][6] == data


def test_encode_empty_response_batch_is_empty() -> None:
    """An empty batch encodes to no bytes, and an empty buffer parses to no frames with consumed 0."""
    assert encode_responses([]) == b""
    assert parse_responses(b"", MAX) == ([], 0)
    assert parse_requests(b"", MAX) == ([], 0)


# -- many frames per call ----------------------------------------------------------


def test_many_request_frames_in_one_buffer_parse_in_one_call() -> None:
    """A receive buffer holding many frames is parsed in one call (hot loop handles many frames per call)."""
    reqs = [(Op.ADD_ENTRY, 0, i, i % 7, i, KEY, i, entry_payload(i % 7, i, i - 1, i * 10, os.urandom(i % 50)))
            for i in range(500)]
    buf = b"".join(encode_request(*r) for r in reqs)
    frames, consumed = parse_requests(buf, MAX)
    assert consumed == len(buf)
    assert frames == [expected_request(r) for r in reqs]


def test_many_response_frames_in_one_buffer_parse_in_one_call() -> None:
    """All responses of a batch, encoded into one buffer, are parsed back in one call."""
    resps = [(Op.ADD_ENTRY, i % 11, i, 3, i, i - 1, os.urandom(i % 40)) for i in range(500)]
    buf = encode_responses(resps)
    frames, consumed = parse_responses(buf, MAX)
    assert consumed == len(buf)
    assert frames == [expected_response(r) for r in resps]


# -- partial buffers ------------------------------------------------------------------


def _boundaries(frames: list[bytes]) -> list[int]:
    ends, pos = [0], 0
    for f in frames:
        pos += len(f)
        ends.append(pos)
    return ends


def test_request_buffer_cut_at_every_offset_yields_only_complete_frames() -> None:
    """A buffer cut at any byte yields exactly the frames wholly inside it, and consumed is their total size."""
    reqs = sample_requests()
    encoded = [encode_request(*r) for r in reqs]
    buf = b"".join(encoded)
    ends = _boundaries(encoded)
    expected = [expected_request(r) for r in reqs]
    for cut in range(len(buf) + 1):
        frames, consumed = parse_requests(buf[:cut], MAX)
        n = max(i for i, e in enumerate(ends) if e <= cut)
        assert consumed == ends[n], cut
        assert frames == expected[:n], cut
        # the caller keeps the rest and parses it when more bytes arrive
        rest, rest_consumed = parse_requests(buf[consumed:], MAX)
        assert frames + rest == expected and consumed + rest_consumed == len(buf), cut


def test_response_buffer_cut_at_every_offset_yields_only_complete_frames() -> None:
    """A response buffer cut at any byte yields only complete frames and the exact consumed count."""
    resps = sample_responses()
    encoded = [encode_responses([r]) for r in resps]
    buf = b"".join(encoded)
    assert buf == encode_responses(resps)
    ends = _boundaries(encoded)
    expected = [expected_response(r) for r in resps]
    for cut in range(len(buf) + 1):
        frames, consumed = parse_responses(buf[:cut], MAX)
        n = max(i for i, e in enumerate(ends) if e <= cut)
        assert consumed == ends[n], cut
        assert frames == expected[:n], cut


def test_byte_at_a_time_stream_reassembles_all_requests() -> None:
    """Feeding a stream one byte at a time and keeping the unconsumed tail reassembles every frame once."""
    reqs = sample_requests()
    stream = b"".join(encode_request(*r) for r in reqs)
    pending = bytearray()
    got: list[tuple] = []
    for b in stream:
        pending.append(b)
        frames, consumed = parse_requests(bytes(pending), MAX)
        got.extend(frames)
        del pending[:consumed]
    assert got == [expected_request(r) for r in reqs]
    assert not pending


# -- invalid frames ---------------------------------------------------------------


def test_request_frame_over_max_frame_raises() -> None:
    """A frame longer than max_frame raises FrameError (it can never be valid: close the connection)."""
    frame = encode_request(Op.ADD_ENTRY, 0, 1, 1, 0, KEY, 0, bytes(1000))
    assert parse_requests(frame, len(frame))[1] == len(frame)  # exactly the limit is allowed
    with pytest.raises(FrameError):
        parse_requests(frame, len(frame) - 1)


def test_response_frame_over_max_frame_raises() -> None:
    """A response longer than max_frame raises FrameError."""
    buf = encode_responses([(Op.READ_ENTRY, 0, 1, 1, 0, 0, bytes(1000))])
    assert parse_responses(buf, len(buf))[1] == len(buf)
    with pytest.raises(FrameError):
        parse_responses(buf, len(buf) - 1)


def test_oversized_frame_is_refused_from_its_length_prefix_alone() -> None:
    """An over-limit length is refused as soon as its 4-byte prefix arrives, before buffering the body."""
    prefix = struct.pack(">I", MAX)  # MAX + 4 bytes in all: one over the limit
    with pytest.raises(FrameError):
        parse_requests(prefix, MAX)
    with pytest.raises(FrameError):
        parse_responses(prefix, MAX)
    with pytest.raises(FrameError):
        parse_requests(struct.pack(">I", 0xFFFFFFFF), MAX)


def test_oversized_frame_after_valid_frames_raises() -> None:
    """A never-valid frame anywhere in the buffer raises FrameError, even after good frames."""
    good = encode_request(Op.READ_LAC, 0, 1, 1, 0, KEY, 0, b"")
    with pytest.raises(FrameError):
        parse_requests(good + struct.pack(">I", 1 << 30), MAX)


@pytest.mark.parametrize("total", [4, 5, 20, REQUEST_HEADER_BYTES - 1])
def test_request_length_shorter_than_header_raises(total: int) -> None:
    """A request whose length is less than the 56-byte header raises FrameError."""
    with pytest.raises(FrameError):
        parse_requests(frame_of(total - 4), MAX)


@pytest.mark.parametrize("total", [4, 5, 20, RESPONSE_HEADER_BYTES - 1])
def test_response_length_shorter_than_header_raises(total: int) -> None:
    """A response whose length is less than the 40-byte header raises FrameError."""
    with pytest.raises(FrameError):
        parse_responses(frame_of(total - 4), MAX)


def test_response_sized_frame_is_too_short_for_a_request() -> None:
    """A 40-byte frame is a valid response size but shorter than a request header: FrameError for requests."""
    raw = frame_of(RESPONSE_HEADER_BYTES - 4)
    frames, consumed = parse_responses(raw, MAX)
    assert consumed == RESPONSE_HEADER_BYTES and len(frames) == 1
    with pytest.raises(FrameError):
        parse_requests(raw, MAX)


def test_short_length_is_refused_from_its_length_prefix_alone() -> None:
    """A length under the header size is refused as soon as the 4-byte prefix is seen."""
    with pytest.raises(FrameError):
        parse_requests(struct.pack(">I", 0), MAX)
    with pytest.raises(FrameError):
        parse_responses(struct.pack(">I", 10), MAX)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_request_wrong_version_byte_raises(version: int) -> None:
    """A request whose version byte is not 1 raises FrameError (unsupported protocol version)."""
    frame = bytearray(encode_request(Op.ADD_ENTRY, 0, 1, 1, 0, KEY, 0, b"abc"))
    frame[4] = version
    with pytest.raises(FrameError):
        parse_requests(bytes(frame), MAX)
    with pytest.raises(FrameError):  # known as soon as the version byte arrives
        parse_requests(bytes(frame[:5]), MAX)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_response_wrong_version_byte_raises(version: int) -> None:
    """A response whose version byte is not 1 raises FrameError."""
    buf = bytearray(encode_responses([(Op.ADD_ENTRY, 0, 1, 1, 0, 0, b"abc")]))
    buf[4] = version
    with pytest.raises(FrameError):
        parse_responses(bytes(buf), MAX)


def test_wrong_version_after_valid_frame_raises() -> None:
    """A frame with a bad version following a good one still raises FrameError."""
    good = encode_request(Op.READ_LAC, 0, 1, 1, 0, KEY, 0, b"")
    bad = bytearray(good)
    bad[4] = 9
    with pytest.raises(FrameError):
        parse_requests(good + bytes(bad), MAX)


def test_frame_error_is_a_value_error() -> None:
    """FrameError is a ValueError, so generic input-validation handlers catch it."""
    assert issubclass(FrameError, ValueError)


# -- blob_lac and entry_header ----------------------------------------------------------


@pytest.mark.parametrize("lac", [-1, 0, 1, 12345, I64_MAX])
def test_blob_lac_is_extracted_from_entry_payload(lac: int) -> None:
    """parse_requests reports the LAC piggybacked at bytes 16..24 of an entry payload as blob_lac."""
    payload = entry_payload(77, lac + 1 if lac < I64_MAX else lac, lac, 99, b"\xab\xcd" * 10)
    frames, _ = parse_requests(encode_request(Op.ADD_ENTRY, 0, 1, 77, 0, KEY, 0, payload), MAX)
    assert frames[0][8] == lac


def test_blob_lac_matches_client_digest_encoding() -> None:
    """The client's digest-framed entry (DigestManager.encode) carries the LAC where the codec reads it."""
    from bookkeeper.client.digest import DigestManager
    from bookkeeper.meta.ledger_metadata import DigestType

    for dt in DigestType:
        payload = DigestManager(5, dt, b"pw").encode(8, 6, 1234, b"entry-data")
        frames, _ = parse_requests(encode_request(Op.ADD_ENTRY, 0, 1, 5, 8, KEY, 0, payload), MAX)
        assert frames[0][8] == 6
        assert entry_header(payload) == (5, 8, 6, 1234)


@pytest.mark.parametrize("plen", [0, 1, 16, 24, 31])
def test_blob_lac_is_minus_one_for_payload_shorter_than_entry_header(plen: int) -> None:
    """blob_lac is -1 when the payload is too short (< 32 bytes) to carry an entry header."""
    frames, _ = parse_requests(encode_request(Op.ADD_ENTRY, 0, 1, 1, 0, KEY, 0, b"\x07" * plen), MAX)
    assert frames[0][8] == -1


def test_entry_header_decodes_ledger_entry_lac_length() -> None:
    """entry_header returns (ledger_id, entry_id, lac, length) from a digest-framed entry payload."""
    assert entry_header(entry_payload(1, 2, 3, 4)) == (1, 2, 3, 4)
    assert entry_header(entry_payload(U64_MAX, -1, I64_MIN, U64_MAX, b"tail")) == (U64_MAX, -1, I64_MIN, U64_MAX)
    assert entry_header(bytearray(entry_payload(9, 8, 7, 6, b"x" * 100))) == (9, 8, 7, 6)


@pytest.mark.parametrize("plen", [0, 1, 31])
def test_entry_header_rejects_payload_shorter_than_32_bytes(plen: int) -> None:
    """entry_header raises FrameError when the payload is shorter than its 32-byte header."""
    with pytest.raises(FrameError):
        entry_header(bytes(plen))


# -- shard_for_ledger ------------------------------------------------------------------


@pytest.mark.parametrize("shards", [2, 3])
def test_shard_for_ledger_spreads_sequential_ids_evenly(shards: int) -> None:
    """10,000 sequential ledger ids land within 10% of an even split over the shards (DESIGN: hash % shards)."""
    counts = Counter(shard_for_ledger(lid, shards) for lid in range(10_000))
    even = 10_000 / shards
    assert set(counts) == set(range(shards))
    for shard, n in counts.items():
        assert abs(n - even) <= 0.10 * even, (shard, n, even)


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_shard_for_ledger_spreads_ids_with_common_low_bits(shards: int) -> None:
    """Ids sharing their low bits (multiples of 1024) still spread within 10% of even."""
    counts = Counter(shard_for_ledger(lid << 10, shards) for lid in range(10_000))
    even = 10_000 / shards
    assert all(abs(counts[s] - even) <= 0.10 * even for s in range(shards)), counts


def test_shard_for_ledger_in_range_and_single_shard_is_zero() -> None:
    """The shard is always in 0..shards-1; with one shard every ledger is on shard 0."""
    for lid in (0, 1, 2**32, 2**63, U64_MAX):
        assert shard_for_ledger(lid, 1) == 0
        for shards in range(1, 9):
            assert 0 <= shard_for_ledger(lid, shards) < shards


def test_shard_for_ledger_is_stable_across_calls_and_processes() -> None:
    """shard_for_ledger is a pure function: same answer every call and in another process (client and bookie agree)."""
    ids = list(range(0, 10_000, 37)) + [2**40 + 5, U64_MAX]
    here = [(shard_for_ledger(i, 2), shard_for_ledger(i, 3)) for i in ids]
    assert here == [(shard_for_ledger(i, 2), shard_for_ledger(i, 3)) for i in ids]
    code = ("import sys, json; from bookkeeper.proto import shard_for_ledger as f; "
            "ids = json.loads(sys.stdin.read()); print(json.dumps([[f(i, 2), f(i, 3)] for i in ids]))")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    import json
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(ids), capture_output=True,
                         text=True, env=env, check=True, cwd=root).stdout
    assert [tuple(x) for x in json.loads(out)] == here


def test_shard_for_ledger_known_values() -> None:
    """The hash is the documented Fibonacci hash: ((id * 0x9E3779B97F4A7C15) mod 2**64) >> 32, mod shards."""
    for lid in (0, 1, 2, 3, 1000, 2**63 + 11):
        h = ((lid * 0x9E3779B97F4A7C15) % 2**64) >> 32
        assert shard_for_ledger(lid, 3) == h % 3
        assert shard_for_ledger(lid, 2) == h % 2


def test_frame_error_carries_the_valid_frames_before_it() -> None:
    """The requests that precede a bad frame in one buffer are handed over with the error, so a
    shard answers them before it closes the connection (invariant 4: bad input costs only itself)."""
    from bookkeeper.proto import NO_KEY, FrameError, encode_request, parse_requests

    good = [encode_request(2, 0, rid, 1, rid, NO_KEY, 0, b"") for rid in (1, 2)]
    with pytest.raises(FrameError) as info:
        parse_requests(b"".join(good) + b"GET / HTTP/1.1\r\n\r\n" + bytes(64), 1 << 20)
    assert [f[2] for f in info.value.frames] == [1, 2]
