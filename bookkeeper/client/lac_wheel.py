"""The explicit LAC of every write handle of one client: one timer, not one per handle.

Lives in: the client's event loop; one per client (made with its first write handle).

A handle whose LAC moves joins the client's LacQueue from C (AckSink, in the receive path);
the wheel ticks every explicit_lac_interval_ms while anything is queued, and each tick
visits the handles that joined before the previous one (core/writer.py, lac_step): those
that sent no add since they joined send WRITE_LAC to the write set of their last
acknowledged entry (WriteHandle.send_lac), within explicit_lac_budget of them per tick.

Why one wheel: a timer per handle, armed at each acknowledgement, cost a TimerHandle, a
heap push and a Python call per add once handles were written less often than the interval
(10^4 open handles: every add), and those short-lived timers were what the cyclic GC kept
promoting to its oldest generation, making full collections over every handle frequent.
Why a budget: docs/protocol.md, WRITE_LAC (its cost per add).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from bookkeeper._ext.client import LacQueue
from bookkeeper.client.core.writer import explicit_lac_budget

if TYPE_CHECKING:
    from bookkeeper.client.context import LedgerContext

log = logging.getLogger(__name__)


class LacWheel:
    """The LAC wheel of one client: its LacQueue (which the handles' AckSinks join) and the
    one timer that ticks it. A handle whose explicit LACs are off (recovery, or the interval
    0 when it was made) never joins; the interval set to 0 later empties the queue."""

    __slots__ = ("_ctx", "_loop", "queue", "_timer", "_acked")

    def __init__(self, ctx: LedgerContext) -> None:
        self._ctx = ctx
        self._loop = asyncio.get_running_loop()
        self.queue = LacQueue(self._arm)
        self._timer: asyncio.TimerHandle | None = None
        self._acked = 0  # the queue's acknowledged entries at the last tick

    def _arm(self) -> None:
        """A tick after the interval, unless one is armed (called from C on a join, and after a tick)."""
        if self._timer is None:
            self._timer = self._loop.call_later(self._ctx.config.explicit_lac_interval_ms / 1000.0, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if not self._ctx.config.explicit_lac_interval_ms or self._ctx.pool.closed:
            self.queue.clear()
            return
        acked = self.queue.acked
        due: list[Any] = self.queue.tick(explicit_lac_budget(acked - self._acked))
        self._acked = acked
        try:
            for i in range(0, len(due), 2):
                due[i].send_lac(due[i + 1])
        finally:
            if self.queue.queued:
                self._arm()
