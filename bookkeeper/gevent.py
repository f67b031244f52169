"""The asyncio BookKeeper client inside a gevent program (locust, `gunicorn -k gevent`).

Install with the extra: `pip install 'bookkeeper-py[gevent]'`. Use one bridge per process,
made after gevent's monkey-patching (in a gunicorn worker: lazily, on its first request):

    from bookkeeper import BookKeeper
    from bookkeeper.gevent import AsyncioThread

    bridge = AsyncioThread()
    bk = bridge.call(BookKeeper.connect("zk://zk1:2181/ledgers"))
    lh = bridge.call(bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2))
    entry_id = bridge.call(lh.add_entry(b"payload"))   # this greenlet waits; the hub runs on

Why a bridge: locust runs its users as greenlets of one gevent hub, with the standard library
monkey-patched. The client is asyncio on uvloop. Two facts decide the shape:
- a uvloop loop run inside a greenlet blocks the hub (libuv never yields to gevent),
  and stdlib asyncio on a patched thread waits on patched selectors and times out;
- under monkey-patching every `threading.Thread` the client starts (its default
  executor for ZooKeeper calls, kazoo's own connection threads) is a greenlet of the
  hub of the thread that starts it.

So each process runs ONE uvloop loop on a native OS thread (gevent's original
`start_new_thread`), and everything that would be a thread of that loop runs as a
greenlet of the process's hub instead: the loop's default executor hands its blocking
calls (kazoo, which then runs on gevent sockets) to the hub. A greenlet submits a
coroutine with `call()`; the loop thread hands each result back through one gevent
`async_` watcher (thread-safe to `send()`, and it keeps the hub alive while calls are
outstanding), so a waiting greenlet yields to the hub and never blocks it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import gevent
import uvloop
from gevent import monkey
from gevent.event import AsyncResult

T = TypeVar("T")
_start_native_thread = monkey.get_original("_thread", "start_new_thread")


class AsyncioThread:
    """One uvloop event loop on a native thread, serving the greenlets of one hub."""

    def __init__(self) -> None:
        self._hub = gevent.get_hub()
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        self._watcher = self._hub.loop.async_()
        self._watcher.start(self._run_posted)
        self.loop = uvloop.new_event_loop()
        self.loop.set_default_executor(_HubExecutor(self._post))
        self._stopped = AsyncResult()
        _start_native_thread(self._thread_main, ())

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self._post(functools.partial(self._stopped.set, True))

    def _post(self, fn: Callable[[], None]) -> None:
        """Run fn in the hub's thread, soon (callable from any thread)."""
        self._posted.append(fn)
        self._watcher.send()

    def _run_posted(self) -> None:
        while self._posted:
            self._posted.popleft()()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run coro on the loop; the calling greenlet waits for its result, the hub does not."""
        result: AsyncResult = AsyncResult()
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        fut.add_done_callback(lambda f: self._post(functools.partial(_settle, result, f)))
        try:
            value: T = result.get(timeout=timeout_s)
        except BaseException:
            fut.cancel()  # the greenlet was killed or timed out: do not leave the coroutine running
            raise
        return value

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, wait (cooperatively) for its thread to end, release the watcher."""
        if not self._stopped.ready():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._stopped.wait(timeout_s)
        if self._stopped.ready():
            self.loop.close()
        self._watcher.close()


def _settle(result: AsyncResult, fut: concurrent.futures.Future[Any]) -> None:
    if fut.cancelled():
        result.set_exception(concurrent.futures.CancelledError())
    elif fut.exception() is not None:
        result.set_exception(fut.exception())
    else:
        result.set(fut.result())


class _HubExecutor(concurrent.futures.Executor):
    """The loop's default executor: each blocking call runs as a greenlet of the hub."""

    def __init__(self, post: Callable[[Callable[[], None]], None]) -> None:
        self._post = post

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(functools.partial(gevent.spawn, _run_into, fut, fn, args, kwargs))
        return fut


def _run_into(fut: concurrent.futures.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args, **kwargs))
    except BaseException as e:  # handed to the awaiting coroutine, as a thread pool would
        fut.set_exception(e)
