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
    """Records whether the server wants to read from this sender."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.received = bytearray()

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.received += data

    def responses(self) -> list[tuple]:
        frames, _ = parse_responses(bytes(self.received), 5 << 20)
        return frames

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

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


def shard(tmp: Path, **server_kw: Any) -> tuple[ShardServer, Journal, ManualSyncer, BookieProtocol, Socket]:
    loop = asyncio.get_running_loop()
    storage = LedgerStorage(tmp / "ledgers")
    server = ShardServer(storage=storage, shard_index=0, shards=1, max_frame_bytes=5 << 20, readonly=False,
                         data_dir=str(tmp), **server_kw)
    syncer = ManualSyncer()
    journal = Journal(tmp / "journal", syncer=syncer, loop=loop, on_durable=server.on_durable,
                      on_failed=server.on_failed, preallocate_bytes=1 << 20, batch_entries_max=50)
    journal.start()
    server.journal = journal
    conn, sock = BookieProtocol(server), Socket()
    conn.connection_made(sock)
    return server, journal, syncer, conn, sock


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
        conn.data_received(adds(4, 10, 15, 100))
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
