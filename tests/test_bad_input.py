"""Bad input against a running bookie shard, over raw sockets (docs/design.md invariant 4).

Reference: docs/protocol.md / ext/bookkeeper/_ext/wire.pyx (frame layout) and
bookkeeper/bookie/server.py (dispatch). The contract exercised here:
  * a frame that can never parse (garbage, over max_frame_bytes, shorter than its
    header, unknown version) closes that connection, with no response bytes;
  * a well-formed frame with a bad op, key, ledger or shard gets an error status
    (UNKNOWN_OP, UNAUTHORIZED, BAD_REQUEST, NO_SUCH_LEDGER) and the connection keeps working;
  * an incomplete frame is buffered, not an error: the shard keeps serving others;
  * after every case the shard process is the same (same pid), a fresh client can still
    add and read on both shards, and entries written earlier read back byte-identical.

The frames are built and parsed here with `struct`, independently of the Cython codec.
"""
from __future__ import annotations

import random
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bookkeeper import BookKeeper, DigestType
from bookkeeper.client.digest import DigestManager, master_key
from bookkeeper.proto import DEFAULT_MAX_FRAME_BYTES, NO_KEY, Flag, Op, Status, shard_for_ledger
from bookkeeper.testing.cluster import LocalBookie, LocalCluster
from tests.conftest import run

# request  = u32 length | u8 version | u8 op | u16 flags | u64 request_id
#            | u64 ledger_id | i64 entry_id | 20 B master_key | u32 aux | payload
# response = u32 length | u8 version | u8 op | u16 status | u64 request_id
#            | u64 ledger_id | i64 entry_id | i64 lac | payload
REQ = struct.Struct(">IBBHQQq20sI")
RESP = struct.Struct(">IBBHQQqq")
ENTRY_HEADER = struct.Struct(">QqqQ")
BOOKIE_INFO = struct.Struct(">QQHH")
assert REQ.size == 56 and RESP.size == 40

PASSWORD = b"bad-input-secret"
KEY = master_key(PASSWORD)
WRONG_KEY = master_key(b"not-the-password")
SOCK_TIMEOUT_S = 5.0
UNKNOWN_LEDGER_BASE = 9_000_000_000


# -- raw wire helpers ----------------------------------------------------------------
def frame(op: int, ledger_id: int, entry_id: int, *, key: bytes = NO_KEY, flags: int = 0, request_id: int = 1,
          aux: int = 0, payload: bytes = b"", version: int = 1, length: int | None = None) -> bytes:
    """One request frame; `length` overrides the length field (what follows it)."""
    if length is None:
        length = REQ.size - 4 + len(payload)
    return REQ.pack(length, version, op, flags, request_id, ledger_id, entry_id, key, aux) + payload


@dataclass(frozen=True)
class Resp:
    op: int
    status: int
    request_id: int
    ledger_id: int
    entry_id: int
    lac: int
    payload: bytes


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=SOCK_TIMEOUT_S)
    s.settimeout(SOCK_TIMEOUT_S)
    return s


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AssertionError(f"connection closed after {len(buf)} of {n} bytes of a response")
        buf += chunk
    return bytes(buf)


def read_response(sock: socket.socket) -> Resp:
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    assert RESP.size - 4 <= length <= DEFAULT_MAX_FRAME_BYTES, length
    body = recv_exact(sock, length)
    _, version, op, status, rid, lid, eid, lac = RESP.unpack(struct.pack(">I", length) + body[:RESP.size - 4])
    assert version == 1
    return Resp(op, status, rid, lid, eid, lac, body[RESP.size - 4:])


def call(sock: socket.socket, request: bytes) -> Resp:
    sock.sendall(request)
    return read_response(sock)


def assert_closed_without_response(sock: socket.socket) -> None:
    """The peer closes the connection (FIN or RST) and sends no byte before doing so."""
    got = bytearray()
    deadline = time.monotonic() + SOCK_TIMEOUT_S
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except socket.timeout:
            raise AssertionError("the shard kept the connection open after an unparseable frame") from None
        if not chunk:
            break
        got += chunk
        assert time.monotonic() < deadline
    assert bytes(got) == b"", f"expected no response before the close, got {bytes(got)[:80]!r}"


def send_ignoring_close(sock: socket.socket, data: bytes) -> None:
    """sendall that tolerates the peer closing first (it may reject the frame on its header)."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


# -- the target: one shard of bookie 0 that owns a ledger written through the client ------------
@dataclass
class Target:
    cluster: LocalCluster
    bookie: LocalBookie
    shards: int
    shard: int              # the shard of `bookie` that owns `ledger_id`
    ledger_id: int
    payloads: list[bytes]
    supervisor_pid: int
    shard_pids: list[int]
    unknown_ledger: int     # a ledger id owned by `shard` that no one ever wrote

    @property
    def port(self) -> int:
        return self.bookie.port + self.shard

    @property
    def other_port(self) -> int:
        return self.bookie.port + (self.shard + 1) % self.shards

    @property
    def next_entry(self) -> int:
        return len(self.payloads)

    def entry_payload(self, entry_id: int, data: bytes, *, ledger_id: int | None = None) -> bytes:
        """A digest-framed entry as the client builds it (header + CRC32C + data)."""
        dm = DigestManager(self.ledger_id if ledger_id is None else ledger_id, DigestType.CRC32C, PASSWORD)
        return dm.encode(entry_id, self.next_entry - 1, sum(map(len, self.payloads)) + len(data), data)


def base_payloads() -> list[bytes]:
    rnd = random.Random(4)
    out = [b"", b"\x00", b"first entry", bytes(range(256)), b"\xff\xfe\xfd" * 100]
    out += [rnd.randbytes(n) for n in (1, 17, 1000, 4096, 65_536, 300_000)]
    out += [f"entry-{i}".encode() * (i + 1) for i in range(10)]
    return out


@pytest.fixture(scope="module")
def target(cluster5: LocalCluster) -> Iterator[Target]:
    payloads = base_payloads()
    shards = cluster5.shards

    async def write() -> int:
        async with await BookKeeper.connect(cluster5.metadata_uri) as bk:
            # E = Qw = Qa = 5: every bookie (so bookie 0 too) holds every entry when it is acknowledged.
            lh = await bk.create_ledger(ensemble=5, write_quorum=5, ack_quorum=5, digest=DigestType.CRC32C,
                                        password=PASSWORD)
            for p in payloads:
                await lh.add_entry(p)
            await lh.close()
            return lh.ledger_id
    ledger_id = run(write())
    bookie = cluster5.bookies[0]
    shard = shard_for_ledger(ledger_id, shards)
    unknown = next(lid for lid in range(UNKNOWN_LEDGER_BASE, UNKNOWN_LEDGER_BASE + 100)
                   if shard_for_ledger(lid, shards) == shard)
    assert bookie.pid is not None
    t = Target(cluster=cluster5, bookie=bookie, shards=shards, shard=shard, ledger_id=ledger_id, payloads=payloads,
               supervisor_pid=bookie.pid, shard_pids=[bookie.shard_pid(i) for i in range(shards)],
               unknown_ledger=unknown)
    yield t
    run(_delete(cluster5.metadata_uri, ledger_id))


async def _delete(uri: str, ledger_id: int) -> None:
    async with await BookKeeper.connect(uri) as bk:
        await bk.delete_ledger(ledger_id)


def assert_healthy(t: Target) -> None:
    """Same processes; a fresh client adds and reads on both shards; old entries are byte-identical."""
    assert t.bookie.pid == t.supervisor_pid, "the bookie supervisor changed"
    assert [t.bookie.shard_pid(i) for i in range(t.shards)] == t.shard_pids, "a shard process died or restarted"

    async def check() -> None:
        async with await BookKeeper.connect(t.cluster.metadata_uri, add_timeout_s=10.0, read_timeout_s=10.0) as bk:
            covered: set[int] = set()
            for _ in range(40):
                if len(covered) == t.shards:
                    break
                lh = await bk.create_ledger(ensemble=5, write_quorum=5, ack_quorum=5, password=b"health")
                shard = shard_for_ledger(lh.ledger_id, t.shards)
                if shard not in covered:
                    data = [b"health", bytes(range(256)) * 4, b"\x00\xff" * 7]
                    assert [await lh.add_entry(d) for d in data] == [0, 1, 2]
                    assert [e.data for e in await lh.read(0, 1)] == data[:2]
                    await lh.close()
                    rh = await bk.open_ledger(lh.ledger_id, password=b"health")
                    assert [e.data for e in await rh.read(0, 2)] == data
                    covered.add(shard)
                await bk.delete_ledger(lh.ledger_id)
            assert len(covered) == t.shards

            n = len(t.payloads)
            rh = await bk.open_ledger(t.ledger_id, password=PASSWORD, digest=DigestType.CRC32C)
            assert rh.last_add_confirmed == n - 1
            assert [e.data for e in await rh.read(0, n - 1)] == t.payloads
            # and straight from the shard under test, digest-verified
            dm = DigestManager(t.ledger_id, DigestType.CRC32C, PASSWORD)
            for eid, p in enumerate(t.payloads):
                resp = await bk.pool.call(t.bookie.bookie_id, Op.READ_ENTRY, 0, t.ledger_id, eid, NO_KEY)
                assert dm.verify(resp[6], eid)[0] == p, eid
            # nothing past the end was stored by a rejected request
            resp = await bk.pool.call(t.bookie.bookie_id, Op.READ_LAC, 0, t.ledger_id, -1, NO_KEY)
            assert resp[4] == n - 1, "the shard stored an entry past the ledger's end"
    run(check())


def assert_entry_absent(t: Target, entry_id: int) -> None:
    with connect(t.port) as s:
        r = call(s, frame(Op.READ_ENTRY, t.ledger_id, entry_id, request_id=5))
        assert (r.status, r.entry_id) == (Status.NO_SUCH_ENTRY, entry_id)


def assert_serves_reads(sock: socket.socket, t: Target, entry_id: int = 3, request_id: int = 4242) -> None:
    """This connection still answers: a read of a stored entry comes back OK and intact."""
    r = call(sock, frame(Op.READ_ENTRY, t.ledger_id, entry_id, request_id=request_id))
    assert (r.op, r.status, r.request_id, r.ledger_id, r.entry_id) == \
        (Op.READ_ENTRY, Status.OK, request_id, t.ledger_id, entry_id)
    dm = DigestManager(t.ledger_id, DigestType.CRC32C, PASSWORD)
    assert dm.verify(r.payload, entry_id)[0] == t.payloads[entry_id]


# -- frames that can never parse: the connection is closed -------------------------------------
GARBAGE = {
    "http-request": b"GET / HTTP/1.1\r\nHost: bookie\r\n\r\n",
    "all-ff": b"\xff" * 64,
    "all-zero": b"\x00" * 64,            # length 0: shorter than a header
    "short-length": struct.pack(">I", 10) + b"\x01" + b"x" * 60,
    "length-one-under-header": frame(Op.READ_ENTRY, 1, 0, length=REQ.size - 5),
    "bad-version": frame(Op.READ_ENTRY, 1, 0, version=2),
    "version-zero": frame(Op.ADD_ENTRY, 1, 0, version=0, payload=b"\x00" * 40),
    "random": random.Random(99).randbytes(4096),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_bytes_close_the_connection(target: Target, name: str) -> None:
    """Bytes that are not a frame: the shard closes that connection and answers nothing."""
    with connect(target.port) as s:
        send_ignoring_close(s, GARBAGE[name])
        assert_closed_without_response(s)
    assert_healthy(target)


def test_valid_frame_then_garbage_in_one_send_closes_the_connection(target: Target) -> None:
    """Garbage after a good frame still closes the connection (nothing is stored by the good add)."""
    scratch = next(lid for lid in range(target.unknown_ledger + 1, target.unknown_ledger + 100)
                   if shard_for_ledger(lid, target.shards) == target.shard)
    good = frame(Op.ADD_ENTRY, scratch, 0, key=KEY, payload=target.entry_payload(0, b"x", ledger_id=scratch))
    with connect(target.port) as s:
        send_ignoring_close(s, good + b"\xff" * 32)
        got = bytearray()
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    if got:  # the shard may have answered the good frame before it saw the garbage
        r = read_response_from_bytes(bytes(got))
        assert (r.request_id, r.status) == (1, Status.OK)
    else:  # the whole receive was dropped: the good add stored nothing
        with connect(target.port) as s:
            assert call(s, frame(Op.READ_LAC, scratch, -1)).status == Status.NO_SUCH_LEDGER
    assert_healthy(target)


def read_response_from_bytes(data: bytes) -> Resp:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        return read_response(b)


def test_frame_over_max_frame_bytes_closes_the_connection(target: Target) -> None:
    """A length field one byte over max_frame_bytes (5 MiB default) closes the connection at its header."""
    over = frame(Op.READ_ENTRY, target.ledger_id, 0, length=DEFAULT_MAX_FRAME_BYTES - 4 + 1)
    with connect(target.port) as s:
        send_ignoring_close(s, over + b"\x00" * 65_536)
        assert_closed_without_response(s)
    huge = frame(Op.ADD_ENTRY, target.ledger_id, target.next_entry, key=KEY, length=0xFFFFFFFF)
    with connect(target.port) as s:
        send_ignoring_close(s, huge)
        assert_closed_without_response(s)
    assert_healthy(target)


def test_frame_of_exactly_max_frame_bytes_is_served(target: Target) -> None:
    """The limit is inclusive: a frame of exactly max_frame_bytes is parsed and answered."""
    filler = b"\xab" * (DEFAULT_MAX_FRAME_BYTES - REQ.size)
    req = frame(Op.READ_ENTRY, target.unknown_ledger, 0, request_id=9, payload=filler)
    assert len(req) == DEFAULT_MAX_FRAME_BYTES
    with connect(target.port) as s:
        r = call(s, req)
        assert (r.status, r.request_id, r.ledger_id) == (Status.NO_SUCH_LEDGER, 9, target.unknown_ledger)
        assert_serves_reads(s, target)
    assert_healthy(target)


# -- incomplete frames: buffered, never an error -------------------------------------------------
@pytest.mark.parametrize("cut", [2, 30, REQ.size, REQ.size + 20, "all-but-one"])
def test_truncated_frame_then_close(target: Target, cut: int | str) -> None:
    """A frame cut short and the connection closed: nothing is stored, the shard carries on."""
    eid = target.next_entry + 3
    req = frame(Op.ADD_ENTRY, target.ledger_id, eid, key=KEY, payload=target.entry_payload(eid, b"z" * 500))
    n = len(req) - 1 if cut == "all-but-one" else int(cut)
    with connect(target.port) as s:
        s.sendall(req[:n])
        s.shutdown(socket.SHUT_WR)  # our EOF: the shard has read everything once it closes its side
        assert_closed_without_response(s)
    assert_entry_absent(target, eid)
    assert_healthy(target)


def test_truncated_frames_left_hanging_while_others_are_served(target: Target) -> None:
    """Connections stuck mid-frame do not block other clients; completing a frame later gets its answer."""
    reqs = []
    for i in range(20):
        eid = i % len(target.payloads)
        reqs.append((eid, frame(Op.READ_ENTRY, target.ledger_id, eid, request_id=1000 + i)))
    # one more declaring a 4 MiB frame (legal) of which only a few KiB arrive for now
    big_filler = b"\x5a" * (4 * 1024 * 1024)
    reqs.append((2, frame(Op.READ_ENTRY, target.ledger_id, 2, request_id=2000, payload=big_filler)))
    cuts = [1 + (i * 7) % (REQ.size - 1) for i in range(20)] + [REQ.size + 4096]
    hanging = [connect(target.port) for _ in reqs]
    try:
        for s, (_, req), cut in zip(hanging, reqs, cuts):
            s.sendall(req[:cut])
        time.sleep(0.1)
        # everyone else is served meanwhile: a raw client and the normal client
        with connect(target.port) as other:
            assert_serves_reads(other, target)
            r = call(other, frame(Op.GET_BOOKIE_INFO, 0, 0, request_id=3))
            assert r.status == Status.OK
        assert_healthy(target)
        # the stuck connections got nothing and are still open ...
        for s in hanging:
            s.settimeout(0.05)
            with pytest.raises(socket.timeout):
                s.recv(1)
            s.settimeout(SOCK_TIMEOUT_S)
        # ... and once their frames are complete they are answered
        dm = DigestManager(target.ledger_id, DigestType.CRC32C, PASSWORD)
        for s, (eid, req), cut in zip(hanging, reqs, cuts):
            s.sendall(req[cut:])
            r = read_response(s)
            assert (r.status, r.entry_id) == (Status.OK, eid)
            assert dm.verify(r.payload, eid)[0] == target.payloads[eid]
    finally:
        for s in hanging:
            s.close()
    assert_healthy(target)


# -- well-formed frames with bad content: an error status, the connection keeps working ----------
@pytest.mark.parametrize("op", [99, 0, 255])
def test_unknown_op_gets_unknown_op_and_the_connection_keeps_working(target: Target, op: int) -> None:
    with connect(target.port) as s:
        r = call(s, frame(op, target.ledger_id, 0, request_id=77))
        assert (r.op, r.status, r.request_id, r.ledger_id) == (op, Status.UNKNOWN_OP, 77, target.ledger_id)
        assert r.payload == b""
        assert_serves_reads(s, target)
        r = call(s, frame(Op.GET_BOOKIE_INFO, 0, 0, request_id=78))
        assert (r.status, r.request_id) == (Status.OK, 78)
        _, _, shard_index, shards = BOOKIE_INFO.unpack(r.payload)
        assert (shard_index, shards) == (target.shard, target.shards)
        # pipelined in one send: an unknown op between two good reads; answers in order
        s.sendall(frame(Op.READ_ENTRY, target.ledger_id, 1, request_id=80) + frame(op, 1, 1, request_id=81)
                  + frame(Op.READ_ENTRY, target.ledger_id, 2, request_id=82))
        got = [read_response(s) for _ in range(3)]
        assert [(x.request_id, x.status) for x in got] == [(80, Status.OK), (81, Status.UNKNOWN_OP), (82, Status.OK)]
    assert_healthy(target)


@pytest.mark.parametrize("key", [WRONG_KEY, NO_KEY], ids=["wrong-key", "no-key"])
def test_add_with_wrong_master_key_is_unauthorized(target: Target, key: bytes) -> None:
    """An add to an existing ledger with another master key: UNAUTHORIZED, and nothing is stored."""
    new = target.next_entry
    with connect(target.port) as s:
        r = call(s, frame(Op.ADD_ENTRY, target.ledger_id, new, key=key, request_id=11,
                          payload=target.entry_payload(new, b"intruder")))
        assert (r.op, r.status, r.request_id, r.entry_id) == (Op.ADD_ENTRY, Status.UNAUTHORIZED, 11, new)
        # overwriting an existing entry is refused just the same
        r = call(s, frame(Op.ADD_ENTRY, target.ledger_id, 0, key=key, request_id=12,
                          payload=target.entry_payload(0, b"overwrite")))
        assert (r.status, r.request_id) == (Status.UNAUTHORIZED, 12)
        # ... also as a recovery add
        r = call(s, frame(Op.ADD_ENTRY, target.ledger_id, new, key=key, flags=Flag.RECOVERY_ADD, request_id=13,
                          payload=target.entry_payload(new, b"intruder")))
        assert (r.status, r.request_id) == (Status.UNAUTHORIZED, 13)
        assert_serves_reads(s, target)
    assert_entry_absent(target, new)
    assert_healthy(target)


@pytest.mark.parametrize("op", [Op.READ_LAC, Op.READ_ENTRY], ids=["read-lac", "read-entry"])
def test_fence_with_wrong_master_key_is_unauthorized_and_fences_nothing(target: Target, op: Op) -> None:
    """A fencing read with the wrong key is refused; the writer (Qa = E = 5) can still add."""
    async def main() -> None:
        async with await BookKeeper.connect(target.cluster.metadata_uri) as bk:
            for _ in range(40):
                lh = await bk.create_ledger(ensemble=5, write_quorum=5, ack_quorum=5, password=PASSWORD)
                if shard_for_ledger(lh.ledger_id, target.shards) == target.shard:
                    break
                await bk.delete_ledger(lh.ledger_id)
            try:
                await lh.add_entry(b"before")
                with connect(target.port) as s:
                    r = call(s, frame(op, lh.ledger_id, 0, key=WRONG_KEY, flags=Flag.FENCE, request_id=21))
                    assert (r.status, r.request_id) == (Status.UNAUTHORIZED, 21)
                    r = call(s, frame(op, lh.ledger_id, 0, key=NO_KEY, flags=Flag.FENCE, request_id=22))
                    assert (r.status, r.request_id) == (Status.UNAUTHORIZED, 22)
                assert await lh.add_entry(b"after") == 1  # would fail FENCED had bookie 0 been fenced
                await lh.close()
                rh = await bk.open_ledger(lh.ledger_id, password=PASSWORD)
                assert [e.data for e in await rh.read(0, 1)] == [b"before", b"after"]
            finally:
                await bk.delete_ledger(lh.ledger_id)
    run(main())
    assert_healthy(target)


def _mismatched_adds(t: Target) -> dict[str, tuple[int, bytes]]:
    """(frame entry id, payload) pairs whose payload does not match the frame."""
    new = t.next_entry
    return {
        "other-ledger-in-payload": (new, t.entry_payload(new, b"data", ledger_id=t.ledger_id + 1)),
        "other-entry-in-payload": (new, t.entry_payload(new + 1, b"data")),
        "existing-entry-in-payload": (new, t.entry_payload(0, b"data")),
        "payload-shorter-than-entry-header": (new, ENTRY_HEADER.pack(t.ledger_id, new, -1, 0)[:31]),
        "empty-payload": (new, b""),
        "negative-entry-id": (-5, t.entry_payload(-5, b"data")),
    }


@pytest.mark.parametrize("case", ["other-ledger-in-payload", "other-entry-in-payload", "existing-entry-in-payload",
                                  "payload-shorter-than-entry-header", "empty-payload", "negative-entry-id"])
def test_add_whose_payload_names_another_entry_is_bad_request(target: Target, case: str) -> None:
    eid, payload = _mismatched_adds(target)[case]
    with connect(target.port) as s:
        for flags, rid in ((0, 31), (Flag.RECOVERY_ADD, 32)):
            r = call(s, frame(Op.ADD_ENTRY, target.ledger_id, eid, key=KEY, flags=flags, request_id=rid,
                              payload=payload))
            assert (r.op, r.status, r.request_id, r.ledger_id, r.entry_id) == \
                (Op.ADD_ENTRY, Status.BAD_REQUEST, rid, target.ledger_id, eid)
        assert_serves_reads(s, target)
    assert_entry_absent(target, target.next_entry)
    assert_entry_absent(target, target.next_entry + 1)
    assert_healthy(target)


def test_read_of_unknown_ledger_is_no_such_ledger(target: Target) -> None:
    lid = target.unknown_ledger
    with connect(target.port) as s:
        r = call(s, frame(Op.READ_ENTRY, lid, 0, request_id=41))
        assert (r.op, r.status, r.request_id, r.ledger_id, r.entry_id) == \
            (Op.READ_ENTRY, Status.NO_SUCH_LEDGER, 41, lid, 0)
        r = call(s, frame(Op.READ_LAC, lid, -1, request_id=42))
        assert (r.op, r.status, r.request_id) == (Op.READ_LAC, Status.NO_SUCH_LEDGER, 42)
        # a long-poll read waits for the ledger to appear (a tailer may start first), then
        # answers NO_SUCH_LEDGER when its wait ends
        r = call(s, frame(Op.READ_ENTRY, lid, 0, flags=Flag.LONG_POLL, aux=300, request_id=43))
        assert (r.status, r.request_id) == (Status.NO_SUCH_LEDGER, 43)
        # a known ledger, an entry it does not have
        r = call(s, frame(Op.READ_ENTRY, target.ledger_id, target.next_entry + 50, request_id=44))
        assert (r.status, r.request_id) == (Status.NO_SUCH_ENTRY, 44)
        assert_serves_reads(s, target)
    # the reads created nothing: the ledger is still unknown
    with connect(target.port) as s:
        assert call(s, frame(Op.READ_LAC, lid, -1)).status == Status.NO_SUCH_LEDGER
    assert_healthy(target)


def test_request_to_the_wrong_shard_is_bad_request(target: Target) -> None:
    """Every op for a ledger the shard does not own is refused; nothing is stored or fenced there."""
    lid, new = target.ledger_id, target.next_entry
    requests = {
        51: frame(Op.READ_ENTRY, lid, 0, request_id=51),
        52: frame(Op.READ_LAC, lid, -1, request_id=52),
        53: frame(Op.ADD_ENTRY, lid, new, key=KEY, request_id=53, payload=target.entry_payload(new, b"misrouted")),
        54: frame(Op.ADD_ENTRY, lid, new, key=KEY, flags=Flag.RECOVERY_ADD, request_id=54,
                  payload=target.entry_payload(new, b"misrouted")),
        55: frame(Op.READ_ENTRY, lid, 0, key=KEY, flags=Flag.FENCE, request_id=55),
        56: frame(Op.READ_LAC, lid, -1, key=KEY, flags=Flag.FENCE, request_id=56),
        57: frame(Op.READ_ENTRY, lid, new, flags=Flag.LONG_POLL, aux=3000, request_id=57),
    }
    with connect(target.other_port) as s:
        for rid, req in requests.items():
            t0 = time.monotonic()
            r = call(s, req)
            assert (r.status, r.request_id, r.ledger_id) == (Status.BAD_REQUEST, rid, lid), r
            assert time.monotonic() - t0 < 2.0, "a misrouted long poll was parked instead of refused"
        # the connection keeps working: the other shard identifies itself
        r = call(s, frame(Op.GET_BOOKIE_INFO, 0, 0, request_id=58))
        assert (r.status, r.request_id) == (Status.OK, 58)
        assert BOOKIE_INFO.unpack(r.payload)[2:] == ((target.shard + 1) % target.shards, target.shards)
    # the misrouted add reached no shard; the owning shard still serves on a new connection
    assert_entry_absent(target, new)
    with connect(target.port) as s:
        assert_serves_reads(s, target)
    assert_healthy(target)


# -- a ledger id that no metadata can name must not poison the shard ------------------------------
def test_add_for_a_ledger_id_without_possible_metadata_does_not_stop_garbage_collection(make_cluster) -> None:
    """An add (or fence) for a ledger id outside the metadata id space (>= 10**10, up to 2**64-1) is either
    refused with an error status or accepted, but the shard goes on garbage-collecting deleted ledgers."""
    import asyncio

    from bookkeeper import errors

    cluster: LocalCluster = make_cluster(bookies=1, shards=1, bookie_conf={"gc_interval_s": 0.3})
    bookie = cluster.bookies[0]
    shard_pid = bookie.shard_pid(0)
    with connect(bookie.port) as s:
        for rid, lid in enumerate((10**10, 2**64 - 1), start=1):
            payload = DigestManager(lid, DigestType.CRC32C, PASSWORD).encode(0, -1, 1, b"x")
            r = call(s, frame(Op.ADD_ENTRY, lid, 0, key=KEY, request_id=rid, payload=payload))
            assert r.request_id == rid and r.status in (Status.OK, Status.BAD_REQUEST, Status.NO_SUCH_LEDGER), r
        r = call(s, frame(Op.READ_LAC, 2**63, -1, key=KEY, flags=Flag.FENCE, request_id=9))
        assert r.request_id == 9

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as bk:
            lh = await bk.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1, password=b"g")
            for i in range(5):
                await lh.add_entry(b"%d" % i)
            await lh.close()
            await bk.pool.call(bookie.bookie_id, Op.READ_ENTRY, 0, lh.ledger_id, 1, NO_KEY)
            await bk.delete_ledger(lh.ledger_id)
            for _ in range(100):
                try:
                    await bk.pool.call(bookie.bookie_id, Op.READ_ENTRY, 0, lh.ledger_id, 1, NO_KEY)
                except errors.NoSuchLedgerError:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("the deleted ledger is still stored 10 s after its deletion: garbage collection "
                                 "stopped after an add for an out-of-range ledger id\n" + bookie.log_tail(12))
    run(main())
    assert bookie.shard_pid(0) == shard_pid
