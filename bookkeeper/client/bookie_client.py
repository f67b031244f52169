"""Connections to bookie shards: pipelined requests, callbacks per request id.

Lives in: the client's event loop. One connection per shard address, shared by
every ledger whose owning shard it is. Requests issued in one loop iteration
are written together; responses are parsed a whole receive buffer at a time by
the Cython codec. A connection that fails fails all its outstanding requests
with BookieUnavailableError; the next request reconnects.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from bookkeeper._ext.client import RequestPipe
from bookkeeper.errors import BKError, BookieUnavailableError, TimeoutError, error_for_status
from bookkeeper.proto import DEFAULT_MAX_FRAME_BYTES, FrameError, Status, shard_for_ledger

log = logging.getLogger(__name__)

# callback(ctx, response tuple or None, exception or None): ctx is whatever the sender
# passed, so hot callers hand over a bound method and a tuple instead of a new closure.
Callback = Callable[[Any, tuple[Any, ...] | None, BKError | None], None]


class _ShardProtocol(asyncio.BufferedProtocol):
    """Responses are read straight into the pipe's receive buffer (no bytes object per read)."""

    def __init__(self, conn: ShardConnection) -> None:
        self.conn = conn
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def _current(self) -> bool:
        """Whether this transport is still the connection's: one it gave up on (a bad frame)
        may report late, and must not touch the pipe the next transport now feeds."""
        return self.transport is not None and self.conn._transport is self.transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._current():
            self.conn._lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._current():  # a transport given up on may still read: never into the pipe
            return memoryview(bytearray(65536))
        buf: memoryview = self.conn.pipe.get_buffer(sizehint)
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if self._current():
            self._dispatch(self.conn.pipe.buffer_updated, nbytes)

    def feed(self, data: bytes) -> None:
        """Responses that arrived some other way (`bk bench client`'s in-process echo)."""
        if self._current():
            self._dispatch(self.conn.pipe.feed, data)

    def _dispatch(self, how: Callable[[Any], None], arg: Any) -> None:
        try:
            how(arg)
        except FrameError as e:
            self.transport.close()  # type: ignore[union-attr]
            self.conn._lost(e)


class ShardConnection:
    """One TCP connection to one bookie shard (client event loop only).

    Frames are encoded into the pipe's outbox as requests are made and written once per
    loop iteration; responses are dispatched by the pipe a receive buffer at a time.
    """

    def __init__(self, host: str, port: int, *, timeout_s: float, max_frame_bytes: int) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._loop = asyncio.get_running_loop()
        self.pipe = RequestPipe(max_frame_bytes, self._error_for, functools.partial(self._loop.call_soon, self._flush),
                                self._flush)
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None

    def _error_for(self, status: int) -> BKError:
        name = Status(status).name if status in Status._value2member_map_ else str(status)
        return error_for_status(status, f"bookie {self.host}:{self.port}: {name}")

    async def _connect(self) -> None:
        try:
            transport, _ = await asyncio.wait_for(
                self._loop.create_connection(lambda: _ShardProtocol(self), self.host, self.port),
                self.timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            self.pipe.discard_outbox()
            self.pipe.fail_all(BookieUnavailableError(f"cannot connect to {self.host}:{self.port}: {e}"))
            return
        self.attach(transport)

    def attach(self, transport: asyncio.Transport) -> None:
        """Use this transport (connected, its protocol a _ShardProtocol of this connection) and
        send what waited for it. `bk bench client` attaches an in-process echo this way."""
        self._transport = transport
        if transport.is_closing():  # lost before it was attached: its connection_lost was ignored
            self._lost(None)
            return
        self.pipe.connected = True
        self._flush()

    def request(self, op: int, flags: int, ledger_id: int, entry_id: int, key: bytes, aux: int,
                payload: bytes, callback: Callback, ctx: Any, timeout_s: float | None = None,
                borrow: bool = False) -> None:
        """Queue one request; callback(ctx, response, error) runs on the loop when it settles.
        borrow: the response payload is a view of the receive buffer, valid during the callback only."""
        if self.pipe.send(op, flags, ledger_id, entry_id, key, aux, payload, callback, ctx,
                          timeout_s or self.timeout_s, borrow):
            self.ensure_connecting()

    def ensure_connecting(self) -> None:
        """Start connecting unless already under way (the pipe's frames wait for it)."""
        if self._connecting is None or self._connecting.done():
            self._connecting = self._loop.create_task(self._connect())

    def _flush(self) -> None:
        if self.pipe.connected:
            out = self.pipe.take()
            if out is not None:
                self._transport.write(out)  # type: ignore[union-attr]

    def _lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.pipe.connected = False
        self.pipe.discard_outbox()
        self.pipe.fail_all(BookieUnavailableError(f"connection to {self.host}:{self.port} lost: {exc or 'closed'}"))

    def expire(self, now: float) -> None:
        """Fail requests past their deadline with TimeoutError."""
        self.pipe.expire(now, lambda: TimeoutError(f"request to {self.host}:{self.port} timed out"))

    def close(self) -> None:
        self.pipe.connected = False
        if self._transport is not None:
            self._transport.close()
        self._transport = None


class BookieClientPool:
    """Shard-aware routing: bookie id + ledger id -> the owning shard's connection."""

    def __init__(self, resolve: Callable[[str], dict[str, Any] | None], *, timeout_s: float = 30.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._resolve = resolve
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._conns: dict[tuple[str, int], ShardConnection] = {}
        self._routes: dict[tuple[str, int], ShardConnection] = {}
        self.routes_epoch = 0  # bumped when routes are forgotten: callers' own route caches key on it
        self._sweeper: asyncio.Task[None] | None = None

    def invalidate_routes(self) -> None:
        """Forget cached routes (registrations were re-read)."""
        self._routes.clear()
        self.routes_epoch += 1

    def connection(self, bookie_id: str, ledger_id: int) -> ShardConnection:
        """The owning shard's connection; routes are cached per (bookie, ledger): adds are hot."""
        conn = self._routes.get((bookie_id, ledger_id))
        if conn is not None:
            return conn
        if len(self._routes) > 100_000:
            self._routes.clear()
        conn = self._routes[(bookie_id, ledger_id)] = self._route(bookie_id, ledger_id)
        return conn

    def _route(self, bookie_id: str, ledger_id: int) -> ShardConnection:
        info = self._resolve(bookie_id)
        if info is None:
            raise BookieUnavailableError(f"bookie {bookie_id} is not registered")
        shards = info["shards"]
        shard = shards[shard_for_ledger(ledger_id, len(shards))]
        return self.connection_to(shard["host"], shard["port"])

    def connection_to(self, host: str, port: int) -> ShardConnection:
        key = (host, port)
        conn = self._conns.get(key)
        if conn is None:
            conn = self._conns[key] = ShardConnection(host, port, timeout_s=self.timeout_s,
                                                      max_frame_bytes=self.max_frame_bytes)
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return conn

    def send(self, bookie_id: str, op: int, flags: int, ledger_id: int, entry_id: int, key: bytes,
             aux: int, payload: bytes, callback: Callback, ctx: Any, timeout_s: float | None = None,
             borrow: bool = False) -> None:
        """Route one request; an unresolvable bookie fails through the callback, like any other error.
        borrow: see ShardConnection.request."""
        try:
            conn = self.connection(bookie_id, ledger_id)
        except BKError as e:
            asyncio.get_running_loop().call_soon(callback, ctx, None, e)
            return
        conn.request(op, flags, ledger_id, entry_id, key, aux, payload, callback, ctx, timeout_s, borrow)

    async def call(self, bookie_id: str, op: int, flags: int, ledger_id: int, entry_id: int, key: bytes,
                   aux: int = 0, payload: bytes = b"", timeout_s: float | None = None) -> tuple[Any, ...]:
        """One request as a coroutine: the response tuple, or raises its error."""
        fut: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()

        def done(_ctx: None, resp: tuple[Any, ...] | None, err: BKError | None) -> None:
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(resp)  # type: ignore[arg-type]
        self.send(bookie_id, op, flags, ledger_id, entry_id, key, aux, payload, done, None, timeout_s)
        return await fut

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for conn in list(self._conns.values()):
                conn.expire(now)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._routes.clear()


class BookieHealth:
    """Which bookies erred or timed out lately, each for `penalty_s` after its last error
    (client loop only): reads try them last, placement avoids them."""

    def __init__(self, penalty_s: float) -> None:
        self.penalty_s = penalty_s
        self._until: dict[str, float] = {}

    def penalize(self, bookie_id: str) -> None:
        self._until[bookie_id] = time.monotonic() + self.penalty_s

    def is_slow(self, bookie_id: str) -> bool:
        until = self._until.get(bookie_id)
        if until is None:
            return False
        if until < time.monotonic():
            del self._until[bookie_id]
            return False
        return True

    def current(self) -> set[str]:
        """The bookies penalized now (expired ones are forgotten)."""
        now = time.monotonic()
        for b in [b for b, until in self._until.items() if until < now]:
            del self._until[b]
        return set(self._until)

    def penalized_now(self) -> set[str]:
        """current() without forgetting expired ones: a read only, safe from another thread
        (a metrics scrape) while the loop penalizes and forgets."""
        now = time.monotonic()
        return {b for b, until in list(self._until.items()) if until >= now}

    def order(self, replicas: list[str]) -> list[str]:
        """Replicas in write-set order, penalized ones moved last (stable)."""
        if not self._until:
            return replicas
        return sorted(replicas, key=self.is_slow)
