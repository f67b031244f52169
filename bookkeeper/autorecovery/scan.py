"""A paged scan of every ledger's metadata: the auditor's (for lost bookies) and `bk recover`'s.

Why paged: at 10^6 ledgers the metadata does not belong in memory at once. The scan walks
the ledger hierarchy (docs/metadata.md) one bucket (<= 10^4 ids) at a time and reads the
metadata SCAN_BATCH znodes per round trip (pipelined gets), so it holds at most one
bucket's ids and one batch of metadata. Reads: 1 for the first level, 1 per first-level
node, 1 per bucket, 1 per ledger.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from bookkeeper.autorecovery.policy import ledger_bookies
from bookkeeper.client.client import BookKeeper
from bookkeeper.meta.ledger_metadata import LedgerMetadata

SCAN_BATCH = 100  # metadata reads per round trip

T = TypeVar("T")
BeforeReads = Callable[[int], Awaitable[None]]


async def _nothing(_n: int) -> None:
    return None


async def scan_metadata(bk: BookKeeper, *, before_reads: BeforeReads = _nothing,
                        batch: int = SCAN_BATCH) -> AsyncIterator[list[LedgerMetadata]]:
    """Every ledger's metadata, in id order, one batch at a time (deleted ones left out).

    before_reads(n) is awaited before each ZooKeeper call that makes n reads: the auditor
    counts and throttles there."""
    store = bk.store

    async def read(n: int, fn: Callable[..., T], *args: Any) -> T:
        await before_reads(n)
        return await bk.metadata_call(fn, *args)

    buckets = store.ledger_buckets()
    while (bucket := await read(1, next, buckets, None)) is not None:
        ids = await read(1, store.bucket_ledger_ids, bucket)
        for start in range(0, len(ids), batch):
            chunk = ids[start:start + batch]
            mds = await read(len(chunk), store.read_ledgers, chunk)
            yield [md for md in mds if md is not None]


async def ledgers_on(bk: BookKeeper, bookie_id: str) -> list[int]:
    """Ids of every ledger whose metadata names the bookie (segments or a recovery's copy)."""
    out: list[int] = []
    async for mds in scan_metadata(bk):
        out.extend(md.ledger_id for md in mds if bookie_id in ledger_bookies(md))
    return out
