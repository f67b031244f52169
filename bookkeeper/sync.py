"""The blocking twin of the asyncio client and of streams: same names, no await.

Why a loop thread: the asyncio client is the one implementation; this module runs
it on a private uvloop event loop in a daemon thread and blocks the caller on each
call. `add_entry_async` returns a concurrent.futures.Future; calls from one thread
reach the loop in call order (call_soon_threadsafe is FIFO), so entry ids follow
the caller's order.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any, TypeVar

import uvloop

from bookkeeper.client import BookKeeper as AsyncBookKeeper
from bookkeeper.client import LedgerEntry, ReadHandle as AsyncReadHandle, WriteHandle as AsyncWriteHandle
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata
from bookkeeper.stream import Namespace as AsyncNamespace
from bookkeeper.stream import Position, StreamReader as AsyncStreamReader, StreamRecord
from bookkeeper.stream import StreamWriter as AsyncStreamWriter

T = TypeVar("T")

__all__ = ["BookKeeper", "DigestType", "LedgerEntry", "Namespace", "Position", "ReadHandle", "StreamReader",
           "StreamRecord", "StreamWriter", "WriteHandle"]


class _LoopThread:
    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bookkeeper-sync", daemon=True)
        self.thread.start()

    def call(self, aw: Awaitable[T]) -> T:
        """Run aw on the loop and block until its result (an async iterator's __anext__() is
        an awaitable, not a coroutine: it is wrapped in one)."""
        coro = aw if asyncio.iscoroutine(aw) else _awaited(aw)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


class ReadHandle:
    """Blocking view of a read handle."""

    def __init__(self, lt: _LoopThread, handle: AsyncReadHandle) -> None:
        self._lt = lt
        self._h = handle

    @property
    def ledger_id(self) -> int:
        return self._h.ledger_id

    @property
    def last_add_confirmed(self) -> int:
        return self._h.last_add_confirmed

    @property
    def length(self) -> int:
        return self._h.length

    @property
    def metadata(self) -> LedgerMetadata:
        return self._h.metadata

    def read(self, first: int, last: int) -> list[LedgerEntry]:
        return self._lt.call(self._h.read(first, last))

    def read_async(self, first: int, last: int) -> concurrent.futures.Future[list[LedgerEntry]]:
        """Start a range read and return at once: a caller can work on one range while the next
        is in flight (the Spark source's partition readers do)."""
        return asyncio.run_coroutine_threadsafe(self._h.read(first, last), self._lt.loop)

    def read_last_add_confirmed(self) -> int:
        return self._lt.call(self._h.read_last_add_confirmed())

    def tail(self, start: int = 0) -> Iterator[LedgerEntry]:
        agen = self._h.tail(start)
        while True:
            try:
                yield self._lt.call(agen.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self._lt.call(self._h.close())


class WriteHandle(ReadHandle):
    """Blocking view of a write handle."""

    def __init__(self, lt: _LoopThread, handle: AsyncWriteHandle) -> None:
        super().__init__(lt, handle)
        self._w = handle

    def add_entry(self, data: bytes) -> int:
        """Add and wait for the acknowledgement (waits for room at the outstanding bound)."""
        return self._lt.call(self._w.add_entry(data))

    def add_entries(self, datas: Sequence[bytes]) -> list[int]:
        """Add a batch (consecutive ids) and wait for all: one loop hop for the whole batch."""
        return self._lt.call(self._w.add_entries(datas))

    def add_entry_async(self, data: bytes) -> concurrent.futures.Future[int]:
        out: concurrent.futures.Future[int] = concurrent.futures.Future()

        def start() -> None:
            try:
                fut = self._w.add_entry_async(data)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's future
                out.set_exception(e)
                return
            fut.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception()
                                  else out.set_result(f.result()))
        self._lt.loop.call_soon_threadsafe(start)
        return out


class BookKeeper:
    """Blocking client: `bookkeeper.sync.BookKeeper.connect(uri)`."""

    def __init__(self, lt: _LoopThread, bk: AsyncBookKeeper) -> None:
        self._lt = lt
        self._bk = bk

    @classmethod
    def connect(cls, metadata_uri: str, **kwargs: Any) -> BookKeeper:
        lt = _LoopThread()
        try:
            bk = lt.call(AsyncBookKeeper.connect(metadata_uri, **kwargs))
        except BaseException:
            lt.stop()
            raise
        return cls(lt, bk)

    def __enter__(self) -> BookKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._lt.call(self._bk.close())
        finally:
            self._lt.stop()

    def create_ledger(self, **kwargs: Any) -> WriteHandle:
        return WriteHandle(self._lt, self._lt.call(self._bk.create_ledger(**kwargs)))

    def open_ledger(self, ledger_id: int, **kwargs: Any) -> ReadHandle:
        return ReadHandle(self._lt, self._lt.call(self._bk.open_ledger(ledger_id, **kwargs)))

    def delete_ledger(self, ledger_id: int) -> None:
        self._lt.call(self._bk.delete_ledger(ledger_id))

    def list_ledgers(self) -> Iterator[int]:
        async def collect() -> list[int]:
            return [lid async for lid in self._bk.list_ledgers()]
        return iter(self._lt.call(collect()))

    def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        return self._lt.call(self._bk.ledger_metadata(ledger_id))


class StreamWriter:
    """Blocking view of a stream writer (`Namespace.open_writer`)."""

    def __init__(self, lt: _LoopThread, writer: AsyncStreamWriter) -> None:
        self._lt = lt
        self._w = writer

    @property
    def name(self) -> str:
        return self._w.name

    @property
    def last_txid(self) -> int:
        return self._w.last_txid

    def write(self, data: bytes, txid: int | None = None) -> Position:
        return self._lt.call(self._w.write(data, txid))

    def write_batch(self, records: list[bytes], txids: list[int] | None = None) -> list[Position]:
        return self._lt.call(self._w.write_batch(records, txids))

    def flush(self) -> None:
        self._lt.call(self._w.flush())

    def close(self) -> None:
        self._lt.call(self._w.close())

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamReader:
    """Blocking view of a stream reader: a plain iterator of StreamRecord."""

    def __init__(self, lt: _LoopThread, reader: AsyncStreamReader) -> None:
        self._lt = lt
        self._r = reader

    @property
    def position(self) -> Position | None:
        """The position of the next record to deliver (as the async reader's)."""
        return self._r.position

    def __iter__(self) -> Iterator[StreamRecord]:
        return self

    def __next__(self) -> StreamRecord:
        try:
            return self._lt.call(self._r.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._lt.call(self._r.close())

    def __enter__(self) -> StreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Namespace:
    """Blocking namespace of streams: `bookkeeper.sync.Namespace.connect(uri, name)`."""

    def __init__(self, lt: _LoopThread, ns: AsyncNamespace) -> None:
        self._lt = lt
        self._ns = ns

    @property
    def name(self) -> str:
        return self._ns.name

    @classmethod
    def connect(cls, metadata_uri: str, name: str = "default", **kwargs: Any) -> Namespace:
        lt = _LoopThread()
        try:
            ns = lt.call(AsyncNamespace.connect(metadata_uri, name, **kwargs))
        except BaseException:
            lt.stop()
            raise
        return cls(lt, ns)

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._lt.call(self._ns.close())
        finally:
            self._lt.stop()

    def create_stream(self, name: str, **kwargs: Any) -> None:
        self._lt.call(self._ns.create_stream(name, **kwargs))

    def list_streams(self) -> list[str]:
        return self._lt.call(self._ns.list_streams())

    def describe(self, name: str) -> dict[str, Any]:
        return self._lt.call(self._ns.describe(name))

    def open_writer(self, name: str, **kwargs: Any) -> StreamWriter:
        return StreamWriter(self._lt, self._lt.call(self._ns.open_writer(name, **kwargs)))

    def open_reader(self, name: str, start: str | Position = "earliest", **kwargs: Any) -> StreamReader:
        return StreamReader(self._lt, self._lt.call(self._ns.open_reader(name, start, **kwargs)))

    def truncate(self, name: str, *, before: Position) -> list[int]:
        return self._lt.call(self._ns.truncate(name, before=before))

    def apply_retention(self, name: str) -> list[int]:
        return self._lt.call(self._ns.apply_retention(name))

    def delete_stream(self, name: str) -> None:
        self._lt.call(self._ns.delete_stream(name))
