"""An asyncio event loop on virtual time, for the simulator (bookkeeper/testing/sim).

Why asyncio's own loop and not a hand-written scheduler: the client and bookie shells
(futures, tasks, `call_later`, `asyncio.timeout`, `asyncio.wait`) then run unchanged. Only
four things differ from a SelectorEventLoop: `time()` is a number the loop advances itself
(when nothing is ready it jumps to the next timer instead of sleeping), nothing is ever
waited on in the kernel (the simulated network delivers bytes through timers),
`run_in_executor` runs the job on the loop after a delay the simulation chooses, so a
ZooKeeper call or a storage flush takes virtual time instead of a thread, and a node can
be paused (a stopped process, a long garbage-collection pause): its callbacks wait, in
order, until it resumes, while the rest of the world goes on.

One thread, one heap of timers, FIFO ready queue: the same callbacks scheduled in the same
order run in the same order, which is what makes a seed replay byte for byte.
"""
from __future__ import annotations

import asyncio
import contextvars
import heapq
import selectors
from collections.abc import Awaitable, Callable
from typing import Any


class Stuck(RuntimeError):
    """Nothing is ready and no timer is due: the simulated world would wait forever."""


class _NoSelector(selectors.BaseSelector):
    """Registers what asyncio registers (its self-pipe) and never reports an event: the
    loop's turn (SimLoop._run_once) never waits in the kernel."""

    def __init__(self) -> None:
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return []

    def get_map(self) -> dict[int, selectors.SelectorKey]:  # type: ignore[override]
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class SimLoop(asyncio.SelectorEventLoop):
    """A SelectorEventLoop whose clock is virtual (seconds from 0)."""

    def __init__(self) -> None:
        self._vnow = 0.0
        # job -> seconds it takes (the simulation's choice, seeded); default: none
        self.executor_delay: Callable[[Any], float] = lambda _fn: 0.0
        # (protocol factory, host, port) -> (transport, protocol): the simulated network's connect
        self.connect: Callable[..., Awaitable[tuple[Any, Any]]] | None = None
        # The context variable naming the node a callback belongs to (the simulation's), and
        # the paused nodes with the callbacks set aside for each, in order.
        self.node_var: contextvars.ContextVar[str] | None = None
        self.paused: dict[str, list[asyncio.Handle]] = {}
        super().__init__(_NoSelector())

    def time(self) -> float:
        return self._vnow

    def pause(self, node: str) -> None:
        """The node stops: none of its callbacks runs (network arrivals, timers, its tasks'
        steps) until resume(node)."""
        self.paused.setdefault(node, [])

    def resume(self, node: str) -> None:
        """The node goes on: what waited runs next turn, in the order it became ready (after
        what is ready already)."""
        base: Any = self
        base._ready.extend(self.paused.pop(node, []))

    def _run_once(self) -> None:
        """One turn, asyncio's (BaseEventLoop._run_once: the same steps in the same order, so a
        run does not change with it), but for virtual time, which jumps to the next timer
        when nothing is ready, and the paused nodes' callbacks, which are set aside."""
        base: Any = self  # asyncio's private state, untyped
        scheduled, ready = base._scheduled, base._ready
        if len(scheduled) > 100 and base._timer_cancelled_count / len(scheduled) > 0.5:
            live = []
            for handle in scheduled:
                if handle._cancelled:
                    handle._scheduled = False
                else:
                    live.append(handle)
            heapq.heapify(live)
            base._scheduled = scheduled = live
            base._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0]._cancelled:
                base._timer_cancelled_count -= 1
                heapq.heappop(scheduled)._scheduled = False
        if not ready and not base._stopping:
            if not scheduled:
                raise Stuck("nothing is ready and no timer is due")
            self._vnow = max(self._vnow, scheduled[0]._when)
        end = self._vnow + base._clock_resolution
        while scheduled and scheduled[0]._when < end:
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            ready.append(handle)
        paused, var = self.paused, self.node_var
        for _ in range(len(ready)):
            handle = ready.popleft()
            if handle._cancelled:
                continue
            if paused and var is not None:
                node = handle._context.get(var)
                if node in paused:
                    paused[node].append(handle)
                    continue
            handle._run()

    def _write_to_self(self) -> None:
        """call_soon_threadsafe's wake-up: nothing sleeps here, so nothing to wake."""

    async def create_connection(self, protocol_factory: Callable[[], Any], host: str | None = None,
                                port: int | None = None, **_kwargs: Any) -> tuple[Any, Any]:
        """A TCP connect through the simulated network (`connect`, set by the simulation)."""
        if self.connect is None:
            raise ConnectionRefusedError("no simulated network")
        return await self.connect(protocol_factory, host, port)

    def run_in_executor(self, executor: Any, func: Callable[..., Any],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[Any]:
        """The job runs on the loop (no thread) once its virtual duration has passed."""
        fut: asyncio.Future[Any] = self.create_future()

        def run() -> None:
            if fut.cancelled():
                return
            try:
                result = func(*args)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller, as a thread pool would
                fut.set_exception(e)
            else:
                fut.set_result(result)
        self.call_later(self.executor_delay(func), run)
        return fut
