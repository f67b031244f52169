"""Write + fdatasync of one journal block: through io_uring, or a thread (fallback).

Lives in: one shard process, its event loop thread.

io_uring: each block is one write SQE with RWF_DSYNC (the write completes once its
bytes are durable, as a write + fdatasync would), submitted and reaped in Cython
(ext/bookkeeper/_ext/uring.pyx); the event loop watches the ring's fd: no thread and no
eventfd are involved. errno from a CQE becomes OSError here and nowhere else.

python-liburing 2024.5.3 (the Cython build) is used: the 2026.x Zig wheels crash
with SIGILL on CPUs without AVX-512 (see pyproject.toml). A crash like that cannot be
caught in-process, so the supervisor first runs one real write + fdatasync through
io_uring in a child process (`probe_io_uring`) and, if the child fails or dies,
starts its shards on the thread syncer, logging one line.

Test only: AckBeforeSyncSyncer, the ack_before_sync switch (bookkeeper/testing_switches.py),
wraps either and breaks the journal's promise on purpose; a shard uses it only when its
environment names the switch.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
import os
import signal
import subprocess
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bookkeeper.procs import python_command

log = logging.getLogger(__name__)

Done = Callable[[OSError | None], None]


class Syncer(Protocol):
    kind: str

    def submit(self, fd: int, buf: bytes | bytearray, offset: int, done: Done) -> None:
        """Write buf at offset, then fdatasync; call done(None) or done(OSError) on the loop."""

    def close(self) -> None: ...


class ThreadSyncer:
    """pwrite + fdatasync on one worker thread; the completion hops back to the loop."""

    kind = "thread"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="journal-sync")

    @staticmethod
    def _write_sync(fd: int, buf: bytes | bytearray, offset: int) -> None:
        view = memoryview(buf)
        while view:  # a short write is retried from where it stopped
            n = os.pwrite(fd, view, offset)
            if n == 0:
                raise OSError(errno.EIO, f"journal write made no progress at offset {offset}")
            view = view[n:]
            offset += n
        os.fdatasync(fd)

    def submit(self, fd: int, buf: bytes | bytearray, offset: int, done: Done) -> None:
        fut = self._pool.submit(self._write_sync, fd, buf, offset)

        def finished(f: concurrent.futures.Future[None]) -> None:
            exc = f.exception()
            self._loop.call_soon_threadsafe(done, exc if isinstance(exc, OSError) or exc is None
                                            else OSError(errno.EIO, str(exc)))
        fut.add_done_callback(finished)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class UringSyncer:
    """One O_DSYNC write SQE per block (ext/bookkeeper/_ext/uring.pyx); the event loop watches
    the ring's fd, and a readable ring is reaped in one C call."""

    kind = "io_uring"

    def __init__(self, loop: asyncio.AbstractEventLoop, entries: int = 64) -> None:
        from bookkeeper._ext.uring import Ring

        self._loop = loop
        self._ring = Ring(entries)
        self._next = 1
        # token -> [view of the unwritten rest (pins a bytearray), block, fd, offset, bytes written before, done]
        self._inflight: dict[int, list] = {}
        loop.add_reader(self._ring.fd, self._on_ready)

    def submit(self, fd: int, buf: bytes | bytearray, offset: int, done: Done) -> None:
        self._submit(fd, buf, offset, 0, done)

    def _submit(self, fd: int, buf: bytes | bytearray, offset: int, written: int, done: Done) -> None:
        """The durable write of buf[written:] at offset + written."""
        token = self._next
        self._next += 1
        view = memoryview(buf)[written:]
        self._inflight[token] = [view, buf, fd, offset, written, done]
        try:
            self._ring.submit_write(fd, view, offset + written, token)
        except OSError as e:
            del self._inflight[token]
            view.release()
            done(e)

    def _on_ready(self) -> None:
        for token, res in self._ring.reap():
            rec = self._inflight.pop(token, None)
            if rec is None:
                continue
            view, buf, fd, offset, written, done = rec
            view.release()
            step = completion(len(buf), written, res)
            if isinstance(step, int):
                self._submit(fd, buf, offset, step, done)  # short write: the rest, synced too
            else:
                done(step)

    def close(self) -> None:
        self._loop.remove_reader(self._ring.fd)
        self._ring.close()


def completion(size: int, written: int, res: int) -> int | OSError | None:
    """What the CQE of one O_DSYNC write means for a block of `size` bytes of which `written`
    were already durable: an int, how many are written now (a short write: submit the rest
    again); None, durable; or the OSError to report. A write that made no progress is EIO, so
    a device that keeps refusing cannot loop forever."""
    if res < 0:
        return OSError(-res, f"journal write (O_DSYNC): {os.strerror(-res)}")
    if written + res < size:
        if res == 0:
            return OSError(errno.EIO, f"journal write made no progress at byte {written} of {size}")
        return written + res
    return None


def make_syncer(kind: str, loop: asyncio.AbstractEventLoop) -> Syncer:
    """The configured syncer; io_uring falls back to the thread syncer, logged once."""
    if kind == "thread":
        return ThreadSyncer(loop)
    try:
        return UringSyncer(loop)
    except (ImportError, OSError) as e:
        log.warning("io_uring unavailable (%s): journal falls back to thread-based fdatasync", e)
        return ThreadSyncer(loop)


@dataclass(slots=True)
class _Held:
    """A block answered as durable, not yet handed to the real syncer."""

    due: float  # loop time from which it may be written
    fd: int  # a dup of the journal's fd: the journal may roll (close its own) meanwhile
    inode: int
    buf: bytes  # a copy: the journal reuses its block buffer once told the block is durable
    offset: int


class AckBeforeSyncSyncer:
    """TEST ONLY, the ack_before_sync switch: says every block is durable on the next loop turn,
    then writes it (through the real syncer) only hold_s later. A kill -9 meanwhile loses adds
    the bookie acknowledged, for real: the proof that `bk verify` can see a loss.

    Blocks are still written strictly in order, one write in flight, so a torn block can only
    be the last one (replay's rule); the blocks due by then that follow on in the same file go
    in that one write, so the device sees one write per due run, not one per block, and the
    queue holds about hold_s of adds while the device keeps up.
    """

    def __init__(self, inner: Syncer, loop: asyncio.AbstractEventLoop, hold_s: float) -> None:
        self.kind = f"{inner.kind}+ack_before_sync"
        self._inner, self._loop, self._hold_s = inner, loop, hold_s
        self._held: deque[_Held] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._writing = False

    def submit(self, fd: int, buf: bytes | bytearray, offset: int, done: Done) -> None:
        self._held.append(_Held(self._loop.time() + self._hold_s, os.dup(fd), os.fstat(fd).st_ino, bytes(buf),
                                offset))
        self._loop.call_soon(done, None)  # the lie: answered before a byte is written
        self._schedule()

    def _schedule(self) -> None:
        if self._held and not self._writing and self._timer is None:
            self._timer = self._loop.call_at(self._held[0].due, self._write_due)

    def _write_due(self) -> None:
        self._timer = None
        first = self._held.popleft()
        parts, end, now = [first.buf], first.offset + len(first.buf), self._loop.time()
        while self._held and self._held[0].due <= now and self._held[0].inode == first.inode \
                and self._held[0].offset == end:
            block = self._held.popleft()
            os.close(block.fd)
            parts.append(block.buf)
            end += len(block.buf)
        self._writing = True
        self._inner.submit(first.fd, b"".join(parts), first.offset, functools.partial(self._written, first.fd))

    def _written(self, fd: int, err: OSError | None) -> None:
        os.close(fd)
        self._writing = False
        if err is not None:
            log.error("journal write of blocks already acknowledged failed (ack_before_sync): %s", err)
        self._schedule()

    def close(self) -> None:
        """Drop what is still held: a graceful stop has checkpointed it into the entry logs."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._held:
            os.close(self._held.popleft().fd)
        self._inner.close()


def uring_self_test(directory: str) -> None:
    """One block written and fdatasync'ed through a UringSyncer on a fresh loop; raises if it fails."""
    loop = asyncio.new_event_loop()
    try:
        syncer = UringSyncer(loop)
        done: asyncio.Future[OSError | None] = loop.create_future()
        with tempfile.TemporaryFile(dir=directory) as f:
            syncer.submit(f.fileno(), bytes(4096), 0, done.set_result)
            err = loop.run_until_complete(asyncio.wait_for(done, 10))
        syncer.close()
        if err is not None:
            raise err
    finally:
        loop.close()


def probe_io_uring(directory: str, timeout_s: float = 30.0) -> str | None:
    """Run `uring_self_test` in a child process: None if io_uring works here, else why not.

    In a child because the failure that matters most (SIGILL inside the library) kills
    the process that meets it.
    """
    code = f"from bookkeeper.bookie.journal.syncer import uring_self_test; uring_self_test({directory!r})"
    try:
        proc = subprocess.run(python_command("-c", code), stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"self-test did not finish within {timeout_s:.0f}s"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        return f"self-test killed by {signal.Signals(-proc.returncode).name}"
    lines = proc.stderr.decode(errors="replace").strip().splitlines()
    return f"self-test failed: {lines[-1] if lines else f'exit code {proc.returncode}'}"
