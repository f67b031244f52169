"""Sans-I/O client core: striping, ack-quorum and LAC bookkeeping, fencing coverage.

Plain classes and pure functions: no sockets, no loop, no clock. The shell
(bookkeeper.client.ledger) owns connections, futures and timers.
"""
from bookkeeper.client.core.quorum import (  # noqa: F401
    AddTracker,
    fence_covered,
    entry_missing,
    write_set,
)
