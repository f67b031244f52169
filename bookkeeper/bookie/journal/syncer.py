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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
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
