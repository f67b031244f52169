# examples/client.py: a ledger written (100 adds in flight, then a batch), closed and read back
import asyncio
import os

from bookkeeper import BookKeeper, DigestType

METADATA_URI = os.environ.get("BK_METADATA_URI", "zk://127.0.0.1:2181/ledgers")


async def main() -> None:
    async with await BookKeeper.connect(METADATA_URI) as bk:
        lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2,
                                    digest=DigestType.CRC32C, password=b"secret")
        await asyncio.gather(*(lh.add_entry_async(b"event %d" % i) for i in range(100)))
        ids = await lh.add_entries([b"batch %d" % i for i in range(100)])  # one future for all: 100..199
        await lh.close()
        rh = await bk.open_ledger(lh.ledger_id, password=b"secret")
        entries = await rh.read(0, rh.last_add_confirmed)
        print(f"ledger {lh.ledger_id}: entries 0..{ids[-1]}", [e.data for e in entries[:3]])


asyncio.run(main())
