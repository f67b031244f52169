"""The clocks the shard and the client read, passed in rather than read from `time` where the
decisions are made (issue 25 item 3): production passes these, a simulator its own virtual
ones, so the same code runs in virtual time. `system_monotonic` measures intervals (timeouts,
latencies, group-commit waits); `system_wall` is calendar time (token expiry, which a token states
in seconds since the epoch).

Why not the event loop's `time()`: uvloop's is the loop iteration's cached millisecond, too
coarse for a journal sync's latency or a microsecond group wait.
"""
from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

system_monotonic: Clock = time.monotonic
system_wall: Clock = time.time
