# examples/streams.py: a stream written, then read back by a reader that tails it
import asyncio
import os

from bookkeeper.errors import StreamExistsError
from bookkeeper.stream import Namespace

METADATA_URI = os.environ.get("BK_METADATA_URI", "zk://127.0.0.1:2181/ledgers")


async def main() -> None:
    async with await Namespace.connect(METADATA_URI, "default") as ns:
        try:
            await ns.create_stream("events", retention_max_bytes=10 << 30)
        except StreamExistsError:
            pass                                        # a second run appends to it
        async with await ns.open_writer("events") as w:
            first = await w.write(b"record")            # a Position, once acknowledged
            last = (await w.write_batch([b"a", b"b"]))[-1]
        async with await ns.open_reader("events", start=first) as r:
            async for rec in r:                         # tails the stream: never ends by itself
                print(rec.position, rec.txid, rec.data)
                if rec.position == last:
                    break


asyncio.run(main())
