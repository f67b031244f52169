"""Ledgers as a Spark table: planning on the driver (metadata only), range reads on executors.

Why the driver reads no entry of a closed ledger: its metadata says how many entries and
bytes it has, which is all planning needs; an open ledger (with include_open) costs one LAC
read and one entry read (its length so far), and is never fenced. Executors read their range
with pipelined range reads, one Arrow batch of about BATCH_BYTES at a time, so a partition of
a 10 GB ledger holds one batch, not the ledger.
"""
from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

import bookkeeper.sync
from bookkeeper.client import BookKeeper
from bookkeeper.errors import BKError, NoSuchLedgerError, UnauthorizedError
from bookkeeper.meta.ledger_metadata import password_digest
from bookkeeper.spark.options import SourceOptions, chunk_entries
from bookkeeper.spark.planning import Bounds, LedgerRange, balance, split_ledger

LEDGER_SCHEMA = "ledger_id long, entry_id long, data binary"
LEDGER_ARROW = pa.schema([("ledger_id", pa.int64()), ("entry_id", pa.int64()), ("data", pa.binary())])


async def _wanted_ids(bk: BookKeeper, opts: SourceOptions, bounds: Bounds) -> list[int]:
    spec = opts.ledgers
    assert spec is not None
    ids = set(spec.singles)
    if spec.ranges:
        ids |= {lid async for lid in bk.list_ledgers() if spec.wants(lid)}
    return sorted(lid for lid in ids if bounds.has_ledger(lid))


async def plan_ledgers(opts: SourceOptions, bounds: Bounds | None = None) -> list[LedgerRange]:
    """The partitions of a ledgers read. A single id that names no ledger fails; ids in a
    range that name none are skipped; open ledgers are skipped unless include_open. `bounds`
    (pushed-down filters) drop ledgers and clip entry ranges exactly."""
    bounds = bounds or Bounds()
    async with await BookKeeper.connect(opts.metadata_uri) as bk:
        out: list[LedgerRange] = []
        for lid in await _wanted_ids(bk, opts, bounds):
            try:
                md = await bk.ledger_metadata(lid)
            except NoSuchLedgerError:
                if lid in opts.ledgers.singles:  # type: ignore[union-attr]
                    raise NoSuchLedgerError(f"ledger {lid}, named in the ledgers option, does not exist") from None
                continue
            if password_digest(opts.password) != md.password_digest:
                raise UnauthorizedError(f"ledger {lid}: wrong password (option password)")
            if md.is_closed:
                out += split_ledger(lid, md.last_entry_id, md.length, opts.max_entries_per_partition, bounds=bounds)
            elif opts.include_open:
                rh = await bk.open_ledger(lid, password=opts.password, recovery=False)
                lac = rh.last_add_confirmed
                length = (await rh.read(lac, lac))[0].length if lac >= 0 else 0
                out += split_ledger(lid, lac, length, opts.max_entries_per_partition, bounds=bounds)
        return balance(out)


def read_ledger_range(opts: SourceOptions, r: LedgerRange) -> Iterator[pa.RecordBatch]:
    """One partition on an executor: its own client and loop, closed when the range is done.
    One range read is always in flight ahead of the batch being built (network and Arrow overlap)."""
    bk = bookkeeper.sync.BookKeeper.connect(opts.metadata_uri)
    try:
        rh = bk.open_ledger(r.ledger_id, password=opts.password, digest=opts.digest, recovery=False)
        step = chunk_entries(r.planned_bytes, r.last - r.first + 1)
        chunks = [(a, min(r.last, a + step - 1)) for a in range(r.first, r.last + 1, step)]
        ahead = rh.read_async(*chunks[0]) if chunks else None
        for i, (a, b) in enumerate(chunks):
            try:
                entries = ahead.result()  # type: ignore[union-attr]
            except BKError as e:
                raise type(e)(f"bookkeeper source: ledger {r.ledger_id}, reading entries {a}..{b}: {e}") from e
            ahead = rh.read_async(*chunks[i + 1]) if i + 1 < len(chunks) else None
            yield pa.RecordBatch.from_arrays(
                [pa.array([r.ledger_id] * len(entries), pa.int64()), pa.array(range(a, b + 1), pa.int64()),
                 pa.array([e.data for e in entries], pa.binary())], schema=LEDGER_ARROW)
    finally:
        bk.close()
