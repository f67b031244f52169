"""Where a chosen peer's adds spend their time in a shard (issue 28: the slow adds' breakdown).

An operator (or `bk bench neighbour`) names peers, as the `host:port` their connections come
from, for a bounded time; for each of their adds made durable the shard then keeps one record
of the timestamps it takes anyway: the receive buffer's arrival, when the journal block
holding the add was sealed and handed to the syncer, when the loop learned the block was
durable, and when the write of the add's answer to its socket began (a stamp after the
write could come later than the peer's receipt, on another core). Between them: the wait
for the journal block (a sync in flight ahead of it, a group wait), the write and sync, and
the work of answering the connections of that block before this one.

Why by peer and not for every add: the records of a bulk writer would bury the one service
being looked at, and recording every add would cost the hot path; with no trace running the
shard's only cost is one test of `ShardServer.add_trace` per durable block; while one runs,
a clock read per connection answered. Why these stamps: the others are the shard's own (no
clock read per add); the clock is
CLOCK_MONOTONIC (time.monotonic), which every process of one host shares, so a client on the
same host can lay its own send and receive times beside them.
"""
from __future__ import annotations

import itertools
import math
import weakref
from collections import deque
from typing import Any

MAX_PEERS = 64
MAX_SECONDS = 600.0
MAX_RECORDS = 65536  # per shard (~250 B each): a W=1 writer at ~2,000 adds/s for 30 s; older ones drop first
# Records per control answer: the shard encodes its answer on its loop, and 34,000 records at
# once held it 20-84 ms (measured: the bench's own read of the trace showed as the phase's
# longest loop stall); a page of this many costs ~2-4 ms.
REPORT_PAGE = 2048
# One record: the peer, then seconds (monotonic) and counts, in this order.
FIELDS = ("peer", "arrival", "sealed", "synced", "answered", "adds", "block_records", "block_bytes")


def parse_peers(peers: Any) -> frozenset[str]:
    """The peers of a trace request: a non-empty list of at most MAX_PEERS `host:port`
    strings (ValueError naming what is wrong otherwise)."""
    if not isinstance(peers, list) or not peers:
        raise ValueError("peers: a non-empty list of 'host:port' strings")
    if len(peers) > MAX_PEERS:
        raise ValueError(f"peers: at most {MAX_PEERS}, got {len(peers)}")
    for p in peers:
        host, sep, port = p.rpartition(":") if isinstance(p, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"peers: {p!r} is not 'host:port'")
    return frozenset(peers)


def parse_seconds(seconds: Any) -> float:
    """A trace's duration: a number in (0, MAX_SECONDS]."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds: a number in (0, {MAX_SECONDS:g}], got {seconds!r}")
    return float(seconds)


def peer_name(peername: Any) -> str | None:
    """`host:port` of a transport's peername (IPv4 or IPv6 tuple); None for anything else
    (a Unix socket, a closed transport)."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"{peername[0]}:{peername[1]}"
    return None


class AddTrace:
    """One running trace of a shard: its peers, its deadline, its records (oldest dropped
    past MAX_RECORDS, counted)."""

    __slots__ = ("peers", "until", "records", "dropped", "_names")

    def __init__(self, peers: frozenset[str], until: float) -> None:
        self.peers = peers
        self.until = until
        self.records: deque[tuple[Any, ...]] = deque(maxlen=MAX_RECORDS)
        self.dropped = 0
        # connection -> its traced peer name, or None; weak: a trace of 600 s on a shard whose
        # connections come and go must not keep the closed ones (their buffers) alive
        self._names: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()

    def traced(self, conn: Any) -> str | None:
        """The connection's peer name if it is traced (looked up once per connection)."""
        try:
            return self._names[conn]
        except KeyError:
            name = peer_name(conn.peer)
            self._names[conn] = found = name if name in self.peers else None
            return found

    def record(self, items: list[Any], block: tuple[float, float, int, int], answered: dict[Any, float]) -> None:
        """The traced adds among a durable block's journal items (server.ShardServer.on_durable's
        shapes: (conn, None, arrival, count, nbytes, record bytes) for a run of the C add path, (conn,
        response, arrival) for one add of the Python path; other items are not adds), with
        when each connection's answer began to be written (`answered`)."""
        sealed, synced, block_records, block_bytes = block
        for item in items:
            conn = item[0]
            if conn is None:
                continue
            name = self.traced(conn)
            if name is None:
                continue
            if item[1] is None:
                adds = item[3]
            elif item[1][0] == 1:  # Op.ADD_ENTRY
                adds = 1
            else:
                continue
            if len(self.records) == MAX_RECORDS:
                self.dropped += 1
            self.records.append((name, item[2], sealed, synced, answered[conn], adds, block_records, block_bytes))

    def report(self, now: float, start: int = 0, limit: int = REPORT_PAGE) -> dict[str, Any]:
        """What the control op answers: a page of records (as lists, FIELDS order) and the
        trace's state. Records are numbered from the trace's first, dropped ones included: the
        page holds at most `limit` from number `start` on (from the oldest kept one if `start`
        was dropped); `next` is the number after its last, `end` the number after the newest.
        remaining_s is rounded up, so 0 means it records no more."""
        first = max(start, self.dropped)
        skip = first - self.dropped  # islice walks the deque from its left: a whole read is ~32 pages of it
        page = [list(r) for r in itertools.islice(self.records, skip, skip + max(0, limit))]
        return {"fields": list(FIELDS), "records": page, "next": first + len(page),
                "end": self.dropped + len(self.records), "dropped": self.dropped, "peers": sorted(self.peers),
                "remaining_s": math.ceil(max(0.0, self.until - now) * 1000) / 1000}
