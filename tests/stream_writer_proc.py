"""A stream writer in its own process, for failover tests: kill -9 and SIGSTOP need a process.

Writes records b"w1-<txid>" with txids 1, 2, 3, ... keeping `inflight` writes outstanding,
and prints one line per acknowledged record, `ACK <txid> <position>`, flushed at once, so the
test knows exactly what this writer saw acknowledged. On the first failed write it prints
`ERR <exception class> fenced=<is a LedgerFencedError>` and exits 3.
"""
from __future__ import annotations

import asyncio
import sys

import uvloop

from bookkeeper import errors
from bookkeeper.stream import Namespace


async def main(uri: str, stream: str, inflight: int, limit: int) -> int:
    async with await Namespace.connect(uri, "failover", zk_session_timeout_ms=4000) as ns:
        w = await ns.open_writer(stream, segment_max_records=200)
        print("READY", flush=True)
        txid = 0
        sem = asyncio.Semaphore(inflight)
        failed = asyncio.Event()
        error: list[BaseException] = []

        async def one(t: int) -> None:
            try:
                pos = await w.write(b"w1-%d" % t, txid=t)
                print(f"ACK {t} {pos}", flush=True)
            except errors.BKError as e:
                error.append(e)
                failed.set()
            finally:
                sem.release()

        tasks = set()
        while not failed.is_set() and txid < limit:
            await sem.acquire()
            txid += 1
            try:
                task = asyncio.ensure_future(one(txid))
            except errors.BKError as e:  # pragma: no cover - write() raises inside the task
                error.append(e)
                break
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks, return_exceptions=True)
        if error:
            e = error[0]
            print(f"ERR {type(e).__name__} fenced={isinstance(e, errors.LedgerFencedError)}", flush=True)
            await w.close()
            return 3
        await w.close()
        print("DONE", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
