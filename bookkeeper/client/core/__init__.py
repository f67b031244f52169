"""Sans-I/O client core: striping, ack-quorum and LAC bookkeeping, fencing coverage.

Plain classes and pure functions: no sockets, no loop, no clock. The shell
(bookkeeper.client.ledger) owns connections and timers; the AddTracker (Cython, the
add hot path) also holds each outstanding entry's future so it can resolve a whole
acknowledged run in one call.
"""
from bookkeeper._ext.client import AckSink, AddTracker
from bookkeeper.client.core.quorum import entry_missing, fence_covered, write_set

__all__ = ["AckSink", "AddTracker", "entry_missing", "fence_covered", "write_set"]
