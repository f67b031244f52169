"""Record sets: how records are packed into one entry (and unpacked), no I/O.

Why sets: an entry costs a journal write and a quorum round trip whatever its size, so
small records ride together (the writer seals a set at `record_set_max_bytes` or
`record_set_max_delay_ms`). Why the header carries `records_before` and `last_txid`:
a recovered segment's record count and last txid come from reading its last entry,
never from scanning the whole ledger.

Layout (big-endian), version 1:
    u8  version (1)
    u8  flags: bits 0-1 codec (0 none, 1 zstd), bit 7 control (a set with no records
        that only carries the writer's LAC forward to tailing readers)
    u32 count            records in this set
    u64 records_before   records in the segment's earlier sets
    i64 last_txid        txid of this set's last record (control: of the segment's last
                         record so far, -1 when none)
    body (compressed as a whole when codec != 0):
        count x (i64 txid, u32 length, payload)

Bounds: a reader takes entries from any writer of the ledger, so nothing a set declares is
trusted before it is checked against what the bytes can hold: a body decompresses to at most
`max_bytes` (a frame's size: no writer seals a bigger set), the size a zstd frame declares is
read and refused before anything is allocated for it, and `count` records need at least
`count` record headers of body.
"""
from __future__ import annotations

import struct
from itertools import chain
from dataclasses import dataclass

import zstandard

from bookkeeper.errors import ProtocolError
from bookkeeper.proto import DEFAULT_MAX_FRAME_BYTES

VERSION = 1
CODEC_NONE = 0
CODEC_ZSTD = 1
FLAG_CONTROL = 0x80
CODECS = {"none": CODEC_NONE, "zstd": CODEC_ZSTD}

_HEADER = struct.Struct(">BBIQq")
_RECORD = struct.Struct(">qI")
HEADER_BYTES = _HEADER.size
RECORD_OVERHEAD = _RECORD.size
# zstd level 1: on 90-byte JSON events 4.9x smaller at ~690 MB/s per core, lz4 2.6x at
# ~1,400 MB/s (docs/streams.md, "Compression"); either is far above the writer's rate.
_ZSTD_C = zstandard.ZstdCompressor(level=1)
_ZSTD_D = zstandard.ZstdDecompressor()


@dataclass(frozen=True, slots=True)
class RecordSet:
    """One decoded entry: its records (txid, payload) and the header fields."""

    records: list[tuple[int, bytes]]
    records_before: int
    last_txid: int
    control: bool


def encode(records: list[tuple[int, bytes]], *, records_before: int, codec: int = CODEC_NONE) -> bytes:
    """Pack (txid, payload) pairs into one entry."""
    txids, datas = zip(*records)
    # (header, payload) pairs joined by C iterators: no Python frame per record
    body = b"".join(chain.from_iterable(zip(map(_RECORD.pack, txids, map(len, datas)), datas)))
    if codec == CODEC_ZSTD:
        body = _ZSTD_C.compress(body)
    return _HEADER.pack(VERSION, codec, len(records), records_before, records[-1][0]) + body


def encode_control(*, records_before: int, last_txid: int) -> bytes:
    """An entry with no records: pushes the LAC so readers see the sets before it."""
    return _HEADER.pack(VERSION, FLAG_CONTROL, 0, records_before, last_txid)


def decode_header(entry: bytes) -> tuple[int, int, int, bool]:
    """(count, records_before, last_txid, control) without touching the body."""
    if len(entry) < HEADER_BYTES:
        raise ProtocolError(f"record set of {len(entry)} bytes is shorter than its header")
    version, flags, count, before, last_txid = _HEADER.unpack_from(entry)
    if version != VERSION:
        raise ProtocolError(f"record set version {version} is not supported (this client reads {VERSION})")
    return count, before, last_txid, bool(flags & FLAG_CONTROL)


def decode(entry: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> RecordSet:
    """Unpack one entry; a malformed one raises ProtocolError, never returns partial records.
    A body that would decompress to more than max_bytes is refused before it is inflated."""
    count, before, last_txid, control = decode_header(entry)
    codec = entry[1] & 0x03
    body = memoryview(entry)[HEADER_BYTES:]
    if codec == CODEC_ZSTD:
        body = memoryview(_inflate(body, max_bytes))
    elif codec != CODEC_NONE:
        raise ProtocolError(f"record set codec {codec} is unknown")
    if count * RECORD_OVERHEAD > len(body):
        raise ProtocolError(f"record set declares {count} records but its {len(body)}-byte body holds at most "
                            f"{len(body) // RECORD_OVERHEAD}")
    records: list[tuple[int, bytes]] = []
    off = 0
    try:
        for _ in range(count):
            txid, n = _RECORD.unpack_from(body, off)
            off += RECORD_OVERHEAD
            if off + n > len(body):
                raise ProtocolError(f"record of {n} bytes overruns its set")
            records.append((txid, bytes(body[off:off + n])))
            off += n
    except struct.error as e:
        raise ProtocolError(f"truncated record set: {e}") from None
    if off != len(body):
        raise ProtocolError(f"{len(body) - off} stray bytes after {count} records")
    return RecordSet(records, before, last_txid, control)


def _inflate(body: memoryview, max_bytes: int) -> bytes:
    """Decompress one zstd frame to at most max_bytes. zstandard allocates the size a frame
    declares and ignores max_output_size when one is declared, so the declaration is checked
    here first; an undeclared size is bounded by max_output_size."""
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise ProtocolError(f"record set is not a zstd frame: {e}") from None
    if declared > max_bytes:
        raise ProtocolError(f"record set declares {declared} bytes decompressed, over the {max_bytes}-byte bound")
    try:
        return _ZSTD_D.decompress(body, max_output_size=max_bytes, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ProtocolError(f"record set does not decompress to at most {max_bytes} bytes: {e}") from None
