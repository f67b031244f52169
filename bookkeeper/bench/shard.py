"""In-shard load: a shard's own storage path (codec, dispatch, journal, write cache,
response encoding) driven without the network or a client, one pinned process per shard.

Why: with two cores shared by client and bookie, a Python client saturates first and
hides the bookie's capacity and its per-core scaling. Here each process builds a real
ShardServer + Journal + LedgerStorage, and feeds one pre-encoded buffer of `window` ADD
frames into the protocol's data_received, again and again as the answers come back (the
same entry ids are rewritten: the journal and storage do the full work, the load costs
nothing). Figures are entries acknowledged per second, summed over the processes.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bookkeeper.bench import BenchResult, histogram, latency_ms, peak_rss_mb
from bookkeeper.proto import RESPONSE_HEADER_BYTES


class _CountingTransport(asyncio.Transport):
    """Stands in for the socket: counts answered adds (each response is a bare header)."""

    def __init__(self, on_answers: Any) -> None:
        super().__init__()
        self._on_answers = on_answers

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self._on_answers(len(data) // RESPONSE_HEADER_BYTES)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _worker(index: int, directory: str, size: int, seconds: float, window: int, sync: str,
            queue: multiprocessing.Queue) -> None:
    from bookkeeper.bookie.journal import Journal, make_syncer
    from bookkeeper.bookie.server import BookieProtocol, ShardServer
    from bookkeeper.bookie.shard import pin_to_core
    from bookkeeper.bookie.storage import LedgerStorage
    from bookkeeper.client.digest import DigestManager, master_key
    from bookkeeper.meta.ledger_metadata import DigestType
    from bookkeeper.proto import Op, encode_request

    pin_to_core(index)
    work = Path(directory) / f"shard-{index}"
    h = histogram()

    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        storage = LedgerStorage(work / "ledgers")
        server = ShardServer(storage=storage, shard_index=0, shards=1, max_frame_bytes=5 << 20, readonly=False,
                             data_dir=str(work))
        syncer = make_syncer(sync, loop)
        journal = Journal(work / "journal", syncer=syncer, loop=loop, on_durable=server.on_durable,
                          on_failed=server.on_failed)
        journal.start()
        server.journal = journal
        key = master_key(b"bench")
        data = os.urandom(size)
        ledgers = 8
        frames = []
        for i in range(window):
            lid, eid = 1 + i % ledgers, i // ledgers
            payload = DigestManager(lid, DigestType.CRC32C, b"bench").encode(eid, eid - 1, (eid + 1) * size, data)
            frames.append(encode_request(Op.ADD_ENTRY, 0, i, lid, eid, key, 0, payload))
        buffer = b"".join(frames)
        answered = 0
        sent_at = time.perf_counter()
        t_end = sent_at + seconds
        done = loop.create_future()
        proto = BookieProtocol(server)

        def on_answers(n: int) -> None:
            nonlocal answered, sent_at
            answered += n
            if answered % window == 0:  # the whole buffer is answered: record and send it again
                now = time.perf_counter()
                h.record_value(max(1, int((now - sent_at) * 1e6)))
                if now < t_end:
                    sent_at = now
                    loop.call_soon(proto.data_received, buffer)
                elif not done.done():
                    done.set_result(None)

        proto.connection_made(_CountingTransport(on_answers))
        t0 = time.perf_counter()
        proto.data_received(buffer)
        await done
        dt = time.perf_counter() - t0
        journal.close()
        syncer.close()
        storage.close()
        return answered, dt

    n, dt = uvloop.run(main())
    queue.put((index, n, dt, latency_ms(h), peak_rss_mb(os.getpid())))


def in_shard_bench(directory: str, *, shards: int, size: int, seconds: float, window: int,
                   sync: str = "io_uring") -> BenchResult:
    """`shards` pinned processes, each driving its own storage path; figures summed."""
    work = tempfile.mkdtemp(prefix="inshard-", dir=directory)
    ctx = multiprocessing.get_context("spawn")
    q: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, work, size, seconds, window, sync, q)) for i in range(shards)]
    for p in procs:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    total = sum(r[1] / r[2] for r in results)
    worst = max(results, key=lambda r: r[3]["p99"])
    return BenchResult(f"in-shard {shards} shard(s) {size} B W={window}", total, total * size / 1e6, worst[3], {
        "shards": shards, "entry_bytes": size, "sync": sync, "mode": "in-shard (no network, no client)",
        "per_shard_ops_per_s": [round(r[1] / r[2], 1) for r in sorted(results)],
        "latency_note": "per window of adds, slowest shard",
        "peak_rss_mb": {f"shard{r[0]}": r[4] for r in results},
    })
