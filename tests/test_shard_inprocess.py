"""A shard driven in-process through the real ShardServer, Journal and LedgerStorage, with a
journal device whose syncs complete when the test says so: its memory bounds (it stops reading
from its senders while the journal's filling batch is full or the write cache is over
write_cache_max_bytes, docs/journal.md) and when parked long polls are answered."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import uvloop

from bookkeeper.bookie.journal import Journal
from bookkeeper.bookie.server import BookieProtocol, ShardServer
from bookkeeper.bookie.storage import LedgerStorage
from bookkeeper.bookie.storage.ledger_storage import ENTRY_OVERHEAD_BYTES
from bookkeeper.client.digest import DigestManager, master_key
from bookkeeper.meta.ledger_metadata import DigestType
from bookkeeper.proto import Flag, Op, Status, encode_request, parse_responses
from bookkeeper.testing.syncers import ManualSyncer

KEY = master_key(b"bp")


class Socket(asyncio.Transport):
    """Records whether the server wants to read from this sender; what `send` gives it while
    it is paused waits, and is delivered on the loop's next turn after it resumes (as a
    socket's kernel buffer would)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.received = bytearray()
        self.conn: BookieProtocol | None = None
        self.waiting: list[bytes] = []

    def send(self, data: bytes) -> None:
        """The peer sends data: read now if the server reads this sender, else queued."""
        assert self.conn is not None
        if self.reading and not self.waiting:
            self.conn.data_received(data)
        else:
            self.waiting.append(data)

    def _deliver(self) -> None:
        while self.reading and self.waiting and self.conn is not None:
            self.conn.data_received(self.waiting.pop(0))

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.received += data

    def responses(self) -> list[tuple]:
        frames, _ = parse_responses(bytes(self.received), 5 << 20)
        return frames

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
        if self.waiting:
            asyncio.get_running_loop().call_soon(self._deliver)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def adds(ledger_id: int, first: int, n: int, size: int) -> bytes:
    dm = DigestManager(ledger_id, DigestType.CRC32C, b"bp")
    return b"".join(encode_request(Op.ADD_ENTRY, 0, e + 1, ledger_id, e, KEY, 0,
                                   dm.encode(e, e - 1, (e + 1) * size, bytes(size)))
                    for e in range(first, first + n))


def shard(tmp: Path, journal_kw: dict[str, Any] | None = None,
          **server_kw: Any) -> tuple[ShardServer, Journal, ManualSyncer, BookieProtocol, Socket]:
    loop = asyncio.get_running_loop()
    storage = LedgerStorage(tmp / "ledgers")
    server = ShardServer(storage=storage, shard_index=0, shards=1, max_frame_bytes=5 << 20, readonly=False,
                         data_dir=str(tmp), **server_kw)
    syncer = ManualSyncer()
    journal = Journal(tmp / "journal", syncer=syncer, loop=loop, on_durable=server.on_durable,
                      on_failed=server.on_failed, **{"preallocate_bytes": 1 << 20, "batch_entries_max": 50,
                                                     **(journal_kw or {})})
    journal.start()
    server.journal = journal
    conn, sock = connect(server)
    return server, journal, syncer, conn, sock


def connect(server: ShardServer) -> tuple[BookieProtocol, Socket]:
    """A connection to the shard, its socket delivering to it."""
    conn, sock = BookieProtocol(server), Socket()
    conn.connection_made(sock)
    sock.conn = conn
    return conn, sock


def test_full_journal_batch_pauses_the_sender_until_the_sync_returns(tmp_path: Path) -> None:
    """Behind a sync in flight, a batch reaching batch_entries_max pauses reading; the sync's
    return flushes that batch and resumes the sender."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        conn.data_received(adds(2, 0, 10, 100))
        await asyncio.sleep(0)  # the first flush, at the end of the loop turn: a sync now in flight
        assert sock.reading and syncer.pending
        conn.data_received(adds(2, 10, 60, 100))  # 60 records (+ the master key) behind it
        assert journal.full and not sock.reading
        syncer.release_all()
        assert not journal.full and sock.reading
        syncer.release_all()
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_a_light_sender_is_read_on_while_a_bulk_sender_fills_the_journal(tmp_path: Path) -> None:
    """Fair shares (issue 28 item 4): behind a sync in flight, a bulk sender fills the batch and
    is paused; a sender with a few C-path adds waiting (<= LIGHT_SENDER_ADDS) in small receive
    buffers is read on, and its adds go into the next block with the bulk ones: answered at
    the second sync's return (paused, the second and third would wait for the third). Past
    that many adds waiting, or with a Python-path reply waiting (a ledger's first add, a
    fence), it is paused like any other."""
    from bookkeeper.bookie.server import LIGHT_SENDER_ADDS

    async def main() -> None:
        server, journal, syncer, bulk, bulk_sock = shard(tmp_path)
        light, light_sock = connect(server)
        light_sock.send(adds(3, 0, 1, 100))  # the ledger's first add: the Python path
        await asyncio.sleep(0)
        syncer.release_all()
        assert len(light_sock.responses()) == 1 and light.journal_waiting == 0
        bulk.data_received(adds(2, 0, 10, 100))
        await asyncio.sleep(0)  # a sync in flight
        bulk.data_received(adds(2, 10, 60, 100))
        assert journal.full and not bulk_sock.reading
        for e in range(1, 4):  # one add at a time, as a W=1 writer sends them
            light_sock.send(adds(3, e, 1, 100))
        assert light_sock.reading and not light_sock.waiting
        assert server.counters["light_senders_read_on"] == 3
        syncer.complete_one()  # the first block durable; the next one, with both senders' adds, sealed
        assert len(light_sock.responses()) == 1 and bulk_sock.reading
        syncer.complete_one()
        assert [r[4] for r in light_sock.responses()] == [0, 1, 2, 3]
        bulk.data_received(adds(2, 70, 1, 100))
        await asyncio.sleep(0)  # a sync in flight again
        bulk.data_received(adds(2, 71, 60, 100))  # full again
        assert journal.full and not bulk_sock.reading
        light_sock.send(adds(3, 4, LIGHT_SENDER_ADDS + 1, 100))  # too many waiting: no longer light
        assert not light_sock.reading
        syncer.release_all()
        await asyncio.sleep(0)
        syncer.release_all()
        assert light_sock.reading and bulk_sock.reading
        fence = encode_request(Op.READ_LAC, int(Flag.FENCE), 99, 5, -1, KEY, 0, b"")
        bulk.data_received(adds(2, 200, 1, 100))
        await asyncio.sleep(0)  # a sync in flight again
        bulk.data_received(adds(2, 201, 60, 100))
        light_sock.send(fence)  # its reply waits in the journal: the sender is no longer light
        assert light.journal_waiting == 1 and not light_sock.reading
        syncer.release_all()
        await asyncio.sleep(0)
        syncer.release_all()
        assert light.journal_waiting == 0 and light_sock.reading
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_a_light_senders_add_waits_for_one_bounded_block_not_for_the_bulk_queued_before_it(tmp_path: Path) -> None:
    """Issue 28 item 3: behind a sync in flight, a bulk sender's receive buffers are cut into
    blocks of at most journal_max_block_bytes (plus one frame), even within one buffer; a
    light sender's add goes into the next block to be written, so it is answered at the
    second sync's return while the bulk's later blocks still wait. Its next add, sent while
    its first is in that block, goes there too; a sender that was heavy (its adds in the
    last block) is never put before its own adds: its answers come in the order it sent."""
    block = 16 << 10

    async def main() -> None:
        server, journal, syncer, bulk, bulk_sock = shard(
            tmp_path, {"batch_entries_max": 65536, "batch_bytes_max": 4 << 20, "block_bytes_max": block})
        light, light_sock = connect(server)
        light_sock.send(adds(3, 0, 1, 100))  # the ledger's first add: the Python path
        await asyncio.sleep(0)
        syncer.release_all()
        assert len(light_sock.responses()) == 1
        bulk.data_received(adds(2, 0, 1, 100))
        await asyncio.sleep(0)
        assert len(syncer.pending) == 1  # a sync in flight
        syncer.release_all()
        bulk.data_received(adds(2, 1, 1, 100))
        await asyncio.sleep(0)  # a sync in flight again
        blocks_before = journal.stats["blocks"]
        bulk.data_received(adds(2, 2, 100, 1000))  # ~100 KiB in one receive buffer
        light_sock.send(adds(3, 1, 1, 100))
        assert journal.queued_bytes > 6 * block
        syncer.complete_one()  # the block in flight durable: the next one written
        syncer.complete_one()  # ... and durable: it held the light sender's add
        assert [r[4] for r in light_sock.responses()] == [0, 1]
        assert journal.stats["blocks"] == blocks_before + 2  # its block, and a bulk one now in flight
        assert journal.durable_block[3] <= block + 4096 + 1100  # the bound, the frame over it, padding
        bulk_answered = len(bulk_sock.responses())
        assert bulk_answered < 2 + 100  # the bulk's later blocks still wait
        # The light connection sends a heavy buffer (two adds of 40 KiB, over LIGHT_SENDER_BYTES):
        # they go to the last block. Its next add (light again) may not pass them: put in the
        # next block, it would be durable first, and its answer would send theirs.
        light_sock.send(adds(3, 2, 2, 40_000))
        light_sock.send(adds(3, 4, 1, 100))
        syncer.complete_one()
        syncer.complete_one()  # two more bulk blocks durable: none of the light sender's adds in them
        assert len(light_sock.responses()) == 2
        syncer.release_all()
        await asyncio.sleep(0)
        syncer.release_all()
        assert [r[4] for r in light_sock.responses()] == list(range(5))
        assert [r[4] for r in bulk_sock.responses()] == list(range(102))
        assert all(r[1] == Status.OK for r in light_sock.responses() + bulk_sock.responses())
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_a_second_bulk_sender_gets_its_share_of_a_journal_the_first_one_filled(tmp_path: Path) -> None:
    """Issue 28 item 4: a bulk sender fills the journal alone and is paused; a second bulk
    sender (receive buffers too big to be light) is read on while it holds under half of
    journal_max_batch_bytes of the records not yet durable, then paused too; both are read
    again once the journal drains, and every add is answered in order."""
    async def main() -> None:
        server, journal, syncer, a, a_sock = shard(
            tmp_path, {"batch_entries_max": 65536, "batch_bytes_max": 256 << 10, "block_bytes_max": 16 << 10})
        b, b_sock = connect(server)
        a_sock.send(adds(2, 0, 1, 100))  # each ledger's first add: the Python path
        b_sock.send(adds(3, 0, 1, 100))
        await asyncio.sleep(0)
        syncer.release_all()
        a_sock.send(adds(2, 1, 1, 100))
        await asyncio.sleep(0)  # a sync in flight
        a_sock.send(adds(2, 2, 300, 1000))
        assert journal.full and not a_sock.reading and a.journal_bytes > 128 << 10
        b_sock.send(adds(3, 1, 70, 1000))  # not light (70 KiB), but under its share: read on
        assert b_sock.reading and server.counters["share_read_on"] == 1
        b_sock.send(adds(3, 71, 70, 1000))  # now past it: paused like the first
        assert not b_sock.reading and b.journal_bytes > 128 << 10
        for _ in range(5):
            syncer.release_all()
            await asyncio.sleep(0)
        assert a_sock.reading and b_sock.reading
        assert [r[4] for r in a_sock.responses()] == list(range(302))
        assert [r[4] for r in b_sock.responses()] == list(range(141))
        assert a.journal_bytes == 0 and b.journal_bytes == 0
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_a_sender_paused_past_its_share_is_read_again_once_under_it_though_the_journal_stays_full(
        tmp_path: Path) -> None:
    """Senders under their share may keep the journal full; one paused past its share is read
    again as soon as its own records are durable (not only once the journal drains, which
    they could put off for ever)."""
    async def main() -> None:
        server, journal, syncer, a, a_sock = shard(
            tmp_path, {"batch_entries_max": 65536, "batch_bytes_max": 256 << 10, "block_bytes_max": 16 << 10})
        others = []
        for ledger in (3, 4):
            conn, sock = connect(server)
            others.append((conn, sock, ledger))
            sock.send(adds(ledger, 0, 1, 100))
        a_sock.send(adds(2, 0, 1, 100))
        await asyncio.sleep(0)
        syncer.release_all()
        a_sock.send(adds(2, 1, 1, 100))
        await asyncio.sleep(0)  # a sync in flight
        a_sock.send(adds(2, 2, 150, 1000))  # past its share; the journal is not full yet
        await asyncio.sleep(0)  # its read slice ends: read again
        for conn, sock, ledger in others:  # 120 KiB each, under their share, in buffers read whole
            sock.send(adds(ledger, 1, 60, 1000))
            sock.send(adds(ledger, 61, 60, 1000))
        a_sock.send(adds(2, 152, 1, 100))
        assert journal.full and not a_sock.reading and a in server.paused
        sent = {3: 121, 4: 121}
        while a.journal_bytes >= 128 << 10:
            syncer.complete_one()
            for conn, sock, ledger in others:  # the others keep the journal full, under their share
                if conn.journal_bytes < 100 << 10:
                    sock.send(adds(ledger, sent[ledger], 20, 1000))
                    sent[ledger] += 20
        assert journal.full and a_sock.reading
        for _ in range(200):
            if not syncer.pending and journal.idle:
                break
            syncer.release_all()
            await asyncio.sleep(0)
        assert [r[4] for r in a_sock.responses()] == list(range(153))
        for conn, sock, ledger in others:
            assert [r[4] for r in sock.responses()] == list(range(sent[ledger]))
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_a_light_senders_add_and_fence_of_a_new_ledger_replay_after_its_master_key(tmp_path: Path) -> None:
    """A heavy sender creates ledger 5 while blocks wait (its add in the last block); a light
    sender's add and fencing read of ledger 5 go to the first block. Replay drops records of a
    ledger it has not seen created, so the master key must be in that block or before it:
    replayed into fresh storage, the ledger is fenced and holds both entries."""
    from bookkeeper.bookie.shard import apply_records

    async def main() -> None:
        server, journal, syncer, bulk, bulk_sock = shard(
            tmp_path, {"batch_entries_max": 65536, "batch_bytes_max": 4 << 20, "block_bytes_max": 16 << 10})
        light, light_sock = connect(server)
        bulk.data_received(adds(2, 0, 1, 100))
        await asyncio.sleep(0)  # a sync in flight
        bulk.data_received(adds(2, 1, 100, 1000))  # blocks wait behind it
        bulk.data_received(adds(5, 0, 1, 100))  # ledger 5 created by a heavy sender: to the last block
        light_sock.send(adds(5, 1, 1, 100))
        light_sock.send(encode_request(Op.READ_LAC, int(Flag.FENCE), 77, 5, -1, KEY, 0, b""))
        syncer.release_all()
        await asyncio.sleep(0)
        syncer.release_all()
        assert [(r[1], r[4]) for r in light_sock.responses()][:1] == [(Status.OK, 1)]
        journal.close()
        server.storage.close()
        storage = LedgerStorage(tmp_path / "replayed")
        replayer = Journal(tmp_path / "journal", syncer=ManualSyncer(), loop=asyncio.get_running_loop(),
                           on_durable=lambda items: None, on_failed=lambda items, err: None)
        replayer.replay((0, 0), lambda records: apply_records(storage, records))
        replayer.close()
        st = storage.ledger(5)
        assert st is not None and st.fenced
        assert storage.get_entry(5, 0) is not None and storage.get_entry(5, 1) is not None
        storage.close()

    uvloop.run(main())


def test_a_bulk_connection_is_dispatched_in_slices_between_turns_of_the_loop(tmp_path: Path) -> None:
    """Issue 28 item 2: over a real socket, 8 MB of adds that arrived while the loop was busy
    are not dispatched in one turn (the loop reads a connection up to 32 times in a row while
    each read fills its buffer): at most READ_SLICE_BYTES and one read of it run between two
    turns, and a second connection's add is dispatched while most of the bulk still waits."""
    import socket
    import threading
    import time

    from bookkeeper.bookie.server import READ_SLICE_BYTES

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server, journal, _syncer, _conn, _sock = shard(
            tmp_path, {"batch_bytes_max": 256 << 20, "batch_entries_max": 1 << 20},
            write_cache_max_bytes=1 << 30)
        events: list[tuple[str, int]] = []
        add_path = server.add_path

        class Counting:
            def dispatch(self, conn: Any, out: bytearray, buf: Any, now: float) -> Any:
                events.append((conn.name, len(buf)))
                return add_path.dispatch(conn, out, buf, now)

        server.add_path = Counting()  # type: ignore[assignment]
        names = iter(["bulk", "light"])

        def protocol() -> BookieProtocol:
            conn = BookieProtocol(server)
            conn.name = next(names)  # type: ignore[attr-defined]
            return conn

        srv = await loop.create_server(protocol, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        bulk, light = socket.socket(), socket.socket()
        bulk.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
        bulk.connect(("127.0.0.1", port))
        light.connect(("127.0.0.1", port))
        bulk.sendall(adds(2, 0, 1, 100))
        light.sendall(adds(3, 0, 1, 100))
        while len({name for name, _ in events}) < 2:
            await asyncio.sleep(0.01)
        data = adds(2, 1, 8000, 1000)
        sender = threading.Thread(target=bulk.sendall, args=(data,))
        sender.start()
        time.sleep(0.5)  # a busy turn of the loop: the bulk's bytes wait in the socket
        light.sendall(adds(3, 1, 1, 100))
        events.append(("turn", 0))

        def turn() -> None:
            events.append(("turn", 0))
            if sum(n for name, n in events if name == "bulk") < len(data) and len(events) < 100_000:
                loop.call_soon(turn)

        loop.call_soon(turn)
        for _ in range(1000):
            if sum(n for name, n in events if name == "bulk") >= len(data) - 2000:
                break
            await asyncio.sleep(0.01)
        sender.join()
        per_turn, longest, light_at = 0, 0, None
        bulk_seen = 0
        for name, n in events:
            if name == "turn":
                per_turn = 0
            elif name == "bulk":
                per_turn += n
                bulk_seen += n
                longest = max(longest, per_turn)
            elif light_at is None and bulk_seen > 1000:
                light_at = bulk_seen
        assert bulk_seen >= len(data) - 2000
        assert longest <= READ_SLICE_BYTES + 256_000, longest
        assert light_at is not None and light_at < len(data) // 2, (light_at, len(data))
        bulk.close()
        light.close()
        srv.close()
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_write_cache_over_its_bound_pauses_the_sender_until_it_is_swapped_out(tmp_path: Path) -> None:
    """With the write cache over write_cache_max_bytes (overhead counted) the sender is paused;
    a checkpoint's snapshot empties the cache and release_backpressure resumes it."""

    async def main() -> None:
        bound = 20 * (132 + ENTRY_OVERHEAD_BYTES)
        server, journal, syncer, conn, sock = shard(tmp_path, write_cache_max_bytes=bound)
        conn.data_received(adds(4, 0, 10, 100))
        await asyncio.sleep(0)
        syncer.release_all()
        assert sock.reading and server.storage.write_cache_bytes <= bound
        conn.data_received(adds(4, 10, 15, 100))  # a light sender's few adds: the cache bound holds it too
        await asyncio.sleep(0)
        syncer.release_all()
        assert server.storage.write_cache_bytes > bound and not sock.reading
        server.release_backpressure()
        assert not sock.reading  # still over: nothing was swapped out
        server.storage.snapshot()
        server.release_backpressure()
        assert sock.reading
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_parked_long_poll_is_answered_when_a_covering_lac_arrives_not_when_it_is_durable(tmp_path: Path) -> None:
    """A long poll parks until the shard's LAC covers its entry; the add whose piggybacked LAC
    covers it answers the poll on arrival, before that add's own sync returns (the LAC already
    says the entry is acknowledged), while that add itself is answered only once durable."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        conn.data_received(adds(6, 0, 1, 10))  # entry 0 carries LAC -1
        await asyncio.sleep(0)
        syncer.release_all()
        poll = encode_request(Op.READ_ENTRY, Flag.LONG_POLL, 99, 6, 0, KEY, 5000, b"")
        conn.data_received(poll)
        assert [r for r in sock.responses() if r[2] == 99] == []  # LAC -1 does not cover entry 0: parked
        conn.data_received(adds(6, 1, 1, 10))  # entry 1 carries LAC 0
        answered = [r for r in sock.responses() if r[2] == 99]
        assert [(r[0], r[1], r[4], r[5]) for r in answered] == [(Op.READ_ENTRY, Status.OK, 0, 0)]
        assert not [r for r in sock.responses() if r[0] == Op.ADD_ENTRY and r[4] == 1]  # not durable yet
        await asyncio.sleep(0)
        syncer.release_all()
        assert [r for r in sock.responses() if r[0] == Op.ADD_ENTRY and r[4] == 1]
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_write_lac_answers_a_parked_long_poll_and_is_refused_to_all_but_the_writer(tmp_path: Path) -> None:
    """WRITE_LAC (an idle writer's explicit LAC) raises the shard's LAC at once, without a journal
    record, and answers the long poll it now covers; a lower LAC is taken as a no-op; a wrong or
    missing key, an unknown ledger, a negative LAC and a fenced ledger are refused."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        conn.data_received(adds(6, 0, 2, 10))  # entries 0, 1: the shard's LAC is 0 (piggybacked by 1)
        await asyncio.sleep(0)
        syncer.release_all()
        conn.data_received(encode_request(Op.READ_ENTRY, Flag.LONG_POLL, 99, 6, 1, KEY, 5000, b""))
        assert [r for r in sock.responses() if r[2] == 99] == []  # LAC 0 does not cover entry 1: parked
        queued = journal.queued_bytes

        def ask(req_id: int, ledger_id: int, lac: int, key: bytes = KEY) -> tuple:
            conn.data_received(encode_request(Op.WRITE_LAC, 0, req_id, ledger_id, lac, key, 0, b""))
            return next((r[1], r[5]) for r in sock.responses() if r[2] == req_id)

        assert ask(100, 6, 1) == (Status.OK, 1)
        answered = [r for r in sock.responses() if r[2] == 99]
        assert [(r[1], r[4], r[5]) for r in answered] == [(Status.OK, 1, 1)]  # the parked poll, at once
        assert ask(101, 6, 0) == (Status.OK, 1)  # never lowered
        assert ask(102, 6, 5, key=bytes(range(20))) == (Status.UNAUTHORIZED, 1)
        assert ask(103, 6, 5, key=bytes(20))[0] == Status.UNAUTHORIZED
        assert ask(104, 7, 0)[0] == Status.NO_SUCH_LEDGER
        assert ask(105, 6, -1)[0] == Status.BAD_REQUEST
        assert server.storage.ledger(6).lac == 1  # type: ignore[union-attr]
        assert journal.queued_bytes == queued  # advisory: nothing journaled
        conn.data_received(encode_request(Op.READ_LAC, Flag.FENCE, 106, 6, -1, KEY, 0, b""))
        await asyncio.sleep(0)
        syncer.release_all()
        assert ask(107, 6, 3) == (Status.FENCED, 1)
        journal.close()
        server.storage.close()

    uvloop.run(main())


# -- the C add path (ext/bookkeeper/_ext/shardpath.pyx) -----------------------------------------


def _req(op: Op, rid: int, ledger: int, entry: int, *, flags: int = 0, key: bytes = KEY, size: int = 10,
         header: tuple[int, int] | None = None) -> bytes:
    """One request; for adds, a digest-framed payload whose header names `header` (default: itself)."""
    if op != Op.ADD_ENTRY:
        return encode_request(op, flags, rid, ledger, entry, key, 0, b"")
    hl, he = header or (ledger, entry)
    payload = DigestManager(hl, DigestType.CRC32C, b"bp").encode(he, he - 1, size * (he + 1), bytes(size))
    return encode_request(op, flags, rid, ledger, entry, key, 0, payload)


def _answers(sock: Socket) -> dict[int, tuple[int, int, int]]:
    """request id -> (op, status, lac) of every response the connection received."""
    return {r[2]: (r[0], r[1], r[5]) for r in sock.responses()}


def test_one_buffer_of_mixed_requests_is_answered_in_order_of_effect(tmp_path: Path) -> None:
    """In one receive buffer: adds that take the C path, the first add of a ledger (Python: it
    creates the state), a wrong key, an entry header naming another entry, a fence, an add after
    the fence (FENCED), a recovery add after it (OK), a read of a staged entry. Each effect is
    applied in arrival order and each request gets the answer the Python path defines."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        buf = b"".join([
            _req(Op.ADD_ENTRY, 1, 7, 0),                            # first sight of ledger 7: Python
            _req(Op.ADD_ENTRY, 2, 7, 1),                            # C path
            _req(Op.ADD_ENTRY, 3, 7, 2, key=master_key(b"other")),  # UNAUTHORIZED
            _req(Op.ADD_ENTRY, 4, 7, 3, header=(7, 9)),             # BAD_REQUEST: header names entry 9
            _req(Op.ADD_ENTRY, 5, 7, 3),                            # C path
            _req(Op.READ_ENTRY, 6, 7, 1),                           # staged: readable at once
            _req(Op.READ_LAC, 7, 7, -1, flags=Flag.FENCE),          # fence (answered when durable)
            _req(Op.ADD_ENTRY, 8, 7, 4),                            # FENCED
            _req(Op.ADD_ENTRY, 9, 7, 4, flags=Flag.RECOVERY_ADD),   # OK: recovery adds pass a fence
        ])
        conn.data_received(buf)
        now = _answers(sock)
        assert now == {3: (Op.ADD_ENTRY, Status.UNAUTHORIZED, -1), 4: (Op.ADD_ENTRY, Status.BAD_REQUEST, -1),
                       6: (Op.READ_ENTRY, Status.OK, 2), 8: (Op.ADD_ENTRY, Status.FENCED, -1)}
        await asyncio.sleep(0)
        syncer.release_all()
        got = _answers(sock)
        for rid, lac in ((1, -1), (2, 0), (5, 2), (9, 3)):
            assert got[rid] == (Op.ADD_ENTRY, Status.OK, lac), rid
        assert got[7][:2] == (Op.READ_LAC, Status.OK)
        st = server.storage.ledger(7)
        assert st is not None and st.fenced and st.last_entry == 4 and st.lac == 3
        assert sorted(e for (lid, e) in server.storage.write_cache if lid == 7) == [0, 1, 3, 4]
        assert server.counters[int(Op.ADD_ENTRY)] == 7 and server.counters["add_errors"] == 3  # every add counted
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_c_path_stages_and_counts_exactly_like_put_entry(tmp_path: Path) -> None:
    """write_cache_bytes after C-path adds (including a rewrite of the same entry) equals what
    LedgerStorage.put_entry counts; every add is in the journal, answered once durable."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        conn.data_received(adds(3, 0, 1, 50))  # ledger 3 created through Python
        conn.data_received(adds(3, 1, 20, 50) + adds(3, 5, 1, 50))  # entry 5 twice
        expected = sum(len(v) + ENTRY_OVERHEAD_BYTES for v in server.storage.write_cache.values())
        assert server.storage.write_cache_bytes == expected and len(server.storage.write_cache) == 21
        for _ in range(3):
            await asyncio.sleep(0)
            syncer.release_all()
        oks = [r for r in sock.responses() if r[1] == Status.OK]
        assert len(oks) == 22 and sorted({r[4] for r in oks}) == list(range(21))
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_frames_split_across_receive_buffers_get_the_same_answers(tmp_path: Path) -> None:
    """A stream of adds cut at every 97 bytes (partial headers, partial payloads) is answered
    exactly like the same stream in one buffer: each request once, OK."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        stream = adds(5, 0, 40, 120)
        for i in range(0, len(stream), 97):
            conn.data_received(stream[i:i + 97])
        await asyncio.sleep(0)
        syncer.release_all()
        await asyncio.sleep(0)
        syncer.release_all()
        got = sock.responses()
        assert sorted((r[1], r[4]) for r in got) == [(Status.OK, e) for e in range(40)]
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_a_failed_journal_block_answers_its_c_path_adds_server_error(tmp_path: Path) -> None:
    """Adds staged by the C path whose block fails get SERVER_ERROR (LAC -1), counted as add
    errors; the shard then answers adds READ_ONLY (the Python path) and nothing is lost silently."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        journal.on_failed = lambda items, err: (server.on_failed(items, err),
                                                setattr(server, "readonly", True))
        conn.data_received(adds(6, 0, 1, 10))
        await asyncio.sleep(0)
        syncer.release_all()
        conn.data_received(adds(6, 1, 5, 10))  # C path, in the next block
        await asyncio.sleep(0)
        syncer.pending.pop(0)(OSError(5, "device gone"))
        conn.data_received(adds(6, 6, 1, 10))
        got = sock.responses()
        assert [(r[4], r[1], r[5]) for r in got] == (
            [(0, Status.OK, -1)] + [(e, Status.SERVER_ERROR, -1) for e in range(1, 6)]
            + [(6, Status.READ_ONLY, -1)])
        assert server.counters["add_errors"] == 6
        journal.close()
        server.storage.close()

    uvloop.run(main())


def test_c_path_add_wakes_a_parked_long_poll(tmp_path: Path) -> None:
    """A long poll parked on entry 2 is answered by the buffer whose C-path add carries LAC 2."""

    async def main() -> None:
        server, journal, syncer, conn, sock = shard(tmp_path)
        conn.data_received(adds(8, 0, 3, 10))  # entries 0-2, LAC 1
        poll = encode_request(Op.READ_ENTRY, Flag.LONG_POLL, 77, 8, 2, KEY, 5000, b"")
        conn.data_received(poll)
        assert 77 not in _answers(sock)
        conn.data_received(adds(8, 3, 1, 10))  # carries LAC 2
        assert _answers(sock)[77] == (Op.READ_ENTRY, Status.OK, 2)
        await asyncio.sleep(0)
        syncer.release_all()
        server.forget_waiters(conn)
        journal.close()
        server.storage.close()

    uvloop.run(main())
