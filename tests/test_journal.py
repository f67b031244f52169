"""The journal: block encoding (ext/bookkeeper/_ext/journal.pyx), flush policy, syncers and
the group-commit Journal (bookkeeper/bookie/journal/).

Block layout (journal.pyx docstring), big-endian, zero padded to a multiple of 4096:
  u32 magic 'BKJB' | u32 payload_len | u32 crc32c | u32 record_count | u64 seq | payload
  crc32c covers header bytes [4:8] and [12:24], then the payload.
Record: u32 record_len | u8 type | u64 ledger_id | i64 entry_id | data.

Journal tests run on a uvloop event loop (the shard's production loop), against real
files in a tmp dir, with the io_uring syncer and the thread syncer built directly.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import os
import types
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import uvloop

from bookkeeper._ext.journal import (
    BLOCK_ALIGN,
    BLOCK_HEADER_BYTES,
    BLOCK_MAGIC,
    REC_ADD,
    REC_FENCE,
    REC_MASTER_KEY,
    JournalBatch,
    scan_blocks,
)
from bookkeeper.bookie.journal import Journal
from bookkeeper.bookie.journal.journal import FILE_VERSION, JournalFailedError
from bookkeeper.bookie.journal.policy import (BlockScan, FileHeader, FlushReason, ReplayStep, flush_reason,
                                              replay_step)
from bookkeeper.bookie.journal.syncer import ThreadSyncer, UringSyncer, completion
from bookkeeper.testing.syncers import InlineExecutor, ManualSyncer

U64_MAX = 2**64 - 1
RECORD_HEADER = 21


# -- helpers -------------------------------------------------------------------------------


def make_block(records: list[tuple[int, int, int, bytes]], seq: int) -> bytes:
    batch = JournalBatch()
    for r in records:
        batch.add(*r)
    return bytes(batch.seal(seq))


def py_block(records: list[tuple[int, int, int, bytes]], seq: int, count: int | None = None) -> bytes:
    """Independent encoder of the documented block layout (lets tests craft inconsistent blocks)."""
    payload = b"".join(struct.pack(">IBQq", RECORD_HEADER - 4 + len(d), t, lid, eid) + d
                       for t, lid, eid, d in records)
    n = len(records) if count is None else count
    crc = crc32c.crc32c(payload, crc32c.crc32c(struct.pack(">I", len(payload)) + struct.pack(">IQ", n, seq)))
    block = struct.pack(">IIIIQ", BLOCK_MAGIC, len(payload), crc, n, seq) + payload
    return block + bytes(-len(block) % BLOCK_ALIGN)


def recs(n: int, start: int = 0, size: int = 37) -> list[tuple[int, int, int, bytes]]:
    """n add records with non-zero data (so any missing byte changes the CRC)."""
    return [(REC_ADD, 1000 + (i % 3), i, bytes([(i % 250) + 1]) * (size + i % 5)) for i in range(start, start + n)]


def run(coro_fn: Callable[[], Any]) -> Any:
    """Run a coroutine on a fresh uvloop loop (the shard's event loop)."""
    return uvloop.run(coro_fn())


# -- JournalBatch / scan_blocks -------------------------------------------------------------


def test_batch_seal_scan_round_trip() -> None:
    """Records added to a batch and sealed come back from scan_blocks unchanged, in order, with the seq."""
    records = [
        (REC_ADD, 1, 0, b"hello"),
        (REC_ADD, U64_MAX, 2**63 - 1, os.urandom(1000)),
        (REC_MASTER_KEY, 7, -1, bytes(20)),
        (REC_FENCE, 7, -1, b""),
        (REC_ADD, 0, 0, b"\x00" * 10),
    ]
    block = make_block(records, seq=41)
    got, end, torn, last_seq, next_valid = scan_blocks(block, 0)
    assert got == records
    assert (end, torn, last_seq) == (len(block), False, 41)


def test_batch_counts_records_and_bytes_and_copies_data() -> None:
    """count and nbytes track the records added; add() copies data so the caller may reuse its buffer."""
    batch = JournalBatch()
    assert (batch.count, batch.nbytes) == (0, 0)
    buf = bytearray(b"abcd")
    batch.add(REC_ADD, 1, 0, buf)
    buf[:] = b"zzzz"
    batch.add(REC_ADD, 1, 1, memoryview(b"xyz"))
    assert batch.count == 2
    assert batch.nbytes == 2 * RECORD_HEADER + 4 + 3
    got, *_ = scan_blocks(batch.seal(0), 0)
    assert got == [(REC_ADD, 1, 0, b"abcd"), (REC_ADD, 1, 1, b"xyz")]


def test_sealed_block_matches_documented_layout() -> None:
    """seal() produces exactly the documented bytes (magic, payload_len, crc32c, count, seq, records, zero pad)."""
    records = [(REC_ADD, 5, 9, b"payload-1"), (REC_FENCE, 6, -1, b"")]
    assert make_block(records, 3) == py_block(records, 3)


@pytest.mark.parametrize("data_len", [0, 1, 100, 4096 - 24 - 21 - 1, 4096 - 24 - 21, 4096 - 24 - 21 + 1, 10_000,
                                      3 * 4096])
def test_sealed_blocks_are_4096_aligned(data_len: int) -> None:
    """Every sealed block is a multiple of 4096 bytes, the smallest that holds header + payload, zero padded."""
    block = make_block([(REC_ADD, 1, 0, b"\x5a" * data_len)], seq=0)
    used = BLOCK_HEADER_BYTES + RECORD_HEADER + data_len
    assert BLOCK_ALIGN == 4096 and BLOCK_HEADER_BYTES == 24
    assert len(block) % BLOCK_ALIGN == 0
    assert len(block) == -(-used // BLOCK_ALIGN) * BLOCK_ALIGN
    assert block[used:] == bytes(len(block) - used)


def test_empty_batch_seals_to_one_aligned_block() -> None:
    """A batch with no records still seals to one valid, aligned block."""
    block = bytes(JournalBatch().seal(9))
    assert len(block) == BLOCK_ALIGN
    assert scan_blocks(block, 0) == ([], BLOCK_ALIGN, False, 9, -1)


def test_scan_many_blocks_and_from_offset() -> None:
    """scan_blocks decodes consecutive blocks in order, and starting at a block offset skips the earlier ones."""
    blocks = [make_block(recs(3, 3 * i), seq=i) for i in range(5)]
    image = b"".join(blocks)
    got, end, torn, last_seq, next_valid = scan_blocks(image, 0)
    assert got == recs(15) and (end, torn, last_seq) == (len(image), False, 4)
    off = len(blocks[0]) + len(blocks[1])
    got, end, torn, last_seq, next_valid = scan_blocks(image, off)
    assert got == recs(9, 6) and (end, torn, last_seq) == (len(image), False, 4)


def test_scan_nothing_written_is_not_torn() -> None:
    """An image with no block past offset (empty or all zeros) gives no records, torn False, last_seq -1."""
    assert scan_blocks(b"", 0) == ([], 0, False, -1, -1)
    assert scan_blocks(bytes(3 * BLOCK_ALIGN), BLOCK_ALIGN) == ([], BLOCK_ALIGN, False, -1, -1)


def test_zero_tail_after_blocks_is_not_torn() -> None:
    """Zeros after the last block (the preallocated rest of the file) mean a clean end: torn False."""
    blocks = [make_block(recs(4, 4 * i), seq=i) for i in range(3)]
    image = b"".join(blocks) + bytes(64 * 1024)
    got, end, torn, last_seq, next_valid = scan_blocks(image, 0)
    assert got == recs(12)
    assert (end, torn, last_seq) == (sum(map(len, blocks)), False, 2)


def _three_blocks() -> tuple[list[bytes], list[list[tuple]]]:
    rs = [recs(3, 0), recs(2, 3, size=200), recs(4, 5, size=90)]
    return [make_block(r, seq=10 + i) for i, r in enumerate(rs)], rs


def test_truncated_last_block_is_discarded_and_earlier_blocks_kept() -> None:
    """A last block cut at any byte of its header or payload is discarded (torn), earlier blocks kept."""
    blocks, rs = _three_blocks()
    prefix = blocks[0] + blocks[1]
    last = blocks[2]
    used = BLOCK_HEADER_BYTES + sum(RECORD_HEADER + len(r[3]) for r in rs[2])
    for cut in range(1, used):
        got, end, torn, last_seq, next_valid = scan_blocks(prefix + last[:cut], 0)
        assert got == rs[0] + rs[1], cut
        assert (end, torn, last_seq, next_valid) == (len(prefix), True, 11, -1), cut


def test_partially_written_last_block_before_zeros_is_torn() -> None:
    """A last block written only up to some byte, the rest of the preallocated file zero, is discarded as torn."""
    blocks, rs = _three_blocks()
    prefix = blocks[0] + blocks[1]
    last = blocks[2]
    used = BLOCK_HEADER_BYTES + sum(RECORD_HEADER + len(r[3]) for r in rs[2])
    for cut in list(range(1, 64)) + list(range(64, used, 7)) + [used - 1]:
        image = prefix + last[:cut] + bytes(len(last) - cut + BLOCK_ALIGN)
        got, end, torn, last_seq, next_valid = scan_blocks(image, 0)
        assert got == rs[0] + rs[1], cut
        assert (end, torn, last_seq, next_valid) == (len(prefix), True, 11, -1), cut


def test_cut_at_block_boundary_is_clean() -> None:
    """An image that ends exactly at a block boundary has nothing torn."""
    blocks, rs = _three_blocks()
    image = blocks[0] + blocks[1]
    assert scan_blocks(image, 0) == (rs[0] + rs[1], len(image), False, 11, -1)


def test_flipped_bit_in_payload_fails_crc_and_stops_replay() -> None:
    """A flipped bit anywhere in a block's payload fails its CRC32C: that block and all after it are not
    returned, and the valid block after it is reported (the caller refuses to go on: test below)."""
    blocks, rs = _three_blocks()
    image = b"".join(blocks)
    start = len(blocks[0])
    plen = sum(RECORD_HEADER + len(r[3]) for r in rs[1])
    for i in range(start + BLOCK_HEADER_BYTES, start + BLOCK_HEADER_BYTES + plen, 5):
        for bit in (0, 7):
            bad = bytearray(image)
            bad[i] ^= 1 << bit
            got, end, torn, last_seq, next_valid = scan_blocks(bytes(bad), 0)
            assert got == rs[0], (i, bit)
            assert (end, torn, last_seq) == (start, True, 10), (i, bit)
            assert next_valid == start + len(blocks[1]), (i, bit)  # damaged, not torn: block 2 is intact


@pytest.mark.parametrize("field_off", [0, 3, 4, 8, 11, 12, 15, 16, 23])
def test_corrupt_header_field_discards_block(field_off: int) -> None:
    """A flipped bit in the magic, payload_len, crc, record_count or seq of a block discards it (torn)."""
    blocks, rs = _three_blocks()
    image = bytearray(b"".join(blocks))
    image[len(blocks[0]) + field_off] ^= 0x10
    got, end, torn, last_seq, next_valid = scan_blocks(bytes(image), 0)
    assert got == rs[0]
    assert (end, torn, last_seq) == (len(blocks[0]), True, 10)
    assert next_valid == len(blocks[0]) + len(blocks[1])


def test_block_whose_count_disagrees_with_records_is_discarded() -> None:
    """A block with a valid CRC whose record_count does not match its records is refused (bounds check)."""
    good = py_block(recs(2), seq=0)
    bad = py_block(recs(2, 2), seq=1, count=3)
    got, end, torn, _, next_valid = scan_blocks(good + bad, 0)
    assert got == recs(2) and end == len(good) and torn and next_valid == -1


def test_block_with_record_overrunning_payload_is_discarded() -> None:
    """A record whose length runs past its block's payload is refused, even with a valid CRC."""
    payload = struct.pack(">IBQq", 500, REC_ADD, 1, 0) + b"x" * 10  # claims 500 bytes, has 27
    crc = crc32c.crc32c(payload, crc32c.crc32c(struct.pack(">I", len(payload)) + struct.pack(">IQ", 1, 0)))
    block = struct.pack(">IIIIQ", BLOCK_MAGIC, len(payload), crc, 1, 0) + payload
    block += bytes(-len(block) % BLOCK_ALIGN)
    got, end, torn, last_seq, next_valid = scan_blocks(block, 0)
    assert (got, end, torn, last_seq) == ([], 0, True, -1)


# -- flush policy ------------------------------------------------------------------------------


def oracle_flush(count: int, nbytes: int, waited: int, inflight: bool, gw: int, bmax: int,
                 emax: int) -> FlushReason | None:
    """policy.py rules: never with nothing queued or a sync in flight; else FULL at the byte or entry bound,
    IDLE when no group wait is configured, WAITED once the group wait elapsed; otherwise keep filling."""
    if count == 0 or inflight:
        return None
    if nbytes >= bmax or count >= emax:
        return FlushReason.FULL
    if gw <= 0:
        return FlushReason.IDLE
    return FlushReason.WAITED if waited >= gw else None


def test_flush_reason_decision_table_exhaustive() -> None:
    """flush_reason agrees with the documented rules on every point of a small grid."""
    grid = itertools.product([0, 1, 7], [0, 100, 4095, 4096, 10_000], [0, 1, 99, 100, 101, 5000],
                             [False, True], [0, 1, 100, 1000], [4096, 1 << 20], [1, 7, 65536])
    n = 0
    for count, nbytes, waited, inflight, gw, bmax, emax in grid:
        got = flush_reason(batch_count=count, batch_bytes=nbytes, oldest_wait_us=waited, sync_in_flight=inflight,
                           group_wait_us_max=gw, batch_bytes_max=bmax, batch_entries_max=emax)
        assert got == oracle_flush(count, nbytes, waited, inflight, gw, bmax, emax), \
            (count, nbytes, waited, inflight, gw, bmax, emax)
        n += 1
    assert n == 3 * 5 * 6 * 2 * 4 * 2 * 3


def test_flush_reason_one_sync_in_flight_at_a_time() -> None:
    """While a sync is in flight nothing is flushed, not even a full batch (blocks written strictly in order)."""
    assert flush_reason(batch_count=10**6, batch_bytes=10**9, oldest_wait_us=10**9, sync_in_flight=True,
                        group_wait_us_max=0, batch_bytes_max=1, batch_entries_max=1) is None


def test_flush_reason_low_load_flushes_immediately() -> None:
    """With no group wait and no sync in flight a lone record is flushed at once (low latency at low load)."""
    assert flush_reason(batch_count=1, batch_bytes=30, oldest_wait_us=0, sync_in_flight=False,
                        group_wait_us_max=0, batch_bytes_max=4 << 20, batch_entries_max=65536) is FlushReason.IDLE


H, B, R = FileHeader, BlockScan, ReplayStep
# Every (header, scan, reused) replay can meet, and its verdict: written out in full, so a
# change to any cell is a change to this table.
REPLAY_TABLE = {
    (H.SHORT, None, False): R.SKIP, (H.SHORT, None, True): R.SKIP,
    (H.BAD, None, False): R.SKIP, (H.BAD, None, True): R.SKIP,
    (H.NEWER, None, False): R.REFUSE_NEWER, (H.NEWER, None, True): R.REFUSE_NEWER,
    (H.OK, B.CLEAN, False): R.APPLY, (H.OK, B.CLEAN, True): R.APPLY,
    (H.OK, B.TORN, False): R.APPLY_TORN, (H.OK, B.TORN, True): R.APPLY_REUSED_END,
    (H.OK, B.CORRUPT_MIDDLE, False): R.REFUSE_CORRUPT, (H.OK, B.CORRUPT_MIDDLE, True): R.REFUSE_CORRUPT,
}


def test_replay_step_decision_table_exhaustive() -> None:
    """replay_step gives the table's verdict for every header, scan end and reuse; a good
    header without a scan is refused (replay never asks that), and every verdict is reachable."""
    for header, scan, reused in itertools.product(FileHeader, [None, *BlockScan], [False, True]):
        if header is FileHeader.OK and scan is None:
            with pytest.raises(ValueError):
                replay_step(header, scan, reused=reused)
            continue
        # A file whose header stops replay is judged on its header alone, whatever a scan would say.
        cell = (header, scan if header is FileHeader.OK else None, reused)
        assert replay_step(header, scan, reused=reused) is REPLAY_TABLE[cell], (header, scan, reused)
    assert set(REPLAY_TABLE.values()) == set(ReplayStep)


# -- syncers -------------------------------------------------------------------------------


def make_syncer_of(kind: str, loop: asyncio.AbstractEventLoop):
    """Build the syncer class directly (no fallback), so the io_uring path is really exercised."""
    return UringSyncer(loop) if kind == "io_uring" else ThreadSyncer(loop)


KINDS = ["io_uring", "thread"]


@pytest.mark.parametrize("kind", KINDS)
def test_syncer_writes_block_at_offset_and_reports_success(tmp_path: Path, kind: str) -> None:
    """submit() writes the buffer at the offset, fdatasyncs, and calls done(None) on the loop."""
    path = tmp_path / "f"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of(kind, loop)
        assert syncer.kind == kind
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            futs = []
            for i in range(3):
                fut = loop.create_future()
                syncer.submit(fd, bytearray([i + 1]) * 4096, 4096 * i, fut.set_result)
                futs.append(fut)
            assert await asyncio.wait_for(asyncio.gather(*futs), 10) == [None, None, None]
        finally:
            syncer.close()
            os.close(fd)

    run(main)
    data = path.read_bytes()
    assert data == b"\x01" * 4096 + b"\x02" * 4096 + b"\x03" * 4096


@pytest.mark.parametrize("kind", KINDS)
def test_syncer_reports_write_error_as_oserror(tmp_path: Path, kind: str) -> None:
    """A failed write (read-only fd) reaches done() as an OSError carrying the errno (EBADF)."""
    path = tmp_path / "ro"
    path.write_bytes(bytes(4096))

    async def main() -> OSError | None:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of(kind, loop)
        fd = os.open(path, os.O_RDONLY)
        try:
            fut = loop.create_future()
            syncer.submit(fd, bytearray(b"x" * 4096), 0, fut.set_result)
            return await asyncio.wait_for(fut, 10)
        finally:
            syncer.close()
            os.close(fd)

    err = run(main)
    assert isinstance(err, OSError)
    assert err.errno == errno.EBADF


def test_completion_of_a_durable_write() -> None:
    """The decision table of one O_DSYNC write's CQE for an 8192-byte block."""
    assert completion(8192, 0, 8192) is None                       # whole, durable
    assert completion(8192, 6000, 2192) is None                    # the rest of a retried block
    assert completion(8192, 0, 6000) == 6000                       # short: the rest goes again
    assert completion(8192, 6000, 100) == 6100                     # shorter again: again
    err = completion(8192, 6000, 0)                                # no progress: no endless loop
    assert isinstance(err, OSError) and err.errno == errno.EIO and "no progress" in str(err)
    err = completion(8192, 0, -errno.ENOSPC)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and "write" in str(err)
    err = completion(8192, 6000, -errno.EIO)                       # the retry's sync failed
    assert isinstance(err, OSError) and err.errno == errno.EIO


def test_ring_reaps_each_write_by_token_and_its_fd_signals_completions(tmp_path: Path) -> None:
    """The journal's ring (uring.pyx): three writes in flight come back from one or more reaps,
    each with its token and byte count; the ring's fd is readable while completions wait and
    not after they are reaped (the event loop watches it instead of an eventfd); an empty write
    and a closed ring are refused, not submitted."""
    import select

    from bookkeeper._ext.uring import Ring

    ring = Ring(8)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    blocks = [bytearray([i + 1]) * (4096 * (i + 1)) for i in range(3)]
    views = [memoryview(b) for b in blocks]  # pinned until reaped, as UringSyncer does
    try:
        for i, view in enumerate(views):
            ring.submit_write(fd, view, 4096 * 8 * i, 100 + i)
        poller = select.poll()
        poller.register(ring.fd, select.POLLIN)
        done: dict[int, int] = {}
        while len(done) < 3:
            assert poller.poll(10_000), "the ring's fd never became readable"
            done.update(ring.reap())
        assert done == {100: 4096, 101: 8192, 102: 12288}
        assert poller.poll(0) == [] and ring.reap() == []
        with pytest.raises(ValueError, match="empty"):
            ring.submit_write(fd, b"", 0, 1)
        ring.close()
        with pytest.raises(ValueError, match="closed"):
            ring.submit_write(fd, views[0], 0, 1)
        assert ring.reap() == []
    finally:
        ring.close()
        os.close(fd)
    data = (tmp_path / "f").read_bytes()
    assert [data[4096 * 8 * i:4096 * 8 * i + len(b)] for i, b in enumerate(blocks)] == [bytes(b) for b in blocks]


@pytest.fixture
def file_size_limit():
    """set(n): writes past n bytes are short (then EFBIG); SIGXFSZ ignored; all restored after."""
    import resource
    import signal
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (soft if n is None else n, hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, old)


def test_uring_short_write_is_retried_from_where_it_stopped(tmp_path: Path, file_size_limit) -> None:
    """io_uring: a write cut short at 6000 of 8192 bytes (a file size limit, lifted before the
    retry) is resubmitted for the remaining bytes with its sync, and reported durable once; it
    used to be reported as EIO (a failed journal: the shard stops)."""
    path = tmp_path / "short"
    block = bytes(range(256)) * 32

    async def main() -> tuple[OSError | None, list[int]]:
        loop = asyncio.get_running_loop()
        syncer = UringSyncer(loop)
        submitted: list[int] = []
        real = syncer._submit

        def lift_then_submit(fd, buf, offset, written, done) -> None:  # noqa: ANN001
            submitted.append(written)
            if written:
                file_size_limit(None)  # the condition passes: the retry can complete
            real(fd, buf, offset, written, done)
        syncer._submit = lift_then_submit  # type: ignore[method-assign]  # a spy: the real submit runs
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fut = loop.create_future()
            file_size_limit(6000)
            syncer.submit(fd, block, 0, fut.set_result)
            return await asyncio.wait_for(fut, 10), submitted
        finally:
            syncer.close()
            os.close(fd)

    err, submitted = run(main)
    assert err is None and submitted == [0, 6000]
    assert path.read_bytes() == block


def test_thread_syncer_retries_a_short_write_and_reports_what_stops_it(tmp_path: Path, file_size_limit) -> None:
    """The thread syncer's pwrite loop goes on after a short write; the retry meets the limit and
    its EFBIG is what done() gets (not a hang, not a silent success); 6000 bytes are on disk."""
    path = tmp_path / "short"

    async def main() -> OSError | None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fut = loop.create_future()
            file_size_limit(6000)
            syncer.submit(fd, bytes(8192), 0, fut.set_result)
            return await asyncio.wait_for(fut, 10)
        finally:
            file_size_limit(None)
            syncer.close()
            os.close(fd)

    err = run(main)
    assert isinstance(err, OSError) and err.errno == errno.EFBIG
    assert path.stat().st_size == 6000


# -- Journal end to end ----------------------------------------------------------------------------


class Sink:
    """Collects on_durable / on_failed calls."""

    def __init__(self) -> None:
        self.durable: list[list[Any]] = []
        self.failed: list[tuple[list[Any], OSError]] = []

    def on_durable(self, items: list[Any]) -> None:
        self.durable.append(list(items))

    def on_failed(self, items: list[Any], err: OSError) -> None:
        self.failed.append((list(items), err))

    @property
    def durable_items(self) -> list[Any]:
        return [i for batch in self.durable for i in batch]

    @property
    def failed_items(self) -> list[Any]:
        return [i for items, _ in self.failed for i in items]


class NullSyncer:
    """For journals that only replay or trim: fails the test if anything is submitted."""

    kind = "null"

    def submit(self, fd: int, buf: Any, offset: int, done: Callable) -> None:  # pragma: no cover
        raise AssertionError("replay must not write")

    def close(self) -> None:
        pass


def new_journal(path: Path, syncer: Any, loop: asyncio.AbstractEventLoop, sink: Sink, **kw: Any) -> Journal:
    """A journal whose next file is prepared at once (InlineExecutor), so that a roll happens
    when the file is full, as the tests count them; spare_filler=None for the thread."""
    kw.setdefault("preallocate_bytes", 1 << 20)
    kw.setdefault("spare_filler", InlineExecutor())
    return Journal(path, syncer=syncer, loop=loop, on_durable=sink.on_durable, on_failed=sink.on_failed, **kw)


def replay_all(path: Path, mark: tuple[int, int] = (0, 0)) -> tuple[list[tuple], Any]:
    """Replay a journal dir with a fresh Journal; returns (records, ReplayResult)."""
    out: list[tuple] = []

    async def main() -> Any:
        j = new_journal(path, NullSyncer(), asyncio.get_running_loop(), Sink())
        res = j.replay(mark, lambda batch: out.extend(batch))
        j.close()
        return res

    return out, run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_journal_durable_once_in_order_then_replays_everything(tmp_path: Path, kind: str) -> None:
    """Every appended item reaches on_durable exactly once, in append order, only after its sync;
    a fresh Journal over the same dir replays every record (no acknowledged entry is lost)."""
    expected = recs(300)

    async def main() -> Sink:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of(kind, loop)
        assert syncer.kind == kind
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink)
        j.replay((0, 0), lambda r: pytest.fail("empty dir has nothing to replay"))
        j.start()
        it = iter(enumerate(expected))
        for round_size in (1, 1, 50, 3, 120, 1, 124):
            for _ in range(round_size):
                i, rec = next(it)
                j.append(*rec, item=i)
            assert i not in sink.durable_items  # an add is answered only after its batch is durable
            await asyncio.sleep(0)
        await asyncio.wait_for(j.drain(), 10)
        assert j.stats["records"] == len(expected)
        j.close()
        syncer.close()
        return sink

    sink = run(main)
    assert sink.failed == []
    assert sink.durable_items == list(range(len(expected)))
    assert len(sink.durable) < len(expected)  # group commit: batches hold several records
    got, res = replay_all(tmp_path)
    assert got == expected
    assert (res.records, res.blocks_torn, res.files) == (len(expected), 0, 1)


def test_blocks_are_sealed_at_block_bytes_behind_a_sync_and_a_selected_light_sender_goes_first(
        tmp_path: Path) -> None:
    """Behind a sync in flight, appends fill blocks of at most block_bytes_max (one record
    over it at most), written one per sync in order; full counts every block waiting. A light
    sender selected while they wait goes into the next block to be written: durable at the
    second sync, before the bulk records appended earlier; a sender whose records are in a
    later block is never put before them. Everything replays, each record once."""
    block = 8192
    bulk = recs(60, size=1000)

    async def main() -> tuple[Sink, list[int]]:
        loop = asyncio.get_running_loop()
        syncer = ManualSyncer()
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink, block_bytes_max=block, batch_bytes_max=64 << 10)
        j.start()
        j.append(*bulk[0], item="b0")
        await asyncio.sleep(0)
        assert syncer.submits == 1  # a sync in flight
        for i, rec in enumerate(bulk[1:], 1):
            j.append(*rec, item=f"b{i}")
        assert j.queued_bytes > 6 * block and not j.full
        light, late = types.SimpleNamespace(journal_block=0), types.SimpleNamespace(journal_block=0)
        j.select(light, True)
        j.append(1, 9, 0, b"x" * 100, item="light")
        j.deselect()
        j.select(late, False)  # heavy: to the last block
        j.append(1, 8, 0, b"y" * 100, item="late0")
        j.deselect()
        j.select(late, True)  # light now, but its record waits in the last block: stays after it
        j.append(1, 8, 1, b"y" * 100, item="late1")
        j.deselect()
        sizes = []
        while syncer.pending:
            syncer.complete_one()
            sizes.append(j.durable_block[3])
        return sink, sizes

    sink, sizes = run(main)
    first_blocks = [batch for batch in sink.durable]
    assert first_blocks[0] == ["b0"]
    assert "light" in first_blocks[1] and first_blocks[1][0] == "b1"  # the next block, after the bulk's first
    assert all(size <= block + 1021 + 4096 for size in sizes)  # the bound, one record over it, padding
    order = sink.durable_items
    assert order.index("late0") < order.index("late1")
    assert [i for i in order if i.startswith("b")] == [f"b{i}" for i in range(60)]
    got, _ = replay_all(tmp_path)
    assert len(got) == 63 and sorted(got) == sorted([*bulk, (1, 9, 0, b"x" * 100), (1, 8, 0, b"y" * 100),
                                                     (1, 8, 1, b"y" * 100)])


@pytest.mark.parametrize("kind", KINDS)
def test_journal_replay_from_checkpoint_mark_skips_earlier_records(tmp_path: Path, kind: str) -> None:
    """replay(mark) applies only records written after the checkpoint mark (position()), across files."""
    first, second, third = recs(40), recs(25, 40), recs(30, 65, size=3000)

    async def main() -> tuple[tuple[int, int], tuple[int, int]]:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of(kind, loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink, file_max_bytes=64 * 1024)
        j.start()
        for r in first:
            j.append(*r, item=r[2])
        await j.drain()
        mark1 = j.position()
        for r in second:
            j.append(*r, item=r[2])
            await asyncio.sleep(0)
        await j.drain()
        mark2 = j.position()
        for r in third:  # ~90 KiB in small batches: rolls over to new files
            j.append(*r, item=r[2])
            await asyncio.sleep(0)
        await j.drain()
        assert len(j.file_ids()) > 1
        j.close()
        syncer.close()
        assert sink.durable_items == [r[2] for r in first + second + third]
        return mark1, mark2

    mark1, mark2 = run(main)
    assert mark1[1] % BLOCK_ALIGN == 0 and mark1 < mark2
    assert replay_all(tmp_path)[0] == first + second + third
    assert replay_all(tmp_path, mark1)[0] == second + third
    assert replay_all(tmp_path, mark2)[0] == third


@pytest.mark.parametrize("kind", KINDS)
def test_journal_grows_file_past_preallocation(tmp_path: Path, kind: str) -> None:
    """Blocks past the preallocated size roll to the next zero-filled file (or extend a file for a block
    larger than a whole file); every record replays, in order."""
    expected = recs(40, size=1500)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of(kind, loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=BLOCK_ALIGN)
        j.start()
        for i, r in enumerate(expected):
            j.append(*r, item=i)
            if i % 3 == 0:
                await asyncio.sleep(0)
        await asyncio.wait_for(j.drain(), 10)
        assert sink.durable_items == list(range(len(expected)))
        assert j.file_ids()[-2:] == [j.file_id, j.file_id + 1]  # the next file is prepared already
        j.close()
        syncer.close()

    run(main)
    got, res = replay_all(tmp_path)
    assert got == expected and res.blocks_torn == 0


def test_journal_new_file_on_every_start_and_replay_across_restarts(tmp_path: Path) -> None:
    """Each start opens a new file (never appends after a possibly torn tail); replay spans all files in order."""
    batches = [recs(5, 0), recs(5, 5), recs(5, 10)]

    async def session(rs: list[tuple]) -> int:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink)
        replayed: list[tuple] = []
        j.replay((0, 0), replayed.extend)
        j.start()
        for r in rs:
            j.append(*r, item=r[2])
        await j.drain()
        j.close()
        syncer.close()
        assert sink.durable_items == [r[2] for r in rs]
        return j.file_id

    ids = [uvloop.run(session(b)) for b in batches]
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert replay_all(tmp_path)[0] == batches[0] + batches[1] + batches[2]
    assert replay_all(tmp_path, (ids[1], 0))[0] == batches[1] + batches[2]


def test_journal_trim_deletes_files_before_mark_only(tmp_path: Path) -> None:
    """trim(mark_file) deletes journal files wholly before the mark, keeps the rest and the current file."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink, file_max_bytes=2 * BLOCK_ALIGN)
        j.start()
        for r in recs(6):  # one block per file: header + one block reaches file_max_bytes
            j.append(*r, item=r[2])
            await j.drain()
        ids = j.file_ids()
        assert len(ids) == 8 and ids[-2:] == [j.file_id, j.file_id + 1]  # and the next one prepared
        assert j.trim(ids[3]) == 3
        assert j.file_ids() == ids[3:]
        assert j.trim(ids[3]) == 0  # nothing more before the mark
        assert j.trim(10**9) == 3   # everything before the mark but the file in use and the next
        assert j.file_ids() == [j.file_id, j.file_id + 1]
        j.close()
        syncer.close()

    run(main)


def test_journal_trim_then_replay_keeps_records_after_mark(tmp_path: Path) -> None:
    """After a checkpoint at mark, trim(mark file) + replay(mark) still yields every record after the mark."""

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), file_max_bytes=2 * BLOCK_ALIGN)
        j.start()
        for r in recs(4):
            j.append(*r, item=None)
            await j.drain()
        mark = j.position()
        for r in recs(4, 4):
            j.append(*r, item=None)
            await j.drain()
        assert j.trim(mark[0]) >= 4
        j.close()
        syncer.close()
        return mark

    mark = run(main)
    assert replay_all(tmp_path, mark)[0] == recs(4, 4)


def test_journal_replay_discards_torn_tail(tmp_path: Path) -> None:
    """Garbage after the last durable block (a torn write) is reported torn; every earlier record is replayed."""

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink())
        j.start()
        for r in recs(10):
            j.append(*r, item=None)
        await j.drain()
        pos = j.position()
        j.close()
        syncer.close()
        return pos

    fid, off = run(main)
    with open(tmp_path / f"{fid:016x}.jnl", "r+b") as f:
        f.seek(off)
        f.write(struct.pack(">I", BLOCK_MAGIC) + b"\x00\x00\x01\x00garbage")
    got, res = replay_all(tmp_path)
    assert got == recs(10)
    assert res.blocks_torn == 1


def test_journal_replay_refuses_a_corrupt_block_followed_by_valid_ones(tmp_path: Path) -> None:
    """A flipped byte in the middle of a journal file (block 2 of 4) is not a torn tail: replay
    raises JournalCorruptError naming the file and both offsets instead of silently dropping the
    acknowledged records of blocks 2-4; the same damage to the last block is a torn tail."""
    from bookkeeper.bookie.journal.journal import JournalCorruptError

    async def main() -> tuple[list[tuple[int, int]], int]:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink())
        j.start()
        starts = []
        for b in range(4):  # one block per drain
            starts.append(j.position())
            for r in recs(3, 3 * b):
                j.append(*r, item=None)
            await j.drain()
        j.close()
        syncer.close()
        return starts, j.position()[1]

    starts, end = run(main)
    fid = starts[0][0]
    path = tmp_path / f"{fid:016x}.jnl"
    image = path.read_bytes()
    bad = bytearray(image)
    bad[starts[1][1] + BLOCK_HEADER_BYTES + 30] ^= 0x01
    path.write_bytes(bytes(bad))
    with pytest.raises(JournalCorruptError, match=f"{path.name}.*offset {starts[1][1]}.*offset {starts[2][1]}"):
        replay_all(tmp_path)
    bad = bytearray(image)
    bad[starts[3][1] + BLOCK_HEADER_BYTES + 30] ^= 0x01
    path.write_bytes(bytes(bad))
    got, res = replay_all(tmp_path)
    assert got == recs(9) and res.blocks_torn == 1


def test_journal_refuses_newer_file_format(tmp_path: Path) -> None:
    """A journal file whose header version is newer than supported is refused, not misread."""
    (tmp_path / f"{1:016x}.jnl").write_bytes(struct.pack(">4sIQ", b"BKJF", FILE_VERSION + 1, 1).ljust(8192, b"\0"))
    with pytest.raises(OSError, match="newer"):
        replay_all(tmp_path)


def test_journal_group_wait_holds_small_batch_until_timer(tmp_path: Path) -> None:
    """With group_wait_us_max > 0 a lone record waits for company, then is flushed when the wait elapses."""

    class Recording(ThreadSyncer):
        submits = 0

        def submit(self, fd, buf, offset, done):  # noqa: ANN001
            type(self).submits += 1
            super().submit(fd, buf, offset, done)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = Recording(loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink, group_wait_us_max=20_000)
        j.start()
        j.append(REC_ADD, 1, 0, b"a", item="a")
        j.append(REC_ADD, 1, 1, b"b", item="b")
        assert Recording.submits == 0 and j.queued_bytes > 0
        for _ in range(200):
            if sink.durable:
                break
            await asyncio.sleep(0.005)
        assert sink.durable == [["a", "b"]]  # one block for both
        assert Recording.submits == 1
        j.close()
        syncer.close()

    run(main)


def test_journal_full_batch_flushes_without_waiting(tmp_path: Path) -> None:
    """A batch reaching batch_bytes_max is flushed at once even with a long group wait."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink, group_wait_us_max=10_000_000, batch_bytes_max=8192)
        j.start()
        j.append(REC_ADD, 1, 0, b"x" * 9000, item=0)
        assert j.queued_bytes == 0  # sealed and handed to the syncer
        await asyncio.wait_for(j.drain(), 5)
        assert sink.durable == [[0]]
        j.close()
        syncer.close()

    run(main)


def test_journal_batch_behind_a_sync_is_bounded_by_entries_and_reports_full(tmp_path: Path) -> None:
    """While a sync is in flight the filling batch reports `full` at batch_entries_max (the server then
    stops reading), and it is flushed, whole, as soon as the sync returns."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ManualSyncer(), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, batch_entries_max=3)
        j.start()
        j.append(REC_ADD, 1, 0, b"a", item=0)  # flushed at the end of this loop turn: nothing in flight
        await asyncio.sleep(0)
        assert syncer.submits == 1 and not j.full
        j.append(REC_ADD, 1, 1, b"b", item=1)
        j.append(REC_ADD, 1, 2, b"c", item=2)
        assert not j.full
        j.append(REC_ADD, 1, 3, b"d", item=3)
        assert j.full and syncer.submits == 1  # one sync in flight at a time
        syncer.complete_one()
        assert syncer.submits == 2 and not j.full
        syncer.complete_one()
        assert sink.durable == [[0], [1, 2, 3]]
        j.close()

    run(main)


def test_journal_submits_the_next_batch_before_answering_the_last(tmp_path: Path) -> None:
    """When a sync returns, the batch that filled behind it goes to the device before on_durable runs,
    so answering one batch overlaps the next sync instead of delaying it."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = ManualSyncer()
        submits_seen: list[int] = []
        j = Journal(tmp_path, syncer=syncer, loop=loop, preallocate_bytes=1 << 20,
                    on_durable=lambda items: submits_seen.append(syncer.submits),
                    on_failed=lambda items, err: None)
        j.start()
        j.append(REC_ADD, 1, 0, b"a", item=0)
        await asyncio.sleep(0)
        j.append(REC_ADD, 1, 1, b"b", item=1)
        syncer.complete_one()
        assert submits_seen == [2]  # the second block was submitted before the first was answered
        syncer.complete_one()
        assert submits_seen == [2, 2]
        j.close()

    run(main)


def test_a_full_file_takes_blocks_past_its_allocation_until_the_next_file_is_ready(tmp_path: Path) -> None:
    """A roll never waits on the loop for the next file: while its preparation is unfinished,
    the full file takes the next blocks past its preallocation (counted once as a deferred
    roll); once it is ready, the next roll takes it. Every record replays, in order."""
    import concurrent.futures

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ThreadSyncer(loop), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=64 << 10)
        j.start()
        first = j.file_id
        prepared = j._next
        assert prepared is not None and prepared.done()
        os.close(prepared.result().fd)
        os.unlink(j._path(first + 1))
        j._next = concurrent.futures.Future()  # a preparation that has not finished
        for i in range(8):
            j.append(REC_ADD, 1, i, bytes(20 << 10), item=i)
            await asyncio.wait_for(j.drain(), 5)
        assert j.file_ids() == [first] and j.stats["deferred_rolls"] == 1
        assert os.stat(j._path(first)).st_size > 64 << 10  # the blocks extended it
        j._next.set_result(j._prepare(first))
        for i in range(8, 12):
            j.append(REC_ADD, 1, i, bytes(20 << 10), item=i)
            await asyncio.wait_for(j.drain(), 5)
        assert j.file_id > first and j.stats["deferred_rolls"] >= 1
        assert sink.durable_items == list(range(12))
        j.close()
        syncer.close()

    run(main)
    records, _ = replay_all(tmp_path)
    assert [r[2] for r in records] == list(range(12))


def test_the_next_file_is_prepared_on_the_filler_thread_not_the_loop(tmp_path: Path) -> None:
    """Without an inline filler the preparation (zero-fill, header, syncs) runs on the
    journal's own thread: the loop only swaps files at a roll."""
    import threading

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ThreadSyncer(loop), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=64 << 10, spare_filler=None)
        threads: list[str] = []
        prepare = j._prepare

        def watched(file_id: int) -> Any:
            threads.append(threading.current_thread().name)
            return prepare(file_id)
        j._prepare = watched  # type: ignore[method-assign]
        j.start()
        await asyncio.wrap_future(j._next)
        for i in range(6):
            j.append(REC_ADD, 1, i, bytes(40 << 10), item=i)
            await asyncio.wait_for(j.drain(), 5)
            if j._next is not None:
                await asyncio.wrap_future(j._next)
        assert len(threads) >= 3 and all(t.startswith("journal-spare") for t in threads)  # start-up's too
        assert sink.durable_items == list(range(6)) and j.stats["filled_rolls"] >= 2
        j.close()
        syncer.close()

    run(main)


def test_journal_records_of_one_loop_turn_share_one_block(tmp_path: Path) -> None:
    """With nothing in flight, the flush is decided at the end of the loop turn: every record
    appended in that turn (a whole receive buffer) goes into one block and one sync."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ManualSyncer(), Sink()
        j = new_journal(tmp_path, syncer, loop, sink)
        j.start()
        for i in range(5):
            j.append(REC_ADD, 1, i, b"r", item=i)
        assert syncer.submits == 0
        await asyncio.sleep(0)
        assert syncer.submits == 1
        syncer.complete_one()
        assert sink.durable == [[0, 1, 2, 3, 4]]
        j.close()

    run(main)


def test_journal_closed_in_the_turn_of_an_append_writes_nothing_after_close(tmp_path: Path) -> None:
    """A flush deferred to the end of the loop turn does not run against a journal closed in that
    turn (its file is gone): nothing is submitted and the loop reports no error."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        syncer = ManualSyncer()
        j = new_journal(tmp_path, syncer, loop, Sink())
        j.start()
        j.append(REC_ADD, 1, 0, b"x", item=0)
        j.close()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert syncer.submits == 0 and errors == []

    run(main)


def test_a_failed_preparation_of_the_next_file_fails_no_add(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The next file's preparation fails (e.g. ENOSPC while zero-filling): it is logged and
    counted, the block that needed the new file goes into the current one past its
    preallocation and is answered, and the preparation is tried again after PREPARE_RETRY_S;
    the roll after takes the file it makes. Only a failed write fails the journal."""
    from bookkeeper.bookie.journal.journal import PREPARE_RETRY_S

    now = [100.0]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ManualSyncer(), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=64 << 10, clock=lambda: now[0])
        j.start()
        first = j.file_id
        j.append(REC_ADD, 1, 0, bytes(40 << 10), item=0)
        await asyncio.sleep(0)
        j.append(REC_ADD, 1, 1, bytes(40 << 10), item=1)  # does not fit the file: needs a roll
        failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
        failed.set_exception(OSError(errno.ENOSPC, "injected: no space for the next journal file"))
        assert j._next is not None
        prepared = j._next.result()
        os.close(prepared.fd)
        os.unlink(j._path(prepared.file_id))
        j._next = failed  # the next file's preparation failed
        syncer.complete_one()  # block 0 durable; block 1 goes to the same file
        assert sink.durable_items == [0] and sink.failed == []
        assert j.file_id == first and j.stats["prepare_failures"] == 1 and j.stats["deferred_rolls"] == 1
        assert "preparing the next file failed" in caplog.text and "no space for the next journal file" in caplog.text
        syncer.complete_one()
        assert sink.durable_items == [0, 1] and j._next is None  # not tried again yet
        j.append(REC_ADD, 1, 2, bytes(40 << 10), item=2)
        await asyncio.sleep(0)
        syncer.complete_one()
        assert j.file_id == first and j._next is None
        now[0] += PREPARE_RETRY_S
        j.append(REC_ADD, 1, 3, bytes(40 << 10), item=3)
        await asyncio.sleep(0)  # this flush asks again (in line here) and takes the file it makes
        syncer.complete_one()
        assert j.file_id > first and sink.durable_items == [0, 1, 2, 3] and sink.failed == []
        j.close()

    run(main)
    records, _ = replay_all(tmp_path)
    assert [r[2] for r in records] == [0, 1, 2, 3]


class FailingSyncer:
    """A journal device that fails every sync: done(OSError(EIO)), now or on the next loop turn."""

    kind = "failing"

    def __init__(self, loop: asyncio.AbstractEventLoop, deferred: bool) -> None:
        self.loop, self.deferred, self.calls = loop, deferred, 0

    def submit(self, fd: int, buf: Any, offset: int, done: Callable[[OSError | None], None]) -> None:
        self.calls += 1
        err = OSError(errno.EIO, "injected journal write failure")
        if self.deferred:
            self.loop.call_soon(done, err)
        else:
            done(err)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_journal_sync_failure_fails_items_and_later_appends(tmp_path: Path, deferred: bool) -> None:
    """A failed sync hands its items (and any queued behind it) to on_failed, none to on_durable,
    and every later append fails at once: nothing more can be made durable."""

    async def main() -> tuple[Sink, FailingSyncer]:
        loop = asyncio.get_running_loop()
        syncer = FailingSyncer(loop, deferred)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink)
        j.start()
        for i in range(5):
            j.append(REC_ADD, 1, i, b"d", item=i)
        async with asyncio.timeout(5):  # drain awaited in this task, before the deferred flush runs
            await j.drain()  # resolves after the failure callbacks ran
        assert sorted(sink.failed_items) == [0, 1, 2, 3, 4]
        calls = syncer.calls
        j.append(REC_ADD, 1, 5, b"d", item=5)
        j.append(REC_ADD, 1, 6, b"d", item=6)
        assert sink.failed_items[-2:] == [5, 6]  # refused at once
        await asyncio.wait_for(j.drain(), 5)
        assert syncer.calls == calls  # nothing more is submitted
        j.close()
        return sink, syncer

    sink, _ = run(main)
    assert sink.durable == []
    assert sink.failed_items == list(range(7))  # each exactly once, in order
    for _, err in sink.failed:
        assert isinstance(err, OSError) and isinstance(err, JournalFailedError)
        assert err.errno == errno.EIO


def test_journal_failure_after_success_keeps_durable_items(tmp_path: Path) -> None:
    """Items of syncs that succeeded stay durable; only the failed block and those queued after it fail."""

    class FailSecond:
        kind = "fail-second"

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.inner = ThreadSyncer(loop)
            self.loop = loop
            self.n = 0

        def submit(self, fd, buf, offset, done):  # noqa: ANN001
            self.n += 1
            if self.n == 1:
                self.inner.submit(fd, buf, offset, done)
            else:
                self.loop.call_soon(done, OSError(errno.ENOSPC, "injected: device full"))

        def close(self) -> None:
            self.inner.close()

    async def main() -> Sink:
        loop = asyncio.get_running_loop()
        syncer = FailSecond(loop)
        sink = Sink()
        j = new_journal(tmp_path, syncer, loop, sink)
        j.start()
        j.append(REC_ADD, 1, 0, b"d", item=0)        # block 1: succeeds
        await asyncio.sleep(0)                       # (flushed at the end of the loop turn)
        for i in range(1, 4):
            j.append(REC_ADD, 1, i, b"d", item=i)    # block 2 (filled during sync 1): fails
        await asyncio.wait_for(j.drain(), 5)
        j.append(REC_ADD, 1, 4, b"d", item=4)
        await asyncio.wait_for(j.drain(), 5)
        j.close()
        syncer.close()
        return sink

    sink = run(main)
    assert sink.durable_items == [0]
    assert sink.failed_items == [1, 2, 3, 4]
    assert all(err.errno == errno.ENOSPC for _, err in sink.failed)


def test_make_syncer_falls_back_to_thread_when_io_uring_is_unavailable(monkeypatch, caplog) -> None:
    """Where io_uring cannot be set up (old kernel, seccomp), the thread syncer takes over, logged once."""
    import logging

    from bookkeeper.bookie.journal import syncer as syncer_mod

    def refuse(*_a, **_k):
        raise OSError(38, "io_uring_setup: Function not implemented")

    monkeypatch.setattr(syncer_mod.UringSyncer, "__init__", refuse)
    loop = uvloop.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger=syncer_mod.__name__):
            s = syncer_mod.make_syncer("io_uring", loop)
        assert s.kind == "thread"
        assert sum("falls back to thread" in r.message for r in caplog.records) == 1
        s.close()
        real = syncer_mod.make_syncer("thread", loop)
        assert real.kind == "thread"
        real.close()
    finally:
        loop.close()


@pytest.mark.parametrize("kind", ["io_uring", "thread"])
def test_roll_with_appends_from_the_durable_callback_keeps_every_record(tmp_path, kind) -> None:
    """A file roll while on_durable appends more records: no write to a closed descriptor, and a
    replay returns every record in order (regression: the roll used to follow the callback)."""
    from bookkeeper._ext.journal import REC_ADD
    from bookkeeper.bookie.journal import Journal

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of(kind, loop)
        done: list[int] = []
        finished = loop.create_future()
        payload = b"r" * 3000

        def on_durable(items: list) -> None:
            done.extend(items)
            if len(done) < 400:
                for i in items:
                    j.append(REC_ADD, 9, i + 10, payload, i + 10)
            elif j.idle and not finished.done():
                finished.set_result(None)

        def on_failed(items: list, err: OSError) -> None:
            if not finished.done():
                finished.set_exception(err)

        j = Journal(tmp_path, syncer=syncer, loop=loop, on_durable=on_durable, on_failed=on_failed,
                    preallocate_bytes=64 * 1024, file_max_bytes=64 * 1024)
        j.start()
        for i in range(10):
            j.append(REC_ADD, 9, i, payload, i)
        await asyncio.wait_for(finished, 30)
        j.close()
        syncer.close()

        records: list = []
        j2 = Journal(tmp_path, syncer=syncer, loop=loop, on_durable=lambda i: None, on_failed=lambda i, e: None)
        res = j2.replay((0, 0), records.extend)
        assert res.files > 2 and res.blocks_torn == 0
        assert [r[2] for r in records] == sorted(done)
    uvloop.run(main())


def test_journal_files_are_zero_filled_and_the_next_is_prepared(tmp_path: Path) -> None:
    """A journal file is written zeros up front (no unwritten extents to convert on every sync), and
    the next one waits ready under its own name (the spare it was filled as renamed)."""
    from bookkeeper.bookie.journal.journal import SPARE_FILE

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = make_syncer_of("thread", loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), preallocate_bytes=64 * 1024, spare_filler=None)
        j.start()
        first = j._path(j.file_id)
        st = os.stat(first)
        assert st.st_size == 64 * 1024 and st.st_blocks * 512 >= 64 * 1024  # allocated and written
        assert j._next is not None
        ready = j._next.result(timeout=10)
        st = os.stat(j._path(j.file_id + 1))
        assert ready.file_id == j.file_id + 1 and st.st_size == 64 * 1024 and st.st_blocks * 512 >= 64 * 1024
        assert not (tmp_path / SPARE_FILE).exists()
        first, filled = j.file_id, j.stats["filled_rolls"]
        for i in range(40):  # 40 x ~3 KiB records: more than one 64 KiB file
            j.append(1, 5, i, b"s" * 3000, item=i)
            await asyncio.wait_for(j.drain(), 10)
            if j._next is not None:
                await asyncio.wrap_future(j._next)  # so that every roll finds its file ready
        assert j.file_id > first and j.stats["filled_rolls"] > filled and j.stats["deferred_rolls"] == 0
        j.close()
        syncer.close()

    run(main)
    got, res = replay_all(tmp_path)
    assert [r[2] for r in got] == list(range(40)) and res.blocks_torn == 0


# -- reused files (format 2: seq = generation << 32 | n) --------------------------------------


def gen_seq(file_id: int, n: int) -> int:
    return (file_id & 0xFFFFFFFF) << 32 | n


def test_scan_with_generation_stops_at_another_generations_block_as_a_clean_end() -> None:
    """A valid block of an earlier use (another generation) right after this use's blocks ends the
    scan cleanly: not torn, nothing of it replayed; format 1 (generation -1) would replay it."""
    mine = make_block(recs(3), gen_seq(7, 0)) + make_block(recs(2, 3), gen_seq(7, 1))
    stale = make_block(recs(4, 100), gen_seq(3, 2)) + make_block(recs(4, 104), gen_seq(3, 3))
    got, end, torn, last_seq, next_valid = scan_blocks(mine + stale, 0, 7)
    assert (got, end, torn, last_seq, next_valid) == (recs(5), len(mine), False, gen_seq(7, 1), -1)
    assert scan_blocks(mine + stale, 0)[0] == recs(5) + recs(8, 100)


def test_scan_with_generation_requires_consecutive_blocks() -> None:
    """Blocks of one file carry n = 0, 1, 2, ...: a valid block of this generation whose n skips
    ends the scan (it cannot be this use's next block)."""
    image = make_block(recs(1), gen_seq(9, 0)) + make_block(recs(1, 1), gen_seq(9, 2))
    got, end, torn, last_seq, _ = scan_blocks(image, 0, 9)
    assert got == recs(1) and end == BLOCK_ALIGN and torn and last_seq == gen_seq(9, 0)


def test_scan_with_generation_in_the_middle_of_an_earlier_block_is_torn_and_finds_no_later_block() -> None:
    """This use's tail lands inside an earlier use's (bigger) block: the bytes there are not a
    block (torn), and the earlier use's later blocks are not this file's (next_valid -1)."""
    mine = make_block(recs(1), gen_seq(5, 0))
    big_stale = make_block([(REC_ADD, 1, 0, b"x" * 9000)], gen_seq(4, 0))  # 3 x 4 KiB
    image = big_stale + make_block(recs(2, 50), gen_seq(4, 1))
    image = mine + image[len(mine):]
    got, end, torn, last_seq, next_valid = scan_blocks(image, 0, 5)
    assert got == recs(1) and end == BLOCK_ALIGN and torn and next_valid == -1


def test_scan_with_generation_still_finds_a_corrupt_block_in_the_middle() -> None:
    """A damaged block of this use followed by a valid block of this use is reported (next_valid)
    even in a reused file whose later bytes hold an earlier use's blocks."""
    blocks = [make_block(recs(2, 2 * i), gen_seq(6, i)) for i in range(3)]
    bad = bytearray(blocks[1])
    bad[BLOCK_HEADER_BYTES + 5] ^= 0x40
    image = blocks[0] + bytes(bad) + blocks[2] + make_block(recs(1, 90), gen_seq(2, 7))
    got, end, torn, last_seq, next_valid = scan_blocks(image, 0, 6)
    assert got == recs(2) and end == BLOCK_ALIGN and torn and next_valid == 2 * BLOCK_ALIGN


def _write_files(tmp_path: Path, per_file: list[list[tuple]], *, reuse_files: int, trim_each: bool) -> Journal:
    """Write each list of records as one file, a block per record (a roll between lists); trim everything before the
    new file after each roll if trim_each. Returns the closed journal (its stats and ids stay)."""

    async def main() -> Journal:
        loop = asyncio.get_running_loop()
        syncer, sink = ThreadSyncer(loop), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=256 << 10, reuse_files=reuse_files)
        j.replay((0, 0), lambda _: None)
        j.start()
        for i, rs in enumerate(per_file):
            if i:
                j._open_new_file()
                if trim_each:
                    j.trim(j.file_id)
            for r in rs:  # one block per record
                j.append(*r, item=r[2])
                await j.drain()
        j.close()
        syncer.close()
        return j

    return run(main)


def test_trimmed_files_are_reused_and_replay_ignores_their_earlier_blocks(tmp_path: Path) -> None:
    """Files before the mark go to the pool; the next file prepared after that takes one and
    overwrites it from the start (no zero-fill), and replay of the reused file yields only
    this use's records, though the earlier use's many blocks follow its tail."""
    from bookkeeper.bookie.journal.journal import FLAG_REUSED, POOL_GLOB

    big = [(REC_ADD, 1, i, bytes([i % 200 + 1]) * 5000) for i in range(30)]  # 30 blocks of 8 KiB
    last = [(REC_ADD, 1, 600, b"q" * 5000)]  # one 8 KiB block: an earlier block starts right after it
    j = _write_files(tmp_path, [big, recs(3, 500), recs(2, 700), last], reuse_files=4, trim_each=True)
    # File 1 (big) was trimmed at the roll to file 2, when file 3 was prepared already (zero-filled);
    # the roll to 3 prepared 4 from it. 2 and 3 went to the pool; 5, prepared from 2, went back at close.
    assert j.stats["reused_rolls"] == 1 and j.stats["filled_rolls"] == 3 and j.file_ids() == [4]
    assert sorted(tmp_path.glob(POOL_GLOB)) == [tmp_path / f"reuse-{3:016x}.jnl.tmp", tmp_path / f"reuse-{5:016x}.jnl.tmp"]
    image = (tmp_path / f"{4:016x}.jnl").read_bytes()
    assert struct.unpack_from(">4sIQI", image) == (b"BKJF", FILE_VERSION, 4, FLAG_REUSED)
    assert scan_blocks(image, BLOCK_ALIGN, 4)[:3] == (last, 3 * BLOCK_ALIGN, False)
    assert scan_blocks(image, BLOCK_ALIGN, -1)[0] == last + big[1:]  # read as format 1: stale records
    got, res = replay_all(tmp_path)
    assert got == last and res.blocks_torn == 0 and res.reused_ends == 0


async def _fill_file_1_then_pool_it(j: Journal, records: list[tuple]) -> None:
    """Start j, write records to file 1 (a block each), roll to file 2 (3 is prepared then,
    zero-filled), trim file 1 into the pool, roll to file 3: file 4 is prepared from file 1."""
    j.start()
    for r in records:
        j.append(*r, item=None)
        await j.drain()
    j._open_new_file()
    j.trim(j.file_id)
    j._open_new_file()


def test_a_crash_with_a_reused_next_file_prepared_loses_no_record(tmp_path: Path) -> None:
    """Killed (never closed) while the next file, prepared from the pool, waits with its new
    header, REUSED flag and an earlier use's blocks: replay yields exactly the records written,
    none of the earlier use's."""
    from bookkeeper.bookie.journal.journal import FLAG_REUSED

    big = [(REC_ADD, 1, i, bytes([i % 200 + 1]) * 5000) for i in range(20)]
    mine = recs(6, 900)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), preallocate_bytes=256 << 10, reuse_files=4)
        await _fill_file_1_then_pool_it(j, big)  # now in file 3; 4 prepared from file 1
        assert j._next is not None and j._next.result().reused
        for r in mine:
            j.append(*r, item=None)
            await j.drain()
        prepared = j._next.result()
        for fd in (j._fd, prepared.fd):  # the crash: nothing closed, nothing tidied
            os.close(fd)
        syncer.close()
        return prepared.file_id

    nxt = run(main)
    image = (tmp_path / f"{nxt:016x}.jnl").read_bytes()
    assert struct.unpack_from(">4sIQI", image) == (b"BKJF", FILE_VERSION, nxt, FLAG_REUSED)
    assert scan_blocks(image, BLOCK_ALIGN, -1)[0][:3] == big[:3]  # the earlier use's blocks are there
    got, res = replay_all(tmp_path)
    assert got == mine and res.blocks_torn == 0


def test_rolls_trims_and_releases_on_their_own_threads_lose_no_record(tmp_path: Path) -> None:
    """The filler thread prepares files while another thread trims into the pool and releases
    pooled files, as the retire thread and the disk check do: every record is answered and
    replays, in order (bounded: 300 records of 20 KiB over 64 KiB files)."""
    import threading

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ThreadSyncer(loop), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=64 << 10, reuse_files=2,
                        spare_filler=None)
        j.start()
        stop = threading.Event()
        errors: list[BaseException] = []

        def churn() -> None:
            while not stop.is_set():
                try:
                    j.trim(max(1, j.file_id - 1))
                    j.release([p.name for p in j.pool()][:1])
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return
        t = threading.Thread(target=churn)
        t.start()
        try:
            for i in range(300):
                j.append(REC_ADD, 1, i, bytes([i % 250 + 1]) * (20 << 10), item=i)
                if i % 4 == 0:
                    await asyncio.wait_for(j.drain(), 10)
            await asyncio.wait_for(j.drain(), 10)
        finally:
            stop.set()
            t.join()
        assert errors == [] and sink.failed == [] and sink.durable_items == list(range(300))
        assert j.stats["reused_rolls"] + j.stats["filled_rolls"] >= 20, j.stats
        j.close()
        syncer.close()

    run(main)
    got, _ = replay_all(tmp_path)
    kept = [r[2] for r in got]
    assert kept and kept == list(range(kept[0], 300))  # trimmed files gone, the rest whole and in order


def test_reused_file_replay_across_restarts_keeps_every_acknowledged_record(tmp_path: Path) -> None:
    """Sessions that trim and reuse files, then a replay from each session's mark: exactly the
    records written after the mark, whatever the earlier uses left in the files."""
    sessions = [[(REC_ADD, 2, 100 * s + i, bytes([s + 1]) * (300 * (i % 7) + 20)) for i in range(40)]
                for s in range(6)]
    marks = []

    async def session(rs: list[tuple]) -> None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), preallocate_bytes=48 << 10, reuse_files=2)
        j.replay(marks[-1] if marks else (0, 0), lambda _: None)
        j.start()
        if marks:
            j.trim(marks[-1][0])  # the previous session's records are checkpointed
        marks.append(j.position())
        for r in rs:
            j.append(*r, item=None)
            if r[2] % 3 == 0:
                await j.drain()
        await j.drain()
        j.close()
        syncer.close()
        assert j.stats["reused_rolls"] >= (1 if len(marks) > 2 else 0)

    for rs in sessions:
        uvloop.run(session(rs))
    assert replay_all(tmp_path, marks[-1])[0] == sessions[-1]


def test_reuse_disabled_deletes_trimmed_files(tmp_path: Path) -> None:
    """journal_reuse_files 0: trim deletes, nothing is pooled, every roll makes a new file."""
    from bookkeeper.bookie.journal.journal import POOL_GLOB

    j = _write_files(tmp_path, [recs(2), recs(2, 2), recs(2, 4)], reuse_files=0, trim_each=True)
    assert j.stats["reused_rolls"] == 0 and not list(tmp_path.glob(POOL_GLOB)) and j.file_ids() == [3]


def test_pool_is_bounded_and_format_1_files_are_never_reused(tmp_path: Path) -> None:
    """trim pools at most reuse_files files (the rest are deleted), and deletes a format 1 file
    (one seq counter across files: its blocks carry no generation to tell them from new ones)."""
    from bookkeeper.bookie.journal.journal import POOL_GLOB

    v1 = tmp_path / f"{1:016x}.jnl"
    v1.write_bytes(struct.pack(">4sIQ", b"BKJF", 1, 1).ljust(BLOCK_ALIGN, b"\0") + py_block(recs(2), 0))
    assert replay_all(tmp_path)[0] == recs(2)  # format 1 is still read

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), reuse_files=2)
        j.replay((0, 0), lambda _: None)
        j.start()
        for _ in range(4):
            j._open_new_file()
        assert j.file_ids() == [1, 2, 3, 4, 5, 6, 7]  # 7: the next file, prepared
        assert j.trim(j.file_id) == 5
        assert sorted(p.name for p in tmp_path.glob(POOL_GLOB)) == [f"reuse-{2:016x}.jnl.tmp",
                                                                   f"reuse-{3:016x}.jnl.tmp"]
        j.close()  # the pool is full: the unused 7 is deleted, not pooled
        assert j.file_ids() == [6]
        # The next start takes a pooled file, and its successor the other: no zero-fill is begun.
        k = new_journal(tmp_path, syncer, loop, Sink(), reuse_files=2)
        k.replay((6, 0), lambda _: None)
        k.start()
        assert k.file_id == 7 and k.stats["reused_rolls"] == 1 and k.pool() == []
        assert k._next is not None and k._next.result().reused
        k.close()
        syncer.close()

    run(main)


def test_a_reuse_cut_off_before_its_header_was_rewritten_is_skipped(tmp_path: Path) -> None:
    """A crash between renaming a pooled file to its new id and writing its header leaves a file
    whose header names its old id: replay skips it whole (none of its blocks is this use's)."""
    j = _write_files(tmp_path, [recs(5), recs(2, 5)], reuse_files=4, trim_each=True)
    pooled = tmp_path / f"reuse-{1:016x}.jnl.tmp"
    assert pooled.exists()
    os.rename(pooled, tmp_path / f"{j.file_id + 1:016x}.jnl")
    got, res = replay_all(tmp_path, (j.file_id, 0))
    assert got == recs(2, 5) and res.files == 1


def test_corrupt_block_in_a_reused_file_is_refused(tmp_path: Path) -> None:
    """The corrupt-block check holds in a reused file: a flipped byte in this use's second block,
    with a third after it, refuses replay though an earlier use's blocks follow."""
    from bookkeeper.bookie.journal.journal import JournalCorruptError

    big = [(REC_ADD, 1, i, b"z" * 5000) for i in range(20)]

    async def main() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), preallocate_bytes=256 << 10, reuse_files=1)
        await _fill_file_1_then_pool_it(j, big)
        j._open_new_file()  # reuses file 1 as file 4
        assert j.stats["reused_rolls"] == 1
        starts = []
        for b in range(3):
            starts.append(j.position())
            for r in recs(2, 2 * b):
                j.append(*r, item=None)
            await j.drain()
        j.close()
        syncer.close()
        return starts

    starts = run(main)
    path = tmp_path / f"{starts[0][0]:016x}.jnl"
    image = bytearray(path.read_bytes())
    image[starts[1][1] + BLOCK_HEADER_BYTES + 3] ^= 0x10
    path.write_bytes(bytes(image))
    with pytest.raises(JournalCorruptError, match=f"offset {starts[1][1]}"):
        replay_all(tmp_path, (starts[0][0], 0))


# -- the pool given back (issue 22 item 2) -------------------------------------------------------


def test_pool_files_list_reuse_files_oldest_first_then_the_spare_and_release_frees_them(tmp_path: Path) -> None:
    """pool_files: the reuse files by their old id, the spare last, with the bytes they hold;
    journal_pool_bytes sums every shard's; release deletes what it is given and says what it freed."""
    from bookkeeper.bookie.journal.journal import SPARE_FILE, journal_pool_bytes, pool_files

    shard = tmp_path / "shard-0"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(shard, syncer, loop, Sink(), preallocate_bytes=64 << 10, reuse_files=2)
        j.start()  # file 1, and file 2 prepared
        for _ in range(3):
            j._open_new_file()
        j.trim(j.file_id)  # files 1 and 2 pooled, 3 deleted; 5, prepared at the last roll, kept
        j._open_new_file()  # to 5; 6 prepared from the oldest pooled file (id 1): 2 stays pooled
        (shard / SPARE_FILE).write_bytes(bytes(64 << 10))  # as a filler cut off mid-file leaves it
        pool = pool_files(shard)
        assert [name for name, _ in pool] == [f"reuse-{2:016x}.jnl.tmp", SPARE_FILE]
        assert all(size >= 64 << 10 for _, size in pool)
        assert journal_pool_bytes(tmp_path) == sum(size for _, size in pool)
        assert j.release([name for name, _ in pool]) == pool
        assert pool_files(shard) == [] and journal_pool_bytes(tmp_path) == 0
        assert j.release([f"reuse-{2:016x}.jnl.tmp"]) == []  # gone already: nothing freed, no error
        with pytest.raises(ValueError, match="not a pooled journal file"):
            j.release([f"{j.file_id:016x}.jnl"])
        j.close()
        syncer.close()

    run(main)


def test_release_leaves_a_spare_still_being_filled(tmp_path: Path) -> None:
    """Its filler thread still writes to it: deleting it would fail the next file's
    preparation (a failed journal); it goes at a later release, once the preparation ended."""
    from bookkeeper.bookie.journal.journal import SPARE_FILE

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer = ThreadSyncer(loop)
        j = new_journal(tmp_path, syncer, loop, Sink(), preallocate_bytes=64 << 10)
        j.start()
        prepared = j._next
        assert prepared is not None
        filling: concurrent.futures.Future[Any] = concurrent.futures.Future()
        j._next = filling
        (tmp_path / SPARE_FILE).write_bytes(bytes(4096))
        assert j.release([SPARE_FILE]) == [] and (tmp_path / SPARE_FILE).exists()
        filling.set_result(prepared.result())
        assert [name for name, _ in j.release([SPARE_FILE])] == [SPARE_FILE]
        assert not (tmp_path / SPARE_FILE).exists()
        j.close()
        syncer.close()

    run(main)


def test_without_pooling_trim_deletes_and_rolls_make_no_spare(tmp_path: Path) -> None:
    """pooling off (the journal disk past disk_usage_warn): trimmed files are deleted, no file is
    zero-filled (the next is only fallocate'd); every record still replays."""
    from bookkeeper.bookie.journal.journal import pool_files

    async def main() -> None:
        loop = asyncio.get_running_loop()
        syncer, sink = ThreadSyncer(loop), Sink()
        j = new_journal(tmp_path, syncer, loop, sink, preallocate_bytes=64 << 10, reuse_files=4)
        j.pooling = False
        j.start()
        for i in range(6):
            j.append(REC_ADD, 1, i, bytes(40 << 10), item=i)
            await asyncio.wait_for(j.drain(), 5)
        assert len(j.file_ids()) >= 3 and j.stats["unfilled_rolls"] >= 3 and j.stats["filled_rolls"] == 0
        j.trim(j.file_id)
        assert j.file_ids() == [j.file_id, j.file_id + 1] and pool_files(tmp_path) == []
        assert sink.durable_items == list(range(6))
        j.close()
        syncer.close()

    run(main)
