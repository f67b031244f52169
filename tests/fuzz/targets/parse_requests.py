"""parse_requests (ext/bookkeeper/_ext/wire.pyx), the bookie's frame decoder, and encode_request.

Properties: any bytes either parse into frames that encode_request turns back into exactly
the bytes consumed (and the rest is one incomplete frame), or raise FrameError carrying the
valid frames before the bad one; the same bytes split anywhere across two receive buffers
parse into the same frames; an entry payload's piggybacked LAC is read from its bytes.
Anything else (another exception, a wrong round trip, an over-read under ASan) is a crash.
"""
from __future__ import annotations

from bookkeeper.proto import (ENTRY_HEADER_BYTES, REQUEST_HEADER_BYTES, Flag, FrameError, Op, encode_request,
                              parse_requests)

from ._frames import request_seeds

MAX_FRAME = 1 << 16  # small, so short inputs reach the over-the-limit refusal too


def _stream(chunks: list[bytes]) -> tuple[list[tuple], bool]:
    """Frames of chunks arriving one receive buffer at a time (the server's way), and whether
    a bad frame ended them."""
    held, frames = b"", []
    for chunk in chunks:
        held += chunk
        try:
            got, used = parse_requests(held, MAX_FRAME)
        except FrameError as e:
            return frames + e.frames, True
        frames += got
        held = held[used:]
    return frames, False


def _check_frame(frame: tuple) -> None:
    payload, blob_lac = frame[7], frame[8]
    expected = int.from_bytes(payload[16:24], "big", signed=True) if len(payload) >= 32 else -1
    assert blob_lac == expected, f"blob_lac {blob_lac} != {expected} read from the payload"


def _feedback(frames: list[tuple], error: FrameError | None) -> None:
    """Branches on what the buffer held, for atheris's coverage feedback: the C decoder is
    not instrumented in the normal build, and without them every input would look alike
    (and the seeds be dropped as adding nothing)."""
    for op, flags, _, _, entry_id, _, _, payload, blob_lac in frames:
        if op == Op.ADD_ENTRY:
            if len(payload) >= ENTRY_HEADER_BYTES:
                if blob_lac >= 0:
                    pass
            elif flags & Flag.RECOVERY_ADD:
                pass
        elif op == Op.READ_ENTRY:
            if flags & Flag.FENCE:
                pass
            elif flags & Flag.LONG_POLL:
                pass
        elif op == Op.READ_LAC:
            pass
        elif op == Op.WRITE_LAC:
            if entry_id < 0:
                pass
        elif op == Op.GET_BOOKIE_INFO:
            pass
    if error is not None:
        if "exceeds" in str(error):
            pass
        elif "shorter" in str(error):
            pass


def one_input(data: bytes) -> None:
    try:
        frames, used = parse_requests(data, MAX_FRAME)
        bad = None
    except FrameError as e:
        frames, bad = e.frames, e
        used = sum(REQUEST_HEADER_BYTES + len(f[7]) for f in frames)
    _feedback(frames, bad)
    assert 0 <= used <= len(data)
    assert b"".join(encode_request(*f[:8]) for f in frames) == data[:used], "round trip differs"
    for frame in frames:
        _check_frame(frame)
    if bad is None:
        assert parse_requests(data[used:], MAX_FRAME) == ([], 0), "a complete frame was left unparsed"
    split = data[0] % (len(data) + 1) if data else 0
    assert _stream([data[:split], data[split:]]) == (frames, bad is not None), f"split at {split} parses differently"


def seeds() -> list[bytes]:
    return request_seeds()
