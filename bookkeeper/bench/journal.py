"""The journal alone: group commit + write + fdatasync, no network, no client.

Closed loop: `window` records outstanding; each durable callback records the record's
latency (append -> durable) and appends the next. Beside each size, the write+fdatasync
ceiling of this machine at the journal's own mean block size is measured in the same
run, so the figure is printed as a ratio to what the device allows. Every roll trims the
files before the new one, as a shard's checkpoint does when it keeps up, so with
`reuse_files` > 0 rolls overwrite trimmed files and with 0 they take new zero-filled ones.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import uvloop

from bookkeeper._ext.journal import REC_ADD
from bookkeeper.bench import BenchResult, histogram, latency_ms
from bookkeeper.bench.limits import fsync_ceiling
from bookkeeper.bookie.journal import Journal, make_syncer

SIZES = (100, 1024, 65536)


def journal_bench(directory: str, size: int, seconds: float, *, sync: str = "io_uring",
                  window: int = 1000, reuse_files: int = 4) -> BenchResult:
    """Entries/s of one journal for entries of `size` bytes, `window` records offered at a time
    (appended as the batch's bounds allow, as a shard's backpressure would)."""
    work = tempfile.mkdtemp(prefix="bench-journal-", dir=directory)
    h = histogram()

    async def main() -> tuple[int, float, dict, str]:
        loop = asyncio.get_running_loop()
        syncer = make_syncer(sync, loop)
        payload = os.urandom(size)
        done_count = 0
        owed = 0  # records offered but not appended: the journal's batch was full
        t_end = time.perf_counter() + seconds
        finished = loop.create_future()
        journal: Journal

        def offer(k: int) -> None:
            """Append k more records, as a shard would: none while the batch is full (backpressure)."""
            nonlocal owed
            owed += k
            while owed and not journal.full:
                journal.append(REC_ADD, 1, done_count + owed, payload, time.perf_counter())
                owed -= 1

        def on_durable(items: list) -> None:
            nonlocal done_count
            now = time.perf_counter()
            counts = h.counts
            for t in items:
                counts[int((now - t) * 1e6)] += 1
            done_count += len(items)
            if journal.file_id != file_ids[-1]:  # rolled: the checkpoint keeps up
                file_ids.append(journal.file_id)
                journal.trim(journal.file_id)
            if now < t_end:
                offer(len(items))
            elif journal.idle and not finished.done():
                finished.set_result(None)

        def on_failed(items: list, err: OSError) -> None:
            if not finished.done():
                finished.set_exception(err)

        journal = Journal(work, syncer=syncer, loop=loop, on_durable=on_durable, on_failed=on_failed,
                          reuse_files=reuse_files)
        journal.start()
        file_ids = [journal.file_id]
        t0 = time.perf_counter()
        # Two groups of records, the second offered once the first is in flight: from then on
        # one group fills the next block while the other's sync runs, as under steady traffic
        # (a single group would leave the device idle while its records are re-offered).
        offer(window // 2)
        loop.call_soon(offer, window - window // 2)
        await finished
        dt = time.perf_counter() - t0
        stats = dict(journal.stats)
        journal.close()
        syncer.close()
        return done_count, dt, stats, syncer.kind

    try:
        n, dt, stats, kind = uvloop.run(main())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    blocks = max(1, stats["blocks"])
    mean_block = stats["bytes"] // blocks
    ceiling = fsync_ceiling(directory, max(4096, mean_block), min(2.0, seconds / 2))
    fsyncs = blocks / dt
    return BenchResult(f"journal {size} B ({kind})", n / dt, n * size / dt / 1e6, latency_ms(h), {
        "entry_bytes": size, "sync": kind, "fsyncs_per_s": round(fsyncs, 1),
        "entries_per_fsync": round(n / blocks, 1), "mean_block_bytes": mean_block,
        "ceiling_fsyncs_per_s_at_block": round(ceiling.ops_per_s, 1),
        "fsync_ratio_to_ceiling": round(fsyncs / ceiling.ops_per_s, 3) if ceiling.ops_per_s else None,
        "reuse_files": reuse_files, "rolls_reused": stats["reused_rolls"], "rolls_unfilled": stats["unfilled_rolls"],
        "rolls_deferred": stats["deferred_rolls"],
    })


def run_journal(directory: str, seconds: float, *, sync: str, sizes: tuple[int, ...] = SIZES,
                window: int = 1000, reuse_files: int = 4) -> list[BenchResult]:
    return [journal_bench(directory, s, seconds / len(sizes) * 0.7, sync=sync, window=window,
                          reuse_files=reuse_files) for s in sizes]
