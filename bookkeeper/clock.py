"""The clocks the shard and the client read, passed in rather than read from `time` where the
decisions are made (issue 25 item 3): production passes these, a simulator its own virtual
ones, so the same code runs in virtual time. `system_monotonic` measures intervals (timeouts,
latencies, group-commit waits); `system_wall` is calendar time (token expiry, which a token states
in seconds since the epoch).

Timers and deadlines (a group-commit wait, a parked long poll's expiry) stay the event loop's
(`call_later`, `loop.time()`): a simulation runs them on a virtual-time loop. What is read
here is the rest. Why not the loop's `time()` for it too: uvloop's is the loop iteration's
cached millisecond, too coarse for a journal sync's latency or a microsecond group wait.
"""
from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

system_monotonic: Clock = time.monotonic
system_wall: Clock = time.time
