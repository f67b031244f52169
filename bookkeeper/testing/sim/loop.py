"""An asyncio event loop on virtual time, for the simulator (bookkeeper/testing/sim).

Why asyncio's own loop and not a hand-written scheduler: the client and bookie shells
(futures, tasks, `call_later`, `asyncio.timeout`, `asyncio.wait`) then run unchanged. Only
three things differ from a SelectorEventLoop: `time()` is a number the loop advances itself
(when nothing is ready it jumps to the next timer instead of sleeping), nothing is ever
waited on in the kernel (the simulated network delivers bytes through timers), and
`run_in_executor` runs the job on the loop after a delay the simulation chooses, so a
ZooKeeper call or a storage flush takes virtual time instead of a thread.

One thread, one heap of timers, FIFO ready queue: the same callbacks scheduled in the same
order run in the same order, which is what makes a seed replay byte for byte.
"""
from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable
from typing import Any


class Stuck(RuntimeError):
    """Nothing is ready and no timer is due: the simulated world would wait forever."""


class _NoSelector(selectors.BaseSelector):
    """Registers what asyncio registers (its self-pipe), never reports an event; select()
    advances the loop's virtual clock to the next timer instead of sleeping."""

    def __init__(self, advance: Callable[[float | None], None]) -> None:
        self._advance = advance
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
        self._advance(timeout)
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
        super().__init__(_NoSelector(self._advance))

    def time(self) -> float:
        return self._vnow

    def _advance(self, timeout: float | None) -> None:
        if timeout is None:
            raise Stuck("nothing is ready and no timer is due")
        if timeout > 0:
            scheduled = self._scheduled  # type: ignore[attr-defined]  # asyncio's own timer heap
            self._vnow = scheduled[0]._when if scheduled else self._vnow + timeout

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
