"""The machine's ceilings for this workload, measured in the same run as the other figures.

write + fdatasync: one pwrite of the batch then fdatasync, in a loop, on a zero-filled file
in the journal directory (what the journal does per group commit). Loopback echo: a uvloop
server in another process echoes length-prefixed 100-byte frames; the client keeps
`window` frames in flight.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import struct
import tempfile
import time
from pathlib import Path

import uvloop

from bookkeeper.bench import BenchResult, histogram, latency_ms
from bookkeeper.bookie.files import zero_fill

BATCH_SIZES = (4096, 65536, 1 << 20)


def fsync_ceiling(directory: str | os.PathLike[str], batch_bytes: int, seconds: float) -> BenchResult:
    """Batches/s a file in `directory` sustains with write + fdatasync of batch_bytes each."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    h = histogram()
    with tempfile.NamedTemporaryFile(dir=directory, prefix="bench-limits-") as f:
        # Zero-filled like a journal file (not fallocate'd: unwritten extents sync slower),
        # so the journal's figure is compared with what the device gives the journal's way.
        prealloc = max(32 << 20, min(256 << 20, batch_bytes * 64))
        zero_fill(Path(f.name), prealloc)
        fd = f.fileno()
        buf = os.urandom(batch_bytes)
        n, off = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            s = time.perf_counter()
            os.pwrite(fd, buf, off)
            os.fdatasync(fd)
            h.record_value(max(1, int((time.perf_counter() - s) * 1e6)))
            n += 1
            off = (off + batch_bytes) % (prealloc - batch_bytes)
        dt = time.perf_counter() - t0
    return BenchResult(f"write+fdatasync {batch_bytes // 1024} KiB", n / dt, n * batch_bytes / dt / 1e6,
                       latency_ms(h), {"batch_bytes": batch_bytes, "fsyncs_per_s": round(n / dt, 1)})


def _echo_server(port_queue: multiprocessing.Queue) -> None:
    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport

        def data_received(self, data: bytes) -> None:
            self.t.write(data)  # framing is preserved end to end: echo bytes as they come

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        port_queue.put(srv.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    uvloop.run(main())


def echo_ceiling(seconds: float, *, size: int = 100, window: int = 256) -> BenchResult:
    """Framed 100-byte messages/s over loopback on uvloop, pipelined `window` deep."""
    ctx = multiprocessing.get_context("spawn")
    q: multiprocessing.Queue = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(q,), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=30)
        frame = struct.pack(">I", size) + b"x" * size
        flen = len(frame)

        async def client() -> tuple[int, float]:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            received = 0
            sent = 0
            t_end = time.perf_counter() + seconds

            class C(asyncio.Protocol):
                def connection_made(self, t: asyncio.BaseTransport) -> None:
                    self.t = t
                    self.buf = 0

                def data_received(self, data: bytes) -> None:
                    nonlocal received, sent
                    self.buf += len(data)
                    got, self.buf = divmod(self.buf, flen)
                    received += got
                    if time.perf_counter() < t_end:
                        self.t.write(frame * got)
                        sent += got
                    elif received == sent and not done.done():
                        done.set_result(None)

            t, _ = await loop.create_connection(C, "127.0.0.1", port)
            t0 = time.perf_counter()
            t.write(frame * window)
            sent = window
            await done
            dt = time.perf_counter() - t0
            t.close()
            return received, dt

        n, dt = uvloop.run(client())
    finally:
        proc.kill()
        proc.join()
    return BenchResult(f"uvloop echo {size} B x{window}", n / dt, n * size / dt / 1e6,
                       {"p50": 0.0, "p99": 0.0, "p999": 0.0}, {"window": window})


def run_limits(journal_dir: str, seconds: float) -> list[BenchResult]:
    per = seconds / (len(BATCH_SIZES) + 1)
    out = [fsync_ceiling(journal_dir, b, per) for b in BATCH_SIZES]
    out.append(echo_ceiling(per))
    return out
