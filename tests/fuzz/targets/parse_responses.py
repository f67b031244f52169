"""parse_responses (ext/bookkeeper/_ext/wire.pyx), the response decoder, and encode_responses.

Properties: any bytes either parse into responses that encode_responses turns back into
exactly the bytes consumed (the rest being one incomplete frame), or raise FrameError;
splitting the bytes across two buffers gives the same responses. Anything else is a crash.
"""
from __future__ import annotations

from bookkeeper.proto import FrameError, encode_responses, parse_responses

from ._frames import response_seeds

MAX_FRAME = 1 << 16


def _stream(chunks: list[bytes]) -> tuple[list[tuple], bool]:
    held, frames = b"", []
    for chunk in chunks:
        held += chunk
        try:
            got, used = parse_responses(held, MAX_FRAME)
        except FrameError:
            return frames, True
        frames += got
        held = held[used:]
    return frames, False


def one_input(data: bytes) -> None:
    try:
        frames, used = parse_responses(data, MAX_FRAME)
    except FrameError:
        frames, used, bad = [], 0, True  # parse_responses keeps no frames from before the bad one
    else:
        bad = False
        assert 0 <= used <= len(data)
        assert encode_responses(frames) == data[:used], "round trip differs"
        assert parse_responses(data[used:], MAX_FRAME) == ([], 0), "a complete frame was left unparsed"
    split = data[0] % (len(data) + 1) if data else 0
    chunked, chunked_bad = _stream([data[:split], data[split:]])
    assert chunked_bad == bad, f"split at {split}: bad frame {chunked_bad}, whole: {bad}"
    assert encode_responses(chunked) == data[:len(encode_responses(chunked))], f"split at {split} differs"
    if not bad:
        assert chunked == frames, f"split at {split} parses differently"


def seeds() -> list[bytes]:
    return response_seeds()
