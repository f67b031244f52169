"""Locust users that drive the real asyncio BookKeeper client (docs/api.md section 8).

    locust -f loadtest/locustfile.py --headless -u 12 -r 12 -t 30s \
        --metadata-uri zk://127.0.0.1:2181/ledgers --csv out/run

- WriterUser: creates a ledger (--ensemble/--write-quorum/--ack-quorum), adds entries of
  --entry-size bytes one at a time, closes it after --entries-per-ledger, starts the next.
- ReaderUser: opens ledgers the writers of this process closed and reads random ranges
  of --read-batch entries (if none is closed yet, it writes one to read).
- TailerUser: follows a ledger a writer of this process is writing (no recovery, never
  fences), from its current end until it is closed; each delivered entry is one `tail`
  request whose response time is the writer's send -> this delivery (the writer puts
  its wall-clock send time in the first 8 bytes of every entry).

Requests are reported with request type `bookkeeper` and names `create_ledger`,
`add_entry`, `close`, `open_ledger`, `read`, `tail`; a failure carries the client's
exception (its class name shows in locust's failure table). Response times are taken
in the user's greenlet around the whole call (the bridge's hand-off included: what a
gevent service would see); `latency.py` keeps them at microsecond resolution too.
How the asyncio client runs under gevent: `bookkeeper/gevent.py` and loadtest/README.md.
"""
from __future__ import annotations

import asyncio
import collections
import os
import random
import struct
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import gevent
from gevent.lock import Semaphore
from locust import User, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from bookkeeper import BookKeeper
from bookkeeper.client.ledger import ReadHandle, WriteHandle
from bookkeeper.gevent import AsyncioThread
from latency import LatencyRecorder

T = TypeVar("T")
REQUEST_TYPE = "bookkeeper"
STAMP = struct.Struct("<d")  # the writer's wall-clock send time, first bytes of each entry
CLOSED_LEDGERS_KEPT = 256
SEED_ENTRIES_MAX = 200
TAIL_WAIT_S = 1.0


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    g = parser.add_argument_group("bookkeeper")
    g.add_argument("--metadata-uri", default=os.environ.get("BK_METADATA_URI", ""),
                   help="zk://host:port/ledgers (default: $BK_METADATA_URI)")
    g.add_argument("--entry-size", type=int, default=100, help="bytes per entry (at least 8)")
    g.add_argument("--ensemble", type=int, default=3)
    g.add_argument("--write-quorum", type=int, default=2)
    g.add_argument("--ack-quorum", type=int, default=2)
    g.add_argument("--entries-per-ledger", type=int, default=1000, help="adds before a writer closes its ledger")
    g.add_argument("--read-batch", type=int, default=10, help="entries per read request")
    g.add_argument("--ledger-password", default="loadtest")


class _Process:
    """What the users of one locust process share: the loop thread, one client, the ledgers
    its writers are writing and have closed, and the latency histograms."""

    def __init__(self) -> None:
        self.bridge: AsyncioThread | None = None
        self.client: BookKeeper | None = None
        self._lock = Semaphore()
        self.writing: set[int] = set()
        self.closed: collections.deque[tuple[int, int]] = collections.deque(maxlen=CLOSED_LEDGERS_KEPT)
        self.latency = LatencyRecorder()

    def connect(self, env: Environment) -> tuple[AsyncioThread, BookKeeper]:
        with self._lock:
            if self.client is None:
                opts = env.parsed_options
                if not opts.metadata_uri:
                    raise SystemExit("bookkeeper load test: pass --metadata-uri or set BK_METADATA_URI")
                if opts.entry_size < STAMP.size:
                    raise SystemExit(f"bookkeeper load test: --entry-size must be >= {STAMP.size}")
                self.bridge = AsyncioThread()
                self.client = self.bridge.call(BookKeeper.connect(opts.metadata_uri), timeout_s=60)
            assert self.bridge is not None
            return self.bridge, self.client

    def shutdown(self) -> None:
        if self.bridge is None:
            return
        if self.client is not None:
            self.bridge.call(self.client.close(), timeout_s=30)
            self.client = None
        self.bridge.stop()
        self.bridge = None


PROCESS = _Process()


@events.request.add_listener
def _record(request_type: str, name: str, response_time: float, **_: Any) -> None:
    PROCESS.latency.record(request_type, name, response_time)


@events.report_to_master.add_listener
def _ship_histograms(client_id: str, data: dict[str, Any]) -> None:
    data["bookkeeper_hdr"] = PROCESS.latency.take_encoded()


@events.worker_report.add_listener
def _merge_histograms(client_id: str, data: dict[str, Any]) -> None:
    PROCESS.latency.add_encoded(data.get("bookkeeper_hdr", []))


@events.quitting.add_listener
def _finish(environment: Environment, **_: Any) -> None:
    PROCESS.shutdown()
    prefix = environment.parsed_options.csv_prefix if environment.parsed_options else None
    if prefix and not isinstance(environment.runner, WorkerRunner):
        PROCESS.latency.write_csv(Path(f"{prefix}_hdr.csv"))


class BookKeeperUser(User):
    """A user with the process's client; `timed` runs one client call and reports it."""

    abstract = True
    wait_time = constant(0)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self.opts = environment.parsed_options
        self.bridge, self.bk = PROCESS.connect(environment)
        self.password = self.opts.ledger_password.encode()

    def timed(self, name: str, coro: Coroutine[Any, Any, T],
              length: Callable[[T], int] | int = 0) -> tuple[bool, T | None]:
        """(ok, result): the call's response time, bytes and any error go to locust."""
        start = time.perf_counter()
        try:
            result = self.bridge.call(coro)
        except Exception as e:  # reported as this request's failure; the user carries on
            self._fire(name, start, 0, e)
            return False, None
        self._fire(name, start, length(result) if callable(length) else length, None)
        return True, result

    def _fire(self, name: str, start: float, length: int, exc: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=name, response_time=(time.perf_counter() - start) * 1000,
            response_length=length, exception=exc, context={})

    def create_ledger(self) -> WriteHandle | None:
        ok, lh = self.timed("create_ledger", self.bk.create_ledger(
            ensemble=self.opts.ensemble, write_quorum=self.opts.write_quorum, ack_quorum=self.opts.ack_quorum,
            password=self.password))
        return lh if ok else None

    def add_entry(self, lh: WriteHandle) -> bool:
        payload = STAMP.pack(time.time()) + bytes(self.opts.entry_size - STAMP.size)
        ok, _ = self.timed("add_entry", lh.add_entry(payload), len(payload))
        return ok

    def close_ledger(self, lh: WriteHandle) -> None:
        PROCESS.writing.discard(lh.ledger_id)
        ok, _ = self.timed("close", lh.close())
        if ok and lh.last_add_confirmed >= 0:
            PROCESS.closed.append((lh.ledger_id, lh.last_add_confirmed))


class WriterUser(BookKeeperUser):
    """create_ledger, then add_entry x --entries-per-ledger, then close; again."""

    def on_start(self) -> None:
        self.lh: WriteHandle | None = None
        self.written = 0

    @task
    def write(self) -> None:
        if self.lh is None:
            self.lh = self.create_ledger()
            self.written = 0
            if self.lh is None:
                return
            PROCESS.writing.add(self.lh.ledger_id)
        if not self.add_entry(self.lh):
            self.close_ledger(self.lh)  # a failed handle stays failed: start a new ledger
            self.lh = None
            return
        self.written += 1
        if self.written >= self.opts.entries_per_ledger:
            self.close_ledger(self.lh)
            self.lh = None

    def on_stop(self) -> None:
        if self.lh is not None:
            self.close_ledger(self.lh)
            self.lh = None


class ReaderUser(BookKeeperUser):
    """Random ranges of --read-batch entries from closed ledgers."""

    def on_start(self) -> None:
        self.handles: collections.OrderedDict[int, ReadHandle] = collections.OrderedDict()

    def _seed(self) -> None:
        """No closed ledger yet in this process: write one to read."""
        lh = self.create_ledger()
        if lh is None:
            return
        for _ in range(min(self.opts.entries_per_ledger, SEED_ENTRIES_MAX)):
            if not self.add_entry(lh):
                break
        self.close_ledger(lh)

    def _handle(self, ledger_id: int) -> ReadHandle | None:
        rh = self.handles.get(ledger_id)
        if rh is None:
            ok, rh = self.timed("open_ledger", self.bk.open_ledger(ledger_id, password=self.password))
            if not ok:
                return None
            self.handles[ledger_id] = rh
            if len(self.handles) > 16:
                self.handles.popitem(last=False)
        return rh

    @task
    def read(self) -> None:
        if not PROCESS.closed:
            self._seed()
            return
        ledger_id, last = random.choice(PROCESS.closed)
        rh = self._handle(ledger_id)
        if rh is None:
            return
        first = random.randint(0, last)
        self.timed("read", rh.read(first, min(last, first + self.opts.read_batch - 1)),
                   lambda entries: sum(len(e.data) for e in entries))


class _Follower:
    """Lives on the loop: tails one ledger into a buffer the greenlet takes in batches
    (one hand-off per batch, not per entry)."""

    def __init__(self, rh: ReadHandle) -> None:
        self.items: list[tuple[float, int]] = []  # (send -> delivery ms, bytes)
        self.error: Exception | None = None
        self.done = False
        self._ready = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(rh))

    async def _run(self, rh: ReadHandle) -> None:
        try:
            async for entry in rh.tail(start=rh.last_add_confirmed + 1):
                (sent,) = STAMP.unpack_from(entry.data)
                self.items.append(((time.time() - sent) * 1000, len(entry.data)))
                self._ready.set()
        except Exception as e:  # handed to the greenlet as a failed `tail`
            self.error = e
        finally:
            self.done = True
            self._ready.set()

    async def take(self, wait_s: float) -> tuple[list[tuple[float, int]], bool, Exception | None]:
        if not self.items and not self.done:
            try:
                await asyncio.wait_for(self._ready.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        self._ready.clear()
        items, self.items = self.items, []
        return items, self.done, self.error

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def _follow(rh: ReadHandle) -> _Follower:
    return _Follower(rh)


class TailerUser(BookKeeperUser):
    """Follows ledgers being written until they close; one `tail` request per entry."""

    def on_start(self) -> None:
        self.follower: _Follower | None = None

    @task
    def tail(self) -> None:
        if not PROCESS.writing:
            gevent.sleep(0.05)  # no writer of this process has a ledger open yet
            return
        ok, rh = self.timed("open_ledger", self.bk.open_ledger(random.choice(sorted(PROCESS.writing)),
                                                              password=self.password, recovery=False))
        if not ok:
            return
        self.follower = self.bridge.call(_follow(rh))
        try:
            done = False
            while not done:
                items, done, error = self.bridge.call(self.follower.take(TAIL_WAIT_S))
                for latency_ms, nbytes in items:
                    self.environment.events.request.fire(
                        request_type=REQUEST_TYPE, name="tail", response_time=latency_ms, response_length=nbytes,
                        exception=None, context={})
                if error is not None:
                    self._fire("tail", time.perf_counter(), 0, error)
        finally:
            self.bridge.call(self.follower.stop(), timeout_s=10)
            self.follower = None
