"""Frames made by the real encoders, shared by the seeds of the frame-decoder targets."""
from __future__ import annotations

from bookkeeper.client.digest import DigestManager, master_key
from bookkeeper.meta.ledger_metadata import DigestType
from bookkeeper.proto import NO_KEY, Flag, Op, Status, encode_request, encode_responses

KEY = master_key(b"fuzz")
LEDGER = 7  # shard_for_ledger(7, 1) == 0: the in-process shard's own ledger


def entry(ledger_id: int, entry_id: int, data: bytes, digest: DigestType = DigestType.CRC32C) -> bytes:
    """A digest-framed entry payload, as a writer sends it (its LAC: the entry before)."""
    return DigestManager(ledger_id, digest, b"fuzz").encode(entry_id, entry_id - 1, (entry_id + 1) * len(data), data)


def add(request_id: int, ledger_id: int, entry_id: int, data: bytes = b"x" * 10, *, key: bytes = KEY,
        flags: int = 0) -> bytes:
    return encode_request(Op.ADD_ENTRY, flags, request_id, ledger_id, entry_id, key, 0,
                          entry(ledger_id, entry_id, data))


def request_seeds() -> list[bytes]:
    """Request buffers: each op alone, runs of adds, a buffer ending in a partial frame."""
    adds = b"".join(add(i + 1, LEDGER, i) for i in range(4))
    return [
        add(1, LEDGER, 0),
        adds,
        adds + add(9, LEDGER, 4)[:30],
        add(1, LEDGER, 0, b"m" * 40, flags=Flag.RECOVERY_ADD) + add(2, LEDGER, 0, key=NO_KEY),
        encode_request(Op.ADD_ENTRY, 0, 1, LEDGER, 0, KEY, 0, entry(LEDGER, 0, b"mac", DigestType.MAC)),
        encode_request(Op.READ_ENTRY, 0, 1, LEDGER, 0, NO_KEY, 0, b""),
        encode_request(Op.READ_ENTRY, Flag.FENCE, 2, LEDGER, -1, KEY, 0, b""),
        encode_request(Op.READ_ENTRY, Flag.LONG_POLL, 3, LEDGER, 5, NO_KEY, 50, b""),
        encode_request(Op.READ_LAC, 0, 4, LEDGER, -1, NO_KEY, 0, b""),
        encode_request(Op.READ_LAC, Flag.FENCE, 5, LEDGER, -1, KEY, 0, b""),
        encode_request(Op.WRITE_LAC, 0, 6, LEDGER, 3, KEY, 0, b""),
        encode_request(Op.GET_BOOKIE_INFO, 0, 7, 0, -1, NO_KEY, 0, b""),
        adds + encode_request(Op.READ_ENTRY, 0, 10, LEDGER, 2, NO_KEY, 0, b""),
    ]


def response_seeds() -> list[bytes]:
    """Response buffers for the requests request_pipe sends (reads 1..8, adds 9 and 10), each
    status shape."""
    payload = entry(LEDGER, 0, b"y" * 20)
    return [
        encode_responses([(Op.ADD_ENTRY, Status.OK, 1, LEDGER, 0, -1, b"")]),
        encode_responses([(Op.ADD_ENTRY, Status.OK, i, LEDGER, i - 1, i - 2, b"") for i in range(1, 5)]),
        encode_responses([(Op.READ_ENTRY, Status.OK, 2, LEDGER, 0, 0, payload)]),
        encode_responses([(Op.READ_ENTRY, Status.NO_SUCH_ENTRY, 3, LEDGER, 9, -1, b"")]),
        encode_responses([(Op.READ_LAC, Status.OK, 4, LEDGER, 3, 3, b"")]),
        encode_responses([(Op.ADD_ENTRY, Status.FENCED, 1, LEDGER, 0, -1, b""),
                          (Op.ADD_ENTRY, Status.UNAUTHORIZED, 2, LEDGER, 1, -1, b"no key")]),
        encode_responses([(Op.ADD_ENTRY, Status.OK, 1, LEDGER, 0, -1, b"")])
        + encode_responses([(Op.READ_ENTRY, Status.OK, 2, LEDGER, 0, 0, payload)])[:50],
        encode_responses([(Op.ADD_ENTRY, Status.OK, 10, LEDGER, 1, 0, b""), (Op.ADD_ENTRY, Status.OK, 9, LEDGER, 0, -1, b"")]),
        encode_responses([(Op.ADD_ENTRY, Status.FENCED, 9, LEDGER, 0, -1, b""),
                          (Op.ADD_ENTRY, Status.OK, 10, LEDGER, 1, -1, b"")]),
    ]
