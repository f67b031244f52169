"""Small asyncio helpers shared by the auditor and the worker: a flag set from kazoo's thread,
and waiting for the first of several events.

Lives in: the auto-recovery service's event loop (or a `bk` command's).
"""
from __future__ import annotations

import asyncio


class Switch:
    """A boolean owned by the loop, set from any thread (a kazoo watch); waiters take
    `changed` before they look at `value` and wake on the next change, none missed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, value: bool) -> None:
        self._loop = loop
        self.value = value
        self.changed = asyncio.Event()

    def set_threadsafe(self, value: bool) -> None:
        self._loop.call_soon_threadsafe(self.set, value)

    def set(self, value: bool) -> None:
        if value != self.value:
            self.value = value
            old, self.changed = self.changed, asyncio.Event()
            old.set()


class Poke:
    """An event any thread can set (watch callbacks): `callback` is what kazoo is given."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.event = asyncio.Event()

    def callback(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self.event.set)


async def wait_any(events: list[asyncio.Event], timeout_s: float | None) -> None:
    """Until one of the events is set or timeout_s passes (None: no timeout)."""
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
