"""Ledgers as a Spark table: planning on the driver (metadata only), range reads on executors.

Why the driver reads no entry of a closed ledger: its metadata says how many entries and
bytes it has, which is all planning needs; an open ledger (with include_open) costs one LAC
read and one entry read (its length so far), and is never fenced. Executors read their range
with pipelined range reads, one Arrow batch of about BATCH_BYTES at a time, so a partition of
a 10 GB ledger holds one batch, not the ledger.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa

import bookkeeper.sync
from bookkeeper.client import BookKeeper
from bookkeeper.errors import BKError, DigestMismatchError, NoSuchLedgerError, UnauthorizedError
from bookkeeper.meta.ledger_metadata import LedgerMetadata, check_password
from bookkeeper.spark.options import SourceOptions, chunk_entries
from bookkeeper.spark.planning import (Access, Bounds, LedgerRange, balance, decide_access, describe_skipped,
                                       split_ledger)

LEDGER_SCHEMA = "ledger_id long, entry_id long, data binary"
LEDGER_ARROW = pa.schema([("ledger_id", pa.int64()), ("entry_id", pa.int64()), ("data", pa.binary())])
log = logging.getLogger(__name__)


async def _wanted_ids(bk: BookKeeper, opts: SourceOptions, bounds: Bounds) -> list[int]:
    spec = opts.ledgers
    assert spec is not None
    ids = set(spec.singles)
    if spec.ranges:
        ids |= {lid async for lid in bk.list_ledgers() if spec.wants(lid)}
    return sorted(lid for lid in ids if bounds.has_ledger(lid))


def _unreadable(md: LedgerMetadata, opts: SourceOptions) -> BKError | None:
    """Why this read's options cannot open the ledger, from its metadata alone (the executors'
    open_ledger would refuse it for the same reasons), or None."""
    if not check_password(opts.password, md.password_digest):
        return UnauthorizedError("wrong password")
    if md.digest is not opts.digest:
        return DigestMismatchError(f"digest {md.digest.value.lower()}, not {opts.digest.value.lower()}")
    return None


def _refusal(lid: int, why: BKError, *, named: bool) -> BKError:
    """The error that fails the read on an unreadable ledger: it names the ledger and the option."""
    option = "password" if isinstance(why, UnauthorizedError) else "digest"
    hint = "" if named else "; skipUnreadable=true skips the ledgers of a range it cannot open"
    return type(why)(f"ledger {lid}: {why} (option {option}{hint})")


async def _plan_one(bk: BookKeeper, opts: SourceOptions, md: LedgerMetadata, bounds: Bounds) -> list[LedgerRange]:
    lid = md.ledger_id
    if md.is_closed:
        return split_ledger(lid, md.last_entry_id, md.length, opts.max_entries_per_partition, bounds=bounds)
    if not opts.include_open:
        return []
    rh = await bk.open_ledger(lid, password=opts.password, recovery=False)
    lac = rh.last_add_confirmed
    length = (await rh.read(lac, lac))[0].length if lac >= 0 else 0
    return split_ledger(lid, lac, length, opts.max_entries_per_partition, bounds=bounds)


async def plan_ledgers(opts: SourceOptions, bounds: Bounds | None = None) -> list[LedgerRange]:
    """The partitions of a ledgers read. A single id that names no ledger fails; ids in a
    range that name none are skipped; open ledgers are skipped unless include_open. A ledger
    the password or digest option cannot open fails the read, or with skipUnreadable, when only
    a range brought it in, is skipped: one WARNING line names and counts the skipped
    (planning.decide_access). `bounds` (pushed-down filters) drop ledgers and clip entry ranges exactly."""
    bounds = bounds or Bounds()
    spec = opts.ledgers
    assert spec is not None
    out: list[LedgerRange] = []
    skipped: list[tuple[int, str]] = []
    looked_at = 0
    async with await BookKeeper.connect(opts.metadata_uri) as bk:
        for lid in await _wanted_ids(bk, opts, bounds):
            named = lid in spec.singles
            try:
                md = await bk.ledger_metadata(lid)
            except NoSuchLedgerError:
                if named:
                    raise NoSuchLedgerError(f"ledger {lid}, named in the ledgers option, does not exist") from None
                continue
            looked_at += 1
            why = _unreadable(md, opts)
            access = decide_access(unreadable=why is not None, named=named, skip_unreadable=opts.skip_unreadable)
            if why is None:
                out += await _plan_one(bk, opts, md, bounds)
            elif access is Access.SKIP:
                skipped.append((lid, str(why)))
            else:
                raise _refusal(lid, why, named=named)
    if skipped:
        log.warning("%s", describe_skipped(skipped, looked_at))
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
