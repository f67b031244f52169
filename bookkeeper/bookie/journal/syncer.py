"""Write + fdatasync of one journal block: through io_uring, or a thread (fallback).

Lives in: one shard process, its event loop thread.

io_uring: the block write and an fdatasync are submitted as linked SQEs
(IOSQE_IO_LINK: the sync runs only if the write succeeded); completions raise an
eventfd registered with the ring, which the event loop watches: no thread is
involved. errno from a CQE becomes OSError here and nowhere else.

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
    """Linked write + fdatasync SQEs, completions via an eventfd on the event loop."""

    kind = "io_uring"

    def __init__(self, loop: asyncio.AbstractEventLoop, entries: int = 64) -> None:
        import liburing
        import liburing.common as uring_common
        import liburing.queue as uring_queue

        self._u = liburing
        self._link = int(uring_queue.__queue_define__.IOSQE_IO_LINK)
        self._datasync = int(uring_common.__common_define__.IORING_FSYNC_DATASYNC)
        self._loop = loop
        self._ring = liburing.io_uring()
        liburing.io_uring_queue_init(entries, self._ring)
        self._cqe = liburing.io_uring_cqe()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        liburing.io_uring_register_eventfd(self._ring, self._efd)
        self._next = 2  # even: the write; odd (+1): its fdatasync
        # token -> [iovec, block (both kept alive), fd, offset, bytes written before, done, write result or None]
        self._inflight: dict[int, list] = {}
        loop.add_reader(self._efd, self._on_ready)

    def submit(self, fd: int, buf: bytes | bytearray, offset: int, done: Done) -> None:
        self._submit(fd, buf, offset, 0, done)

    def _submit(self, fd: int, buf: bytes | bytearray, offset: int, written: int, done: Done) -> None:
        """The write of buf[written:] at offset + written, linked to an fdatasync."""
        u = self._u
        token = self._next
        self._next += 2
        part = memoryview(buf)[written:] if written else buf
        iov = u.iovec(part)
        self._inflight[token] = [iov, buf, fd, offset, written, done, None]
        offset += written
        sqe = u.io_uring_get_sqe(self._ring)
        u.io_uring_prep_writev(sqe, fd, iov, 1, offset)
        u.io_uring_sqe_set_flags(sqe, self._link)
        u.io_uring_sqe_set_data64(sqe, token)
        sqe = u.io_uring_get_sqe(self._ring)
        u.io_uring_prep_fsync(sqe, fd, self._datasync)
        u.io_uring_sqe_set_data64(sqe, token + 1)
        u.io_uring_submit(self._ring)

    def _on_ready(self) -> None:
        u = self._u
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        ready = u.io_uring_cq_ready(self._ring)
        for _ in range(ready):
            u.io_uring_peek_cqe(self._ring, self._cqe)
            cqe = self._cqe[0]
            data, res = cqe.user_data, cqe.res
            u.io_uring_cq_advance(self._ring, 1)
            token = data & ~1
            rec = self._inflight.get(token)
            if rec is None:
                continue
            if data & 1 == 0:  # the write
                rec[6] = res
                continue
            del self._inflight[token]
            _, buf, fd, offset, written, done, wres = rec
            step = completion(len(buf), written, wres, res)
            if isinstance(step, int):
                self._submit(fd, buf, offset, step, done)  # short write: the rest, and its sync again
            else:
                done(step)

    def close(self) -> None:
        self._loop.remove_reader(self._efd)
        self._u.io_uring_queue_exit(self._ring)
        os.close(self._efd)


def completion(size: int, written: int, wres: int | None, sres: int) -> int | OSError | None:
    """What the CQEs of one linked write + fdatasync mean for a block of `size` bytes of which
    `written` were already written: an int, how many are written now (a short write: submit
    the rest again; the kernel cancels the linked sync of a short write, so its result is
    moot); None, durable; or the OSError to report. A write that made no progress is EIO, so
    a device that keeps refusing cannot loop forever."""
    if wres is not None and wres < 0:
        return OSError(-wres, f"journal write: {os.strerror(-wres)}")
    if wres is not None and written + wres < size:
        if wres == 0:
            return OSError(errno.EIO, f"journal write made no progress at byte {written} of {size}")
        return written + wres
    if sres < 0:
        return OSError(-sres, f"journal fdatasync: {os.strerror(-sres)}")
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
