"""The client's Cython hot path (client.pyx: digests, RequestPipe, AddTracker), in memory, against oracles."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import struct
import time
from typing import Any

import crc32c
import pytest

from bookkeeper._ext.client import (DIGEST_CRC32C, DIGEST_DUMMY, DIGEST_MAC, AckSink, AddTracker, RequestPipe,
                                    check_entry, encode_entry)
from bookkeeper.proto import FrameError, Flag, Op, Status, encode_responses, parse_requests
from bookkeeper.client.core.writer import WriterCore

MAC_KEY = hashlib.sha1(b"mac" + b"secret").digest()
KEY = bytes(range(1, 21))
MAX = 1 << 20
U64_MAX, I64_MAX = 2**64 - 1, 2**63 - 1


def oracle_entry(kind: int, ledger: int, entry: int, lac: int, length: int, data: bytes) -> bytes:
    """u64 ledger | i64 entry | i64 lac | u64 length | digest(header then data) | data, big-endian."""
    header = struct.pack(">QqqQ", ledger, entry, lac, length)
    digest = {DIGEST_CRC32C: lambda: struct.pack(">I", crc32c.crc32c(header + data)),
              DIGEST_MAC: lambda: hmac.new(MAC_KEY, header + data, hashlib.sha1).digest(),
              DIGEST_DUMMY: lambda: b""}[kind]()
    return header + digest + data


def flip(buf: bytes, bit: int) -> bytes:
    return bytes(b ^ (1 << bit % 8) if i == bit // 8 else b for i, b in enumerate(buf))


# -- entry digests ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", [DIGEST_CRC32C, DIGEST_MAC, DIGEST_DUMMY])
@pytest.mark.parametrize("ledger,entry,lac,length,data", [
    (7, 0, -1, 0, b""), (1, 5, 4, 99, b"hello"), (U64_MAX, I64_MAX, I64_MAX - 1, U64_MAX, bytes(range(256)) * 3)])
def test_encode_entry_matches_layout_and_round_trips(kind, ledger, entry, lac, length, data) -> None:
    """encode_entry gives the documented bytes and check_entry returns (data, lac, length) unchanged."""
    payload = encode_entry(kind, MAC_KEY, ledger, entry, lac, length, data)
    assert payload == oracle_entry(kind, ledger, entry, lac, length, data)
    got = check_entry(kind, MAC_KEY, ledger, entry, payload)
    assert got == (data, lac, length) and type(got[0]) is bytes


@pytest.mark.parametrize("kind", [DIGEST_CRC32C, DIGEST_MAC])
def test_check_entry_rejects_every_single_bit_flip(kind: int) -> None:
    """A flipped bit anywhere (header, digest or data) makes check_entry raise ValueError."""
    payload = encode_entry(kind, MAC_KEY, 3, 8, 7, 123, b"0123456789")
    for bit in range(len(payload) * 8):  # ids (bytes 0-15) fail their id check, the rest the digest check
        with pytest.raises(ValueError, match="came back as" if bit < 128 else "digest check"):
            check_entry(kind, MAC_KEY, 3, 8, flip(payload, bit))


@pytest.mark.parametrize("kind", [DIGEST_CRC32C, DIGEST_MAC, DIGEST_DUMMY])
def test_check_entry_rejects_truncated_payloads_and_wrong_ids(kind: int) -> None:
    """Every strict prefix (for DUMMY: under 32 bytes) and another ledger or entry id are refused."""
    payload = encode_entry(kind, MAC_KEY, 3, 8, 7, 5, b"abcde")
    for n in range(len(payload)):
        if kind == DIGEST_DUMMY and n >= 32:  # no digest: a cut in the data cannot be seen
            assert check_entry(kind, MAC_KEY, 3, 8, payload[:n])[0] == b"abcde"[:n - 32]
        else:
            pytest.raises(ValueError, check_entry, kind, MAC_KEY, 3, 8, payload[:n])
    with pytest.raises(ValueError, match="truncated"):
        check_entry(kind, MAC_KEY, 3, 8, payload[:31])
    for ledger, entry in [(4, 8), (3, 9), (3, 7), (2**63 + 3, 8)]:
        with pytest.raises(ValueError, match="came back as 3:8"):
            check_entry(kind, MAC_KEY, ledger, entry, payload)


def test_mac_needs_its_key_and_dummy_detects_nothing() -> None:
    """A MAC checked with another key is refused; DUMMY has no digest, so a data flip passes unnoticed."""
    with pytest.raises(ValueError, match="digest check"):
        check_entry(DIGEST_MAC, b"other key", 1, 2, encode_entry(DIGEST_MAC, MAC_KEY, 1, 2, 1, 3, b"abc"))
    dummy = encode_entry(DIGEST_DUMMY, MAC_KEY, 1, 2, 1, 3, b"abc")
    assert check_entry(DIGEST_DUMMY, MAC_KEY, 1, 2, flip(dummy, 8 * 32)) == (b"`bc", 1, 3)
    with pytest.raises(ValueError, match="unknown digest"):
        encode_entry(3, MAC_KEY, 1, 2, 1, 3, b"abc")


# -- RequestPipe ------------------------------------------------------------------------
def make_pipe(n: int = 0, max_frame: int = MAX) -> tuple[RequestPipe, list, list]:
    """(pipe, flush calls, callback calls): error_for(status) is ("error", status); n requests "ctx0".. sent.
    A scheduled flush is recorded as 1, an eager one (outbox past 16 KiB) as "now"."""
    flushes: list = []
    pipe, calls = RequestPipe(max_frame, lambda status, payload=b"": ("error", status), lambda: flushes.append(1),
                              lambda: flushes.append("now")), []
    for i in range(n):
        send(pipe, calls, f"ctx{i}")  # request id i + 1
    return pipe, flushes, calls


def send(pipe: RequestPipe, calls: list, ctx, timeout_s: float = 60.0, cb=None) -> bool:
    cb = cb or (lambda c, r, e: calls.append((c, r, e)))
    return pipe.send(Op.ADD_ENTRY, 0, 7, 1, KEY, 0, b"p", cb, ctx, timeout_s)


def resp(rid: int, status: int = 0, payload: bytes = b"") -> tuple:
    return (int(Op.ADD_ENTRY), int(status), rid, 7, rid - 1, rid - 2, payload)


def expected(r: tuple) -> tuple:
    return (f"ctx{r[2] - 1}", r, None if r[1] == 0 else ("error", r[1]))


def test_send_schedules_a_flush_only_when_connected_and_outbox_empty() -> None:
    """Disconnected: send() is True, no flush; connected: one flush per frame into an empty outbox."""
    pipe, flushes, calls = make_pipe()
    assert [send(pipe, calls, i) for i in range(3)] == [True] * 3
    assert flushes == [] and pipe.outstanding == 3 and pipe.take() is not None
    pipe.connected = True
    assert [send(pipe, calls, i) for i in range(3)] == [False] * 3
    assert flushes == [1] and pipe.take() is not None and pipe.take() is None
    send(pipe, calls, 9)
    pipe.discard_outbox()  # drops the queued frame, not the request; the next frame flushes again
    assert flushes == [1, 1] and pipe.take() is None and pipe.outstanding == 7 and calls == []
    pipe.send(Op.READ_LAC, 0, 9, 0, KEY, 0, b"", calls.append, "x", 5.0)
    assert flushes == [1, 1, 1] and [f[:4] for f in parse_requests(pipe.take(), MAX)[0]] == [(3, 0, 8, 9)]


def test_take_returns_all_frames_in_one_buffer_that_parse_back() -> None:
    """take() is one bytearray of every frame, parsed back with ids from 1; a key not 20 bytes is refused."""
    pipe, _, calls = make_pipe()
    reqs = [(Op.ADD_ENTRY, Flag.RECOVERY_ADD, 7, 0, KEY, 0, b"\x00payload" * 9),
            (Op.READ_ENTRY, Flag.FENCE | Flag.LONG_POLL, U64_MAX, -1, bytes(20), 2**32 - 1, b""),
            (Op.READ_LAC, 0xFFFF, 0, I64_MAX, b"\xff" * 20, 1000, b"z")]
    for i, (op, flags, lid, eid, key, aux, payload) in enumerate(reqs):
        pipe.send(op, flags, lid, eid, key, aux, payload, calls.append, i, 5.0)
    out = pipe.take()
    frames, used = parse_requests(out, MAX)
    assert type(out) is bytearray and used == len(out) and pipe.take() is None
    assert [f[:8] for f in frames] == [(int(op), int(flags), rid, lid, eid, key, aux, payload)
                                       for rid, (op, flags, lid, eid, key, aux, payload) in enumerate(reqs, 1)]
    for key_len in (0, 19, 21):  # a master key of any other length queues nothing
        pytest.raises(ValueError, pipe.send, Op.ADD_ENTRY, 0, 1, 0, bytes(key_len), 0, b"", calls.append, 0, 5.0)
    assert pipe.outstanding == 3 and pipe.take() is None


def test_feed_calls_each_callback_with_ctx_response_and_error() -> None:
    """Responses in any order reach their own callbacks (err None or error_for(status)); stale ids are ignored."""
    pipe, _, calls = make_pipe(6)
    resps = [resp(4, payload=b"abc"), resp(1, Status.NO_SUCH_ENTRY), resp(6), resp(3, Status.FENCED, b"\x01" * 50),
             resp(5, Status.TIMEOUT), resp(2)]
    pipe.feed(encode_responses(resps[:2]))
    assert pipe.outstanding == 4
    pipe.feed(encode_responses(resps[2:]))
    assert calls == [expected(r) for r in resps]
    assert calls[1] == ("ctx0", resps[1], ("error", 2)) and calls[2][2] is None and pipe.outstanding == 0
    send(pipe, calls, "ctx6")  # request id 7: answered after responses for answered (1, 4) and unknown ids
    pipe.feed(encode_responses([resp(1), resp(99), resp(4, Status.FENCED), resp(0), resp(7)]))
    assert calls[6:] == [expected(resp(7))] and pipe.outstanding == 0


def test_feed_split_at_every_byte_offset() -> None:
    """A buffer cut anywhere into two feeds, or fed byte by byte, dispatches each response exactly once."""
    resps = [resp(1, payload=b"x" * 13), resp(2, Status.TIMEOUT), resp(3, payload=b"yz")]
    buf = encode_responses(resps)
    for pieces in [[buf[:cut], buf[cut:]] for cut in range(len(buf) + 1)] + [[bytes([b]) for b in buf]]:
        pipe, _, calls = make_pipe(3)
        for piece in pieces:
            pipe.feed(piece)
        assert calls == [expected(r) for r in resps], pieces


@pytest.mark.parametrize("bad", [struct.pack(">IB", 97, 1) + bytes(96),   # 101 bytes: over max_frame=100
                                 struct.pack(">IB", 36, 2) + bytes(35),   # unknown version
                                 struct.pack(">IB", 35, 1) + bytes(34)],  # 39 bytes: under the 40-byte header
                         ids=["too_long", "bad_version", "too_short"])
def test_unparseable_frame_raises_frame_error(bad: bytes) -> None:
    """A frame over max_frame, with a bad version, or under 40 bytes raises FrameError (after earlier frames)."""
    good = encode_responses([resp(1, payload=b"q" * 60)])
    assert len(good) == 100  # exactly max_frame: accepted
    for split in (0, 3):  # whole, or after a partial frame was buffered
        pipe, _, calls = make_pipe(2, max_frame=100)
        pipe.feed(good[:split])
        with pytest.raises(FrameError):
            pipe.feed(good[split:] + bad)
        assert calls == [expected(resp(1, payload=b"q" * 60))]


def test_expire_fails_only_overdue_requests_and_fail_all_fails_the_rest() -> None:
    """expire(now, factory) fails past-deadline requests with fresh errors; fail_all(err) all others, input dropped."""
    pipe, _, calls = make_pipe()
    for i, timeout in enumerate([0.0, 1e9, 0.0, 1e9, 1e9]):
        send(pipe, calls, f"ctx{i}", timeout)
    made: list[Exception] = []
    pipe.expire(time.monotonic() + 1, lambda: made.append(TimeoutError("late")) or made[-1])
    assert sorted(c[0] for c in calls) == ["ctx0", "ctx2"] and all(c[1] is None for c in calls)
    assert len(made) == 2 and {id(c[2]) for c in calls} == {id(e) for e in made} and pipe.outstanding == 3
    pipe.expire(time.monotonic() + 1, made.pop)  # nothing else is due: the factory is not even called
    pipe.feed(encode_responses([resp(1), resp(2), resp(3)]) + encode_responses([resp(4)])[:10])  # 1, 3 failed
    assert calls[2:] == [expected(resp(2))] and pipe.outstanding == 2 and len(made) == 2
    pipe.fail_all(err := ConnectionError("gone"))
    assert sorted(calls[3:]) == [("ctx3", None, err), ("ctx4", None, err)] and calls[-1][2] is err
    assert pipe.outstanding == 0
    send(pipe, calls, "ctx5")  # request id 6: its response parses only if the half frame was dropped
    pipe.feed(encode_responses([resp(6)]))
    assert calls[5:] == [expected(resp(6))]


def test_expire_orders_deadlines_per_timeout_not_by_send_order() -> None:
    """A short-timeout request sent after long-timeout ones expires first, answered requests never
    expire, and the long ones expire once their own deadline passes."""
    pipe, _, calls = make_pipe()
    for i in range(3):
        send(pipe, calls, f"long{i}", 100.0)
    send(pipe, calls, "short", 1.0)
    pipe.feed(encode_responses([resp(2)]))  # long1 answered
    now = time.monotonic()
    pipe.expire(now + 10, lambda: "late")
    assert [c[0] for c in calls] == ["long1", "short"] and calls[1][2] == "late" and pipe.outstanding == 2
    pipe.expire(now + 1000, lambda: "later")
    assert sorted(c[0] for c in calls[2:]) == ["long0", "long2"] and pipe.outstanding == 0


def test_raising_callback_is_logged_and_dispatch_continues(caplog: pytest.LogCaptureFixture) -> None:
    """A callback that raises is logged; later responses in the same buffer are still dispatched."""
    pipe, _, calls = make_pipe()
    send(pipe, calls, "boom", cb=lambda c, r, e: 1 / 0)
    send(pipe, calls, "ctx1")
    with caplog.at_level(logging.ERROR, logger="bookkeeper.client"):
        pipe.feed(encode_responses([resp(1), resp(2)]))
    assert calls == [expected(resp(2))] and pipe.outstanding == 0
    assert "response callback failed" in caplog.text and "ZeroDivisionError" in caplog.text


def deliver(target, data: bytes) -> None:
    """What a transport does with a BufferedProtocol (or a RequestPipe): copy into the space
    get_buffer offers, then report how much, as many times as it takes."""
    while data:
        buf = target.get_buffer(-1)
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        target.buffer_updated(n)
        data = data[n:]


def test_receive_buffer_offers_room_and_carries_a_partial_frame_across_reads() -> None:
    """get_buffer offers at least 64 KiB; a frame larger than the buffer (3 MiB, max frame 4 MiB)
    arrives in pieces and is dispatched once, whole; reporting more than was offered is refused."""
    pipe, _, calls = make_pipe(3, max_frame=4 << 20)
    assert len(pipe.get_buffer(-1)) >= 64 * 1024
    big = bytes(random.Random(7).randbytes(3 << 20))
    resps = [resp(1, payload=b"a" * 70_000), resp(2, payload=big), resp(3, payload=b"tail")]
    deliver(pipe, encode_responses(resps))
    assert calls == [expected(r) for r in resps] and pipe.outstanding == 0
    room = len(pipe.get_buffer(-1))
    with pytest.raises(ValueError, match="past the"):
        pipe.buffer_updated(room + 1)


def test_borrowed_payload_is_a_view_released_after_its_callback(caplog: pytest.LogCaptureFixture) -> None:
    """borrow=True: the callback sees the payload as a read-only memoryview of the receive buffer,
    released when the callback returns; one that keeps a zero-copy buffer of it (an Arrow
    buffer here) is logged as a bug; a request without borrow gets bytes of its own."""
    import pyarrow as pa

    pipe, _, calls = make_pipe()
    kept: list = []

    def keep(ctx, r, e) -> None:  # noqa: ANN001
        kept.append((r[6], bytes(r[6]), r[6].readonly))

    pipe.send(Op.READ_ENTRY, 0, 7, 0, KEY, 0, b"", keep, None, 60.0, True)
    pipe.send(Op.READ_ENTRY, 0, 7, 1, KEY, 0, b"", lambda c, r, e: kept.append(r[6]), None, 60.0)
    pipe.send(Op.READ_ENTRY, 0, 7, 2, KEY, 0, b"", lambda c, r, e: kept.append(pa.py_buffer(r[6])), None, 60.0, True)
    with caplog.at_level(logging.ERROR, logger="bookkeeper.client"):
        pipe.feed(encode_responses([resp(1, payload=b"borrowed"), resp(2, payload=b"owned"),
                                    resp(3, payload=b"sliced")]))
    view, copy, readonly = kept[0]
    assert copy == b"borrowed" and readonly and kept[1] == b"owned" and type(kept[1]) is bytes
    with pytest.raises(ValueError):
        bytes(view)  # released: a kept view fails loudly instead of reading later frames' bytes
    assert "kept a view of a borrowed payload" in caplog.text


def test_fail_all_from_a_callback_stops_the_dispatch_of_that_buffer() -> None:
    """A callback that fails the pipe (its connection is lost) ends the dispatch of the buffer
    being parsed: later frames in it reach nobody, and the next read starts clean."""
    pipe, _, calls = make_pipe()
    send(pipe, calls, "first", cb=lambda c, r, e: (calls.append(c), pipe.fail_all(ConnectionError("lost"))))
    send(pipe, calls, "second")
    deliver(pipe, encode_responses([resp(1), resp(2)]) + encode_responses([resp(3)])[:7])
    assert calls[0] == "first" and calls[1][0] == "second" and calls[1][1] is None and len(calls) == 2
    send(pipe, calls, "third")  # request id 3: parses only if the old bytes were dropped
    deliver(pipe, encode_responses([resp(3)]))
    assert calls[2][0] == "third" and calls[2][2] is None and pipe.outstanding == 0


# -- AddTracker -------------------------------------------------------------------------
@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_ack_resolves_futures_in_id_order_and_leaves_later_ones(loop) -> None:
    """ack() resolves the newly acknowledged run's futures with their ids; later or cancelled ones are left."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=2)
    futs = [loop.create_future() for _ in range(4)]
    for e in range(4):
        t.add(e, 10 + e, futs[e])
    assert t.ack(1, 1) == [] and t.ack(1, 2) == [] and t.ack(0, 0) == [] and not any(f.done() for f in futs)
    assert t.ack(0, 1) == [(0, 10), (1, 21)]
    assert [f.result() for f in futs[:2]] == [0, 1] and not futs[2].done() and not futs[3].done()
    futs[2].cancel()
    assert t.ack(2, 2) == [] and t.ack(2, 0) == [(2, 33)]  # cancelled future: skipped, no error
    assert futs[2].cancelled() and not futs[3].done() and t.lac == 2 and t.drop_all() == [(3, futs[3])]


def test_ack_from_counts_only_the_current_bookie_of_a_slot() -> None:
    """ack_from counts iff slot idx was last sent to bookie (add/mark_sent, which copies) and it is not failing."""
    ens = ["a", "b", "c"]
    t = AddTracker(ensemble_size=3, write_quorum=3, ack_quorum=2)
    for e in range(3):
        t.add(e, 1, ensemble=ens)
    assert t.ack_from(0, 0, "b", set()) == 0                  # slot 0 went to "a"
    assert t.ack_from(0, 0, "a", {"a", "z"}) == 0             # "a" is being replaced
    assert t.ack_from(0, 1, "b", set()) == 0 and t.lac == -1  # only one valid ack so far
    assert t.ack_from(0, 0, "a", None) == 1 and t.lac == 0
    assert t.ack_from(2, 0, "a", {"c"}) == 0 and t.ack_from(2, 1, "b", set()) == 0 and t.ack_from(1, 2, "c", set()) == 0
    assert t.ack_from(1, 1, "b", set()) == 2 and t.lac == 2   # entries 1 and 2 together
    assert t.ack_from(1, 0, "a", set()) == 0                  # settled
    t.add(3, 1, ensemble=ens), t.add(4, 1, ensemble=ens)    # mark_sent copies the shared list before a change:
    t.mark_sent(3, 1, "d")                                  # only the new bookie counts for that slot
    assert ens == ["a", "b", "c"] and t.sent_to(3) == ["a", "d", "c"] and t.sent_to(4) == ["a", "b", "c"]
    assert t.is_current(3, 1, "d") and not t.is_current(3, 1, "b") and t.is_current(4, 1, "b")
    assert t.ack_from(3, 1, "b", set()) == 0 and t.ack_from(3, 0, "a", set()) == 0 and t.ack_from(3, 1, "d", set()) == 1


def test_add_order_sent_to_is_current_and_payload() -> None:
    """add() takes ids in order from lac+1 and returns the write set; sent_to/is_current/payload follow the entry."""
    ens = ["b0", "b1", "b2", "b3", "b4"]
    t = AddTracker(ensemble_size=5, write_quorum=3, ack_quorum=1, lac=2)
    for bad in (2, 4, 0):
        pytest.raises(ValueError, t.add, bad, 1)
    assert t.add(3, 4, None, b"p3", ens) == (3, 4, 0) and t.add(4, 4, None, b"p4") == (4, 0, 1)
    with pytest.raises(ValueError, match=r"added out of order \(expected 5\)"):
        t.add(4, 1)
    assert t.pending_ids() == [3, 4] and t.outstanding == 2  # sent_to: None outside the write set
    assert t.sent_to(3) == ["b0", None, None, "b3", "b4"] and t.sent_to(4) == [None] * 5
    assert t.sent_to(5) == [] and t.sent_to(2) == [] and t.payload(3) == b"p3" and t.payload(4) == b"p4"
    assert t.is_current(3, 1, "b1") and not t.is_current(3, 5, "b1") and not t.is_current(3, -1, "b4")
    assert t.ack(3, 0) == [(3, 4)] and t.sent_to(3) == [] and not t.is_current(3, 0, "b0")
    for gone in (3, 5):
        pytest.raises(KeyError, t.payload, gone)


def test_drop_all(loop) -> None:
    """drop_all returns (id, future or None) of every outstanding entry in order and empties the ring."""
    t = AddTracker(ensemble_size=2, write_quorum=2, ack_quorum=2, lac=9)
    futs = {e: loop.create_future() for e in (10, 11, 13, 14)}
    for e in range(10, 15):
        t.add(e, 1, futs.get(e))
    assert t.ack(10, 0) == [] and t.ack(10, 1) == [(10, 1)]
    assert t.drop_all() == [(11, futs[11]), (12, None), (13, futs[13]), (14, futs[14])]
    assert t.outstanding == 0 and t.pending_ids() == [] and t.drop_all() == []
    assert [f.done() for f in futs.values()] == [True, False, False, False]  # dropping resolves nothing
    assert t.add(11, 1) == (1, 0) and t.lac == 10


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ring_grows_past_64_under_random_acks(seed: int, loop) -> None:
    """1000 entries, adds interleaved with random acks: acknowledged ids/lengths match a Python oracle."""
    E, Qw, Qa, n, rng = 5, 3, 2, 1000, random.Random(seed)
    ens, sizes = [f"b{i}" for i in range(E)], [rng.randint(0, 100) for _ in range(n)]
    futs = [loop.create_future() for _ in range(n)]
    t = AddTracker(ensemble_size=E, write_quorum=Qw, ack_quorum=Qa)
    acked: list[set[int]] = []  # oracle: the write-set slots that acked each added entry
    o_lac, o_len, slots, got, want = -1, 0, [], [], []
    while len(acked) < n or slots:
        if len(acked) < n and (not slots or rng.random() < 0.75):
            e = len(acked)
            ws = tuple((e + i) % E for i in range(Qw))
            assert t.add(e, sizes[e], futs[e], b"p%d" % e, ens) == ws
            slots += [(e, i) for i in ws]
            acked.append(set())
            if e == n - 1:  # the regrown ring kept every pending entry's payload and bookies
                assert t.outstanding > 64 and t.pending_ids() == list(range(o_lac + 1, n))
                for p in t.pending_ids():
                    assert t.payload(p) == b"p%d" % p
                    assert t.sent_to(p) == [b if (i - p) % E < Qw else None for i, b in enumerate(ens)]
            continue
        e, idx = slots.pop(rng.randrange(len(slots)))
        got.append(t.ack(e, idx))
        acked[e].add(idx)
        want.append([])
        while o_lac + 1 < len(acked) and len(acked[o_lac + 1]) >= Qa:
            o_lac, o_len = o_lac + 1, o_len + sizes[o_lac + 1]
            want[-1].append((o_lac, o_len))
    assert got == want
    assert [x for run in got for x in run] == [(i, sum(sizes[:i + 1])) for i in range(n)]
    assert [f.result() for f in futs] == list(range(n)) and t.outstanding == 0 and t.lac == n - 1


def test_ensemble_size_limit_and_ensemble_length() -> None:
    """E > 64 or an ensemble list not of length E is a ValueError; E = 64 works, incl. an ack on slot 63."""
    with pytest.raises(ValueError, match="maximum of 64"):
        AddTracker(ensemble_size=65, write_quorum=2, ack_quorum=2)
    t = AddTracker(ensemble_size=64, write_quorum=64, ack_quorum=64)
    t.add(0, 3)
    assert [t.ack(0, idx) for idx in range(63, 0, -1)] == [[]] * 63 and t.ack(0, 0) == [(0, 3)]
    for size in (0, 63, 65):  # a fresh tracker each time: see the BUG test below
        with pytest.raises(ValueError, match=f"ensemble of {size} bookies"):
            AddTracker(ensemble_size=64, write_quorum=2, ack_quorum=1).add(0, 1, None, b"p", ["x"] * size)


def test_rejected_add_with_wrong_length_ensemble_leaves_tracker_unchanged() -> None:
    """A rejected add() must not register the entry (the same id can then be added properly)."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=1)
    with pytest.raises(ValueError):
        t.add(0, 1, None, b"p", ["x", "y"])
    assert t.outstanding == 0 and t.pending_ids() == []
    assert t.add(0, 1, None, b"p", ["a", "b", "c"]) == (0, 1)


def test_outbox_past_eager_bytes_is_written_at_once() -> None:
    """Once the outbox holds eager_bytes, each further send asks for an immediate write, so a burst
    of requests starts reaching the bookie before the loop turn ends; below it, only the one
    scheduled flush of the turn."""
    flushes: list = []
    pipe = RequestPipe(MAX, lambda status: None, lambda: flushes.append("soon"),
                       lambda: flushes.append(("now", len(pipe.take() or b""))), 1000)
    pipe.connected = True
    frame = 56 + 200
    for _ in range(3):
        pipe.send(Op.ADD_ENTRY, 0, 7, 1, KEY, 0, bytes(200), lambda c, r, e: None, None, 60.0)
    assert flushes == ["soon"]  # 768 bytes queued: under the threshold
    pipe.send(Op.ADD_ENTRY, 0, 7, 1, KEY, 0, bytes(200), lambda c, r, e: None, None, 60.0)
    assert flushes == ["soon", ("now", 4 * frame)]
    pipe.send(Op.ADD_ENTRY, 0, 7, 1, KEY, 0, bytes(200), lambda c, r, e: None, None, 60.0)
    assert flushes == ["soon", ("now", 4 * frame), "soon"]  # the outbox was emptied: a new turn's flush


def test_a_transport_given_up_on_cannot_touch_the_next_ones_requests() -> None:
    """After a bad frame the connection drops its transport at once; when that old transport
    reports connection_lost (or data) later, the requests and buffer of the new one are untouched."""
    import asyncio

    from bookkeeper.client.bookie_client import ShardConnection, _ShardProtocol

    class Fake(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.closed = False

        def write(self, data) -> None:  # noqa: ANN001
            pass

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

    async def main() -> None:
        conn = ShardConnection("h", 1, timeout_s=30.0, max_frame_bytes=MAX)
        old_proto, old = _ShardProtocol(conn), Fake()
        old_proto.connection_made(old)
        conn.attach(old)
        deliver(old_proto, b"\x00\x00\x00\x05\x07garbage")  # too short: FrameError, dropped at once
        new_proto, new = _ShardProtocol(conn), Fake()
        new_proto.connection_made(new)
        conn.attach(new)
        got: list = []
        conn.request(Op.ADD_ENTRY, 0, 1, 0, KEY, 0, b"p", lambda c, r, e: got.append(e), None)
        old_proto.connection_lost(None)  # late report from the transport given up on
        deliver(old_proto, b"\x00\x00\x00")  # late bytes read into a scratch buffer, not the pipe's
        assert got == [] and conn.pipe.outstanding == 1 and conn.pipe.connected
        new_proto.connection_lost(None)
        assert len(got) == 1 and got[0] is not None and conn.pipe.outstanding == 0

    asyncio.run(main())


def test_ack_sink_counts_ok_adds_in_c_and_reports_progress_once_per_buffer(loop) -> None:
    """Adds sent with an AckSink: their OK responses ack the tracker without reaching on_response
    (futures resolved in id order), on_progress runs once per receive buffer in which entries
    became acknowledged (not for a buffer that only half-acks), and an error, a response from a
    bookie being replaced and a timeout go to on_response as (ctx, resp, err)."""
    ens = ["a", "b", "c"]
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=2)
    failed: set = set()
    other: list = []
    progress: list = []
    sink = AckSink(t, failed, lambda c, r, e: other.append((c, r, e)), lambda: progress.append(t.lac))
    pipe, _, _ = make_pipe()
    futs = [loop.create_future() for _ in range(4)]
    rids = {}
    for e in range(4):
        for idx in t.add(e, 10, futs[e], b"p", ens):
            pipe.send(Op.ADD_ENTRY, 0, 7, e, KEY, 0, b"p", sink, (e, idx, ens[idx]), 60.0)
            rids[(e, idx)] = len(rids) + 1  # request ids from 1, in send order

    def ok(e: int, idx: int, status: int = 0) -> tuple:
        return (int(Op.ADD_ENTRY), int(status), rids[(e, idx)], 7, e, -1, b"")

    pipe.feed(encode_responses([ok(0, 0), ok(1, 1)]))  # one ack each: nothing acknowledged
    assert progress == [] and other == [] and t.lac == -1
    pipe.feed(encode_responses([ok(1, 2), ok(0, 1)]))  # entries 0 and 1 together: one progress call
    assert progress == [1] and [f.result() for f in futs[:2]] == [0, 1] and other == []
    failed.add("c")  # "c" is being replaced: its OK does not count
    pipe.feed(encode_responses([ok(2, 2), ok(2, 0, Status.FENCED)]))
    assert progress == [1] and t.lac == 1 and not futs[2].done()
    assert other == [((2, 0, "a"), ok(2, 0, Status.FENCED), ("error", int(Status.FENCED)))]
    pipe.expire(time.monotonic() + 120, lambda: "late")
    assert [o[0] for o in other[1:]] == [(3, 0, "a"), (3, 1, "b")] and all(o[2] == "late" for o in other[1:])


def test_ack_sink_called_with_an_ok_response_acknowledges_it_too(loop) -> None:
    """An OK response that reaches the sink as a plain callback (not through a pipe's C loop) is
    acknowledged the same way: the tracker advances, on_progress runs, on_response does not."""
    t = AddTracker(ensemble_size=1, write_quorum=1, ack_quorum=1)
    other: list = []
    progress: list = []
    sink = AckSink(t, set(), lambda c, r, e: other.append(e), lambda: progress.append(t.lac))
    fut = loop.create_future()
    t.add(0, 5, fut, b"p", ["a"])
    sink((0, 0, "z"), None, None)  # slot 0 went to "a": not counted
    assert progress == [] and not fut.done()
    sink((0, 0, "a"), None, None)
    assert progress == [0] and fut.result() == 0 and other == []


def _core_with_segments(segments: dict[int, list[str]]) -> WriterCore:
    """A writer's core over a ledger with these segments (the late-failure rule reads only them)."""
    from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata
    md = LedgerMetadata(ledger_id=1, ensemble_size=3, write_quorum=3, ack_quorum=2,
                        digest=DigestType.CRC32C, password_digest="", ensembles=segments)
    return WriterCore(md, AddTracker(ensemble_size=3, write_quorum=3, ack_quorum=2))


def test_a_late_failure_replaces_a_bookie_every_segment_since_kept() -> None:
    """Qa < Qw: a bookie failing an entry acknowledged without it is replaced while new entries
    still go to it, even when the entry is from a segment before an ensemble change that
    replaced another bookie (the simulator's seed 9 at 18ac14b: it was kept another add timeout);
    not when it was replaced since and taken back later (the failure is of its old stay)."""
    kept = _core_with_segments({0: ["a", "b", "c"], 100: ["a", "d", "c"]})
    assert kept.still_writing_to(50, "c")  # failed entry 50, in segment 0; still in the last one
    assert kept.still_writing_to(150, "c")
    assert not kept.still_writing_to(50, "b")  # replaced at 100
    back = _core_with_segments({0: ["a", "b", "c"], 100: ["a", "d", "c"], 200: ["a", "b", "c"]})
    assert not back.still_writing_to(50, "b")  # replaced at 100, taken back at 200
    assert back.still_writing_to(250, "b")
    back.closing = True
    assert not back.still_writing_to(250, "b")


def test_a_closed_pool_refuses_requests_instead_of_connecting_again() -> None:
    """A request made after the pool closed fails through its callback with ClientClosedError
    (not retriable, a BookieUnavailableError), and makes no connection and no sweeper task:
    before, it connected again and left a sweeper running until the loop ended."""
    from bookkeeper.client.bookie_client import BookieClientPool
    from bookkeeper.errors import BookieUnavailableError, ClientClosedError

    async def main() -> list[Any]:
        pool = BookieClientPool(lambda _bookie: {"shards": [{"host": "127.0.0.1", "port": 9}]})
        pool.close()
        got: list[Any] = []
        pool.send("b1", int(Op.READ_ENTRY), 0, 7, 0, b"", 0, b"", lambda ctx, resp, err: got.append((ctx, resp, err)),
                  "ctx")
        await asyncio.sleep(0)
        assert not pool._conns and pool._sweeper is None
        with pytest.raises(ClientClosedError, match="b1: the client is closed"):
            await pool.call("b1", int(Op.READ_ENTRY), 0, 7, 0, b"")
        return got

    ((ctx, resp, err),) = asyncio.run(main())
    assert ctx == "ctx" and resp is None and isinstance(err, ClientClosedError)
    assert isinstance(err, BookieUnavailableError) and not err.retriable


def test_closing_the_pool_while_a_connection_is_being_made_fails_its_queued_requests() -> None:
    """A request waits for a connection still being made when the pool closes: it fails at
    once with ClientClosedError and the connecting stops (before, the connection was made
    afterwards, untracked, and sent the request with no deadline kept)."""
    from bookkeeper.client.bookie_client import BookieClientPool
    from bookkeeper.errors import ClientClosedError

    async def main() -> tuple[list[Any], asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        never: asyncio.Future[Any] = loop.create_future()

        async def hanging_connect(*_a: Any, **_kw: Any) -> Any:
            return await never  # a bookie that never answers the TCP handshake

        loop.create_connection = hanging_connect  # type: ignore[method-assign]
        pool = BookieClientPool(lambda _bookie: {"shards": [{"host": "127.0.0.1", "port": 9}]})
        got: list[Any] = []
        pool.send("b1", int(Op.READ_ENTRY), 0, 7, 0, bytes(20), 0, b"", lambda ctx, resp, err: got.append(err), "ctx")
        await asyncio.sleep(0)
        (conn,) = pool._conns.values()
        connecting = conn._connecting
        assert connecting is not None and not connecting.done() and not got
        pool.close()
        await asyncio.sleep(0)
        return got, connecting

    got, connecting = asyncio.run(main())
    assert len(got) == 1 and isinstance(got[0], ClientClosedError)
    assert connecting.cancelled()


async def _request_in_flight() -> tuple[asyncio.AbstractServer, Any, list[Any]]:
    """A pool with one request sent over a connected connection to a server that reads and
    never answers; the list gets the request's error when it settles."""
    from bookkeeper.client.bookie_client import BookieClientPool

    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = BookieClientPool(lambda _bookie: {"shards": [{"host": "127.0.0.1", "port": port}]})
    got: list[Any] = []
    pool.send("b1", int(Op.READ_ENTRY), 0, 7, 0, bytes(20), 0, b"", lambda ctx, resp, err: got.append(err), "ctx")
    (conn,) = pool._conns.values()
    for _ in range(100):
        if conn.pipe.connected:
            break
        await asyncio.sleep(0.01)
    assert conn.pipe.connected and not got
    return server, pool, got


def test_closing_the_pool_fails_the_requests_in_flight_with_client_closed() -> None:
    """A request sent to a bookie that has not answered when the client closes fails with
    ClientClosedError (not retriable: its handle does not start an ensemble change while the
    client closes), not as a lost connection."""
    from bookkeeper.errors import ClientClosedError

    async def main() -> list[Any]:
        server, pool, got = await _request_in_flight()
        pool.close()
        server.close()
        return got

    got = asyncio.run(main())
    assert len(got) == 1 and isinstance(got[0], ClientClosedError), got


def test_dropping_connections_fails_their_requests_in_flight_as_retriable() -> None:
    """drop_connections() (the pool lives on): a request in flight on a dropped connection
    fails at once with a retriable BookieUnavailableError (before, it never settled: the
    transport's late close was no longer its connection's), and the next request connects anew."""
    from bookkeeper.errors import BookieUnavailableError, ClientClosedError

    async def main() -> tuple[list[Any], int]:
        server, pool, got = await _request_in_flight()
        pool.drop_connections()
        pool.send("b1", int(Op.READ_ENTRY), 0, 8, 0, bytes(20), 0, b"", lambda ctx, resp, err: None, "ctx")
        conns = len(pool._conns)
        pool.close()
        server.close()
        return got, conns

    got, conns = asyncio.run(main())
    assert len(got) == 1 and isinstance(got[0], BookieUnavailableError) and got[0].retriable, got
    assert not isinstance(got[0], ClientClosedError) and conns == 1
