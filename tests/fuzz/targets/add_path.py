"""AddPath.dispatch (ext/bookkeeper/_ext/shardpath.pyx) and the shard's Python dispatch behind
it, driven through BookieProtocol.data_received of a real in-process shard (targets/_shard.py):
what any peer can send a bookie.

The input arrives as two receive buffers (split where its first byte says) on a fresh
connection to a shard that holds no ledger. Properties: nothing raises out of the shard and
nothing is logged as an error (the shard survives a request that raised, answering
SERVER_ERROR: a finding here); the answers parse, each answers a request of this input with
its op and request id, at most once; every request before a bad frame is answered (long
polls may stay parked); a bad frame closes the connection once those are answered, and a
good input never does. Anything else, or an over-read under ASan, is a crash.
"""
from __future__ import annotations

from collections import Counter

from bookkeeper.proto import Flag, FrameError, Op, Status, parse_requests, parse_responses

from ._frames import request_seeds
from ._shard import MAX_FRAME, RenewedShard, Shard

_shards = RenewedShard(Shard)


def shard() -> Shard:
    """The shard of this process, renewed now and then (its journal only grows)."""
    return _shards.get()


def close() -> None:
    """Stop the shard (its loop, journal, storage and files)."""
    _shards.close()


def _requests(data: bytes) -> tuple[list[tuple], bool]:
    try:
        frames, _ = parse_requests(data, MAX_FRAME)
        return frames, False
    except FrameError as e:
        return e.frames, True


def one_input(data: bytes) -> None:
    s = shard()
    conn, transport = s.connect()
    split = data[0] % (len(data) + 1) if data else 0
    try:
        s.send(conn, data[:split], data[split:])
        errors = s.errors.take()
        assert not errors, f"the shard logged: {errors[0]}"
        answers, used = parse_responses(bytes(transport.received), 1 << 30)
        assert used == len(transport.received), "a partial answer"
        requests, bad = _requests(data)
        asked = Counter((int(f[0]), f[2]) for f in requests)
        got = Counter((a[0], a[2]) for a in answers)
        assert not got - asked, f"answers to no request: {dict(got - asked)}"
        polls = Counter((int(f[0]), f[2]) for f in requests if f[0] == Op.READ_ENTRY and f[1] & Flag.LONG_POLL)
        assert not asked - got - polls, f"unanswered: {dict(asked - got - polls)}"
        assert all(a[1] != Status.SERVER_ERROR for a in answers), "SERVER_ERROR without a journal failure"
        assert transport.closed == bad, "closed on a good input" if transport.closed else "a bad frame left it open"
        for a in answers:  # feedback for atheris: which statuses came back
            if a[1] == Status.OK:
                pass
            elif a[1] == Status.BAD_REQUEST:
                pass
            elif a[1] == Status.UNAUTHORIZED:
                pass
            elif a[1] == Status.NO_SUCH_LEDGER:
                pass
    finally:
        s.disconnect(conn)


def seeds() -> list[bytes]:
    return request_seeds()
