"""The AUTH exchange and the shard's frame handling before a connection is authenticated
(BookieProtocol._pre_auth and auth_round in bookkeeper/bookie/server.py, the `token` plug-in),
on a real in-process shard with auth_provider = token (targets/_shard.py): what anyone who can
reach a bookie's port can send it.

The input arrives as two receive buffers on a fresh connection. Properties: nothing raises
out of the shard and nothing is logged as an error (a plug-in that raised is logged: a
finding); the answers parse and each answers a request of the input once; before an AUTH
answered OK and done, no op but AUTH and START_TLS is served (each gets AUTHENTICATION) and
nothing is stored; a refused AUTH or an op before authentication closes the connection.
Anything else is a crash.
"""
from __future__ import annotations

from collections import Counter

from bookkeeper.bookie.trust import ShardTrust, auth_payload
from bookkeeper.proto import NO_KEY, FrameError, Op, Status, encode_request, parse_requests, parse_responses
from bookkeeper.security.auth import load_server_provider
from bookkeeper.security.tokens import mint_token

from ._frames import KEY, LEDGER, add
from ._shard import RenewedShard, Shard
from .token_verify import KID, SECRET, keys_file

UNTIL_2100 = 4_102_444_800  # the seeds' tokens expire then: valid on any day these tests run


def _token_shard() -> Shard:
    provider = load_server_provider("token", keys_file=keys_file(), reload_interval_s=3600)
    return Shard(trust=ShardTrust(provider=provider))


_shards = RenewedShard(_token_shard)


def shard() -> Shard:
    """The shard of this process (token authentication), renewed now and then."""
    return _shards.get()


def close() -> None:
    """Stop the shard (its loop, journal, storage and files)."""
    _shards.close()


def _requests(data: bytes) -> list[tuple]:
    """The frames of the input, as far as they parse (the pre-auth path parses one at a time)."""
    frames, held = [], data
    while len(held) >= 4:
        flen = int.from_bytes(held[:4], "big") + 4
        try:
            got, used = parse_requests(held[:flen], 1 << 20)
        except FrameError:
            break
        if not got:
            break
        frames += got
        held = held[used:]
    return frames


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
        asked = Counter((int(f[0]), f[2]) for f in _requests(data))
        got = Counter((a[0], a[2]) for a in answers)
        assert not got - asked, f"answers to no request: {dict(got - asked)}"
        opened = False
        for op, status, _, _, entry_id, _, _ in answers:
            if op == Op.AUTH:
                if status == Status.OK:
                    opened = opened or entry_id == 1
                else:
                    assert status == Status.AUTHENTICATION and transport.closed, "a refused AUTH left it open"
            elif not opened and op != Op.START_TLS:
                assert status == Status.AUTHENTICATION, f"op {op} answered {status} before authentication"
                assert transport.closed, "an op before authentication left the connection open"
        if not opened:
            assert not s.storage.ledgers and not s.storage.write_cache, "stored before authentication"
    finally:
        s.disconnect(conn)


def auth(request_id: int, token: str, plugin: str = "token") -> bytes:
    return encode_request(Op.AUTH, 0, request_id, 0, -1, NO_KEY, 0, auth_payload(plugin, token.encode()))


def seeds() -> list[bytes]:
    good = mint_token(subject="alice", ttl_s=UNTIL_2100, key_id=KID, secret=SECRET, now=0)
    read = encode_request(Op.READ_ENTRY, 0, 3, LEDGER, 0, NO_KEY, 0, b"")
    return [
        auth(1, good),
        auth(1, good) + add(2, LEDGER, 0) + read,
        auth(1, good) + auth(2, good) + add(3, LEDGER, 0, key=KEY),  # a renewal in band
        auth(1, good[:-3] + "AAA"),
        auth(1, good, plugin="mtls"),
        add(1, LEDGER, 0) + auth(2, good),
        encode_request(Op.START_TLS, 0, 1, 0, -1, NO_KEY, 0, b"") + auth(2, good),
        encode_request(Op.AUTH, 0, 1, 0, -1, NO_KEY, 0, b"\x05tok"),
    ]
