"""recordset.decode (bookkeeper/stream/recordset.py): a stream entry as a reader takes it from
any writer of the ledger.

Properties: decode either returns records or raises ProtocolError; what it returns holds at
most max_bytes of records (a small max_bytes here, so declared sizes over it are refused, not
allocated); re-encoding the records (both codecs) decodes to the same set. Anything else, or
a memory blow-up past libFuzzer's -rss_limit_mb, is a crash.
"""
from __future__ import annotations

from bookkeeper.errors import ProtocolError
from bookkeeper.stream.recordset import (CODEC_NONE, CODEC_ZSTD, RECORD_OVERHEAD, decode, encode,
                                         encode_control)

MAX_BYTES = 1 << 16


def one_input(data: bytes) -> None:
    try:
        rs = decode(data, max_bytes=MAX_BYTES)
    except ProtocolError:
        return
    assert sum(RECORD_OVERHEAD + len(p) for _, p in rs.records) <= MAX_BYTES, "over max_bytes decoded"
    if not rs.records:
        if rs.control:
            pass
        return
    for codec in (CODEC_NONE, CODEC_ZSTD):
        again = decode(encode(rs.records, records_before=rs.records_before, codec=codec), max_bytes=MAX_BYTES)
        assert again.records == rs.records and again.records_before == rs.records_before, f"codec {codec}"


def seeds() -> list[bytes]:
    small = [(i, b"event %d" % i) for i in range(5)]
    return [
        encode(small, records_before=0),
        encode(small, records_before=10, codec=CODEC_ZSTD),
        encode([(7, b"")], records_before=3),
        encode([(i, bytes(40)) for i in range(30)], records_before=100, codec=CODEC_ZSTD),
        encode_control(records_before=5, last_txid=4),
    ]
