"""An in-process shard for the fuzz targets: the real ShardServer, AddPath, Journal and
LedgerStorage on a private uvloop event loop, with a journal device whose syncs the harness
completes (bookkeeper.testing.syncers.ManualSyncer), and connections over a transport that
keeps what the shard writes. No sockets, no other process.

Why a private loop run per input: data_received needs a running loop (a bad frame's close
is a task), and each input must be answered and settled before the properties are checked.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import uvloop

from bookkeeper.bookie.journal import Journal
from bookkeeper.bookie.server import BookieProtocol, PeerBounds, ShardServer
from bookkeeper.bookie.trust import Backoff, ShardTrust
from bookkeeper.bookie.storage import LedgerStorage
from bookkeeper.testing.syncers import ManualSyncer

MAX_FRAME = 1 << 16
SETTLE_ROUNDS = 20  # loop turns (each completing every sync) before an input counts as settled


class Transport(asyncio.Transport):
    """Keeps what the shard writes to one peer, and whether the shard closed it."""

    def __init__(self) -> None:
        super().__init__()
        self.received = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: Any) -> None:
        assert not self.closed, "a write after close"
        self.received += data

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("fuzz", 0) if name == "peername" else default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class ErrorLog(logging.Handler):
    """ERROR records of the bookie's loggers: the shard logs, and survives, a request that
    raised (it answers SERVER_ERROR): for a fuzzer each one is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[str]:
        out = [r.getMessage() + (f": {r.exc_info[1]!r}" if r.exc_info else "") for r in self.records]
        self.records.clear()
        return out


@dataclass
class Shard:
    """One shard on its own loop; `fresh()` forgets every ledger between inputs, so that an
    input's outcome depends on that input alone (a crash reproduces from its file)."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fuzz-shard-")))
    errors: ErrorLog = field(default_factory=ErrorLog)
    trust: ShardTrust | None = None  # TLS and AUTH off unless given

    def __post_init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.storage = LedgerStorage(self.root / "ledgers")
        self.server = ShardServer(storage=self.storage, shard_index=0, shards=1, max_frame_bytes=MAX_FRAME,
                                  readonly=False, data_dir=str(self.root),
                                  bounds=PeerBounds(idle_timeout_s=0, max_long_polls_per_connection=4),
                                  trust=self.trust)
        self.syncer = ManualSyncer()
        self.journal = Journal(self.root / "journal", syncer=self.syncer, loop=self.loop,
                               on_durable=self.server.on_durable, on_failed=self.server.on_failed,
                               preallocate_bytes=1 << 20, reuse_files=0, batch_entries_max=64)
        self.journal.pooling = False  # no spare file filled by a thread: nothing runs between inputs
        self.journal.start()
        self.server.journal = self.journal
        logging.getLogger("bookkeeper").addHandler(self.errors)

    def fresh(self) -> None:
        self.server.trust.backoff = Backoff()  # every connection comes from one address here
        self.storage.ledgers.clear()
        self.storage.write_cache.clear()
        self.storage.write_cache_bytes = 0

    def connect(self) -> tuple[BookieProtocol, Transport]:
        conn, transport = BookieProtocol(self.server), Transport()
        self.run(self._connect(conn, transport))
        return conn, transport

    @staticmethod
    async def _connect(conn: BookieProtocol, transport: Transport) -> None:
        conn.connection_made(transport)

    def send(self, conn: BookieProtocol, *chunks: bytes) -> None:
        """Chunks arrive one receive buffer each; then every sync completes and every task
        the shard started (a bad frame's close) runs."""
        self.run(self._send(conn, chunks))

    async def _send(self, conn: BookieProtocol, chunks: tuple[bytes, ...]) -> None:
        for chunk in chunks:
            if not conn.closed and chunk:
                conn.data_received(chunk)
        quiet = 0
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)
            quiet = 0 if self.syncer.pending else quiet + 1
            if quiet == 3:
                break
            self.syncer.release_all()

    def disconnect(self, conn: BookieProtocol) -> None:
        self.run(self._disconnect(conn))

    @staticmethod
    async def _disconnect(conn: BookieProtocol) -> None:
        conn.connection_lost(None)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        logging.getLogger("bookkeeper").removeHandler(self.errors)
        self.syncer.release_all()
        self.journal.close()
        self.storage.close()
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)


class RenewedShard:
    """A target's one Shard per process, renewed every `every` inputs (its journal only grows)
    and made by `make` (the target's trust, say)."""

    def __init__(self, make: Callable[[], Shard], every: int = 5000) -> None:
        self.make, self.every = make, every
        self._shard: Shard | None = None
        self._inputs = 0

    def get(self) -> Shard:
        self._inputs += 1
        if self._shard is not None and self._inputs % self.every == 0:
            self.close()
        if self._shard is None:
            self._shard = self.make()
        self._shard.fresh()
        return self._shard

    def close(self) -> None:
        """Stop the shard (its loop, journal, storage and files)."""
        if self._shard is not None:
            self._shard.close()
            self._shard = None
