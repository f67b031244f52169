# examples/connect_settings.py: the client's settings are keyword arguments of connect
import asyncio
import os

from bookkeeper import BookKeeper

METADATA_URI = os.environ.get("BK_METADATA_URI", "zk://127.0.0.1:2181/ledgers")


async def main() -> None:
    async with await BookKeeper.connect(METADATA_URI, add_timeout_s=5.0, read_timeout_s=10.0,
                                        speculative_read_timeout_ms=100, max_outstanding_adds=20_000,
                                        placement="rack_aware", placement_strict=False,
                                        bookie_quarantine_s=1800.0) as bk:
        print(bk.config)


asyncio.run(main())
