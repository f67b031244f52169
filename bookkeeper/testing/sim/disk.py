"""A simulated journal device: the `Syncer` protocol over real files, with virtual-time
latency, EIO, and crashes that keep what was synced and a torn prefix of the rest.

Each submit writes its bytes at once (the file is what replay will read) and keeps the
bytes they overwrote; the sync completes after a seeded latency, in submission order. A
crash (`crash`) walks the writes not yet synced, newest first, and puts back what each
overwrote from a random cut on: what a power loss leaves of a write the kernel had not
made durable. Synced bytes are never touched: losing them is a budget the simulator does
not spend (docs/simulation.md).

The ledger storage (entry logs, LMDB index) is left as written: the simulator's crashes
are process crashes for it, after which the journal replays from the last checkpoint.
"""
from __future__ import annotations

import asyncio
import errno
import os
import random
from collections import deque
from collections.abc import Callable
from typing import Any


SECTOR_BYTES = 512  # what a power loss keeps or loses of an unsynced write, at least


class SimSyncer:
    """The journal's device in a simulation (`bookkeeper.bookie.journal.syncer.Syncer`)."""

    kind = "sim"

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, *,
                 latency_s: tuple[float, float] = (100e-6, 2e-3), eio_rate: float = 0.0,
                 ack_before_sync: bool = False) -> None:
        self.loop = loop
        self.rng = rng
        self.latency_s = latency_s
        self.eio_rate = eio_rate
        # The mutation "ack before fdatasync": done(None) at once, the bytes made durable
        # only a sync latency later (a crash in between tears acknowledged bytes).
        self.ack_before_sync = ack_before_sync
        self.unsynced: deque[list[Any]] = deque()  # [fd, its inode, offset, old bytes, new length]
        self.written: dict[str, list[tuple[int, int]]] = {}  # file -> its last writes (offset, length)
        self._last = 0.0
        self.closed = False
        self.stats = {"submits": 0, "eio": 0, "torn_writes": 0}

    def submit(self, fd: int, buf: bytes | bytearray, offset: int, done: Callable[[OSError | None], None]) -> None:
        self.stats["submits"] += 1
        data = bytes(buf)
        old = os.pread(fd, len(data), offset)
        os.pwrite(fd, data, offset)
        entry = [fd, os.fstat(fd).st_ino, offset, old.ljust(len(data), b"\0"), len(data)]
        writes = self.written.setdefault(os.readlink(f"/proc/self/fd/{fd}"), [])
        writes.append((offset, len(data)))
        del writes[:-64]
        self.unsynced.append(entry)
        lo, hi = self.latency_s
        self._last = max(self._last, self.loop.time()) + self.rng.uniform(lo, hi)
        fail = self.eio_rate and self.rng.random() < self.eio_rate

        def synced() -> None:
            if entry in self.unsynced:
                self.unsynced.remove(entry)

        def complete() -> None:
            if self.closed:
                return
            if fail:
                self.stats["eio"] += 1
                done(OSError(errno.EIO, "simulated EIO on journal sync"))
                return
            synced()
            done(None)

        if self.ack_before_sync and not fail:
            self.loop.call_soon(done, None)
            self.loop.call_at(self._last, synced)
        else:
            self.loop.call_at(self._last, complete)

    def crash(self) -> int:
        """Power loss: each unsynced write is lost whole (as often: the page cache never reached
        the device) or keeps a prefix of whole sectors; returns how many were torn. Why sectors,
        not bytes: a device writes a sector or not, and a byte cut lands in a block's padding
        (a journal block is mostly padding) far more often than in its records."""
        torn = 0
        for fd, inode, offset, old, n in reversed(self.unsynced):
            cut = 0 if self.rng.random() < 0.5 else min(n, SECTOR_BYTES * self.rng.randint(0, -(-n // SECTOR_BYTES)))
            try:
                if cut == n or os.fstat(fd).st_ino != inode:
                    continue  # kept whole; or the file was closed (rolled, trimmed), its fd reused
                os.pwrite(fd, old[cut:], offset + cut)
                torn += 1
            except OSError:
                pass  # closed meanwhile
        self.unsynced.clear()
        self.stats["torn_writes"] += torn
        self.closed = True
        return torn

    def rot(self, replayed: Callable[[str, int], bool]) -> str | None:
        """Damage a synced write that a later write of the same file follows (bit rot, a
        misdirected write: what only a disk does to acknowledged bytes), among those
        replayed(file, offset) says the next start reads; returns the file, or None when there
        is no such write. Call after crash(): nothing is in flight then."""
        candidates = sorted((p, off, n) for p, w in self.written.items() if os.path.exists(p)
                            for off, n in w[:-1] if replayed(p, off))
        if not candidates:
            return None
        path, offset, n = self.rng.choice(candidates)
        at = offset + self.rng.randint(0, min(n, 64) - 1)  # the block's head or first record, not its padding
        with open(path, "r+b") as f:
            f.seek(at)
            chunk = f.read(8)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in chunk))
        return path

    def close(self) -> None:
        self.closed = True
