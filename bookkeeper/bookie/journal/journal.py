"""The journal of one shard: group commit of records into blocks, one sync in flight.

Lives in: one shard process, its event loop thread.

An add is answered only after the block holding it is durable (write + fdatasync
returned). While one block's sync is in flight the next batch fills, so a batch is
flushed as soon as the previous sync returns (policy.py). Blocks are written in
order, strictly one at a time, so a torn block can only be the last one of the
last file, and replay stops there (record encoding: ext/bookkeeper/_ext/journal.pyx).

File: `<file_id:016x>.jnl`, a 4096-byte header ('BKJF' | u32 version | u64 file_id |
u32 flags, zero padded), then aligned blocks. A new file is started on every start (never
append after a possibly torn tail) and when the next block does not fit the file and the
next file is ready (below).

The next file is prepared while this one is in use, on a background thread (`_prepare`):
renamed or filled, its header and its name made durable. A roll on the loop is then a
swap of file descriptors; a file that fills before its successor is ready takes the next
blocks past its preallocation (the writes extend it) until it is. Each byte is written
once: files wholly before the checkpoint mark are not deleted by `trim` but kept in a
pool (`reuse-<old id>.jnl.tmp`, up to journal_reuse_files), and the next file is one of
them renamed to the new id and overwritten from the start: no zero-fill, no unwritten
extents. Its old blocks stay after the new tail; each block's seq carries the file's
generation (journal.pyx), so replay stops at them. Only with an empty pool is a new file
made, zero-filled (as the spare, `spare.jnl.tmp`, then renamed).

The pool (reuse files and a spare being filled) is room the bookie can give back: while
its shard says the journal disk is past disk_usage_warn (`pooling` off, bookie/state.py
journal_space), trimmed files are deleted, the next file is only fallocate'd, and
`release` deletes pooled files on the shard's word.

Version history: 1 - header without flags, seq one counter across files (still read; never
reused). 2 - seq = generation << 32 | n; flags bit 0: reused (bytes after the last block
may be an earlier use's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bookkeeper._ext.journal import BLOCK_ALIGN, JournalBatch, scan_blocks
from bookkeeper.bookie.files import fsync_dir, zero_fill
from bookkeeper.clock import Clock, system_monotonic
from bookkeeper.bookie.journal.policy import (BlockScan, FileHeader, FlushReason, ReplayStep, flush_reason,
                                              replay_step)
from bookkeeper.bookie.journal.syncer import Syncer

log = logging.getLogger(__name__)

PREPARE_RETRY_S = 1.0  # a failed preparation of the next file is tried again after this
SPARE_FILE = "spare.jnl.tmp"  # the next file, being zero-filled; not a journal until renamed
POOL_GLOB = "reuse-*.jnl.tmp"  # trimmed files kept for reuse; not journals until renamed
FILE_MAGIC = b"BKJF"
FILE_VERSION = 2
FLAG_REUSED = 1
_FILE_HEADER = struct.Struct(">4sIQ")
_FILE_FLAGS = struct.Struct(">I")  # right after _FILE_HEADER, from version 2

Record = tuple[int, int, int, bytes]
FREE_BUFFERS = 4  # durable blocks' buffers kept for the next pending blocks
_NEVER = 1 << 62  # slice_at while a light sender's records go to the next block: never sliced


def pool_files(directory: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """One shard journal dir's pooled files as (name, bytes allocated), oldest first: the
    reuse files by the id they had, then the spare (made last, for the next roll)."""
    d = Path(directory)
    out = []
    for path in [*sorted(d.glob(POOL_GLOB)), d / SPARE_FILE]:
        try:
            out.append((path.name, os.stat(path).st_blocks * 512))
        except FileNotFoundError:
            pass  # no spare, or taken by a roll meanwhile
    return out


def journal_pool_bytes(journal_dir: str | os.PathLike[str]) -> int:
    """Bytes in every shard's pool under a bookie's journal_dir (shard-<i>/): room it can give back."""
    return sum(size for shard in Path(journal_dir).glob("shard-*") for _name, size in pool_files(shard))


@dataclass(slots=True)
class ReplayResult:
    files: int = 0
    records: int = 0
    blocks_torn: int = 0
    reused_ends: int = 0  # reused files whose blocks end where an earlier use's bytes begin
    last_file_id: int = 0


class JournalFailedError(OSError):
    """The journal device failed: nothing more can be made durable on this shard."""


class JournalCorruptError(OSError):
    """A journal block was damaged after it was acknowledged (a valid block follows it): replaying
    past it would silently drop acknowledged records, so the shard refuses to start."""


class Journal:
    """Group-commit journal of one shard (loop thread only)."""

    def __init__(self, directory: str | os.PathLike[str], *, syncer: Syncer,
                 loop: asyncio.AbstractEventLoop,
                 on_durable: Callable[[list[Any]], None],
                 on_failed: Callable[[list[Any], OSError], None],
                 group_wait_us_max: int = 0, batch_bytes_max: int = 4 << 20, batch_entries_max: int = 65536,
                 block_bytes_max: int = 1 << 20, preallocate_bytes: int = 64 << 20, file_max_bytes: int = 512 << 20,
                 reuse_files: int = 4, clock: Clock = system_monotonic,
                 spare_filler: concurrent.futures.Executor | None = None) -> None:
        """batch_bytes_max, batch_entries_max: what may wait to be written in all (the shard's
        memory bound: `full`); block_bytes_max: what one block holds (sealed by size at it,
        bounded by batch_bytes_max), so that a light sender's add, put in the next block to
        be written (`select`), waits for at most one sync and one block of that many bytes.
        spare_filler: where the next file is prepared ahead of a roll (default: a thread of
        its own; the simulator's and most tests' run the job at once, so a run does not depend
        on a thread)."""
        self.dir = Path(directory)
        self.clock = clock  # group waits and sync latencies (bookkeeper/clock.py: virtual in a simulation)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.syncer = syncer
        self.loop = loop
        self.on_durable = on_durable
        self.on_failed = on_failed
        self.group_wait_us_max = group_wait_us_max
        self.batch_bytes_max = batch_bytes_max
        self.batch_entries_max = batch_entries_max
        self.block_bytes_max = min(block_bytes_max, batch_bytes_max)
        self.preallocate_bytes = preallocate_bytes
        self.file_max_bytes = file_max_bytes
        self.reuse_files = reuse_files
        # Trimmed files go to the pool and a spare is kept ready; off while the journal disk
        # is past disk_usage_warn (the shard says so: bookie/state.py journal_space).
        self.pooling = True
        self.file_id = 0
        self._fd = -1
        self._pos = 0
        self._allocated = 0
        self._filler: concurrent.futures.Executor | None = spare_filler
        self._next: concurrent.futures.Future[_NextFile] | None = None  # the file after this one, being prepared
        self._roll_deferred = False  # this file is full and the next not ready: counted once
        self._retry_at = 0.0  # a failed preparation is tried again from then (self.clock)
        self._blocks_in_file = 0  # n of the next block's seq
        # Blocks not yet written, the next to write first; never empty. Every one but the last
        # holds block_bytes_max or more (the last is sealed by size as it fills).
        self._queue: deque[_Pending] = deque([_Pending(JournalBatch(), 1)])
        self._next_seq = 2
        # Where appended records go now: the last pending block, or, while a light sender's
        # receive buffer is dispatched, the first (select). _batch is its batch: the shard's C
        # add path appends to it directly; slice_at is the size at which it must ask for the
        # next block (seal_target): block_bytes_max, or never while a light sender jumps.
        self._target = self._queue[0]
        self._batch = self._target.batch
        self.slice_at = self.block_bytes_max
        self._sender: Any = None  # whose receive buffer is being dispatched (select)
        self._inflight_items: list[Any] | None = None
        self._inflight_batch: JournalBatch | None = None
        # Buffers of durable blocks, for the next pending blocks (at most FREE_BUFFERS kept): a
        # steady stream of blocks neither reallocates nor faults in fresh pages.
        self._free_buffers: list[bytearray] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flush_soon = False  # a _flush_deferred is scheduled for this loop turn
        self._closed = False
        self._failed: OSError | None = None
        self._idle_waiters: list[asyncio.Future[None]] = []
        # Rolls by the file they moved to: reused from the pool, zero-filled, only fallocate'd
        # (pooling off); deferred: a file was full before its successor was ready.
        self.stats = {"blocks": 0, "records": 0, "bytes": 0, "reused_rolls": 0, "filled_rolls": 0,
                      "unfilled_rolls": 0, "deferred_rolls": 0, "prepare_failures": 0}
        # Called with (records, bytes, seconds) once per block made durable: the shard's metrics.
        self.observe_batch: Callable[[int, int, float], None] | None = None
        self._inflight_started = 0.0
        self._inflight_size = (0, 0)
        # The block on_durable is answering: (sealed, synced) on self.clock, then (records,
        # bytes). Read by a running add trace (bookkeeper/bookie/add_trace.py).
        self.durable_block: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)

    # -- files -------------------------------------------------------------
    def _path(self, file_id: int) -> Path:
        return self.dir / f"{file_id:016x}.jnl"

    def file_ids(self) -> list[int]:
        return sorted(int(p.stem, 16) for p in self.dir.glob("*.jnl"))

    def pool(self) -> list[Path]:
        """Trimmed files kept for reuse, oldest first."""
        return sorted(self.dir.glob(POOL_GLOB))

    def _prepare(self, after: int) -> _NextFile:
        """Make the next file (its id past `after` and past every file there is: a replayed
        one, a test's) ready to take blocks (the filler thread, ahead of the roll that needs
        it, so that listing the directory is off the loop too): a trimmed file from the pool renamed to it, else a
        zero-filled one (filled as SPARE_FILE, then renamed), else, without pooling, a
        fallocate'd one; then its header written and synced and the directory synced.

        Why never a plain new file: fallocate leaves unwritten extents, and every fdatasync
        into them must also commit the extent conversion; measured on this kind of machine,
        writes into written blocks sync 1.6-5x faster. A reused file is written already.
        Why ahead and off the loop: each of these steps waits for the file system, and under
        write load a roll made on the loop took 5-570 ms (the fdatasync and directory fsync
        queue behind other writers' commits, a zero-fill or fallocate of a whole file more),
        every connection of the shard stalled meanwhile. A file prepared and never used (the
        shard stopped first) holds a header and no block: replay reads nothing from it.
        """
        file_id = max(max(self.file_ids(), default=after), after) + 1
        path = self._path(file_id)
        reused = False
        pooling = self.pooling  # as the shard says now, not when this was asked for
        if pooling:
            for pooled in self.pool():
                try:
                    os.rename(pooled, path)
                except FileNotFoundError:
                    continue  # released meanwhile (the disk short of room): the next one
                reused = True
                break
            else:
                zero_fill(self.dir / SPARE_FILE, self.preallocate_bytes)
                os.rename(self.dir / SPARE_FILE, path)
        else:  # the disk is short of room: nothing pooled, no zero-fill of a whole file
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.preallocate_bytes)
            finally:
                os.close(fd)
        fd = os.open(path, os.O_RDWR)
        try:
            header = (_FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, file_id)
                      + _FILE_FLAGS.pack(FLAG_REUSED if reused else 0)).ljust(BLOCK_ALIGN, b"\0")
            os.pwrite(fd, header, 0)
            os.fdatasync(fd)
            fsync_dir(self.dir)  # the new name must survive a power loss before a block is acknowledged from it
            allocated = max(BLOCK_ALIGN, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        return _NextFile(file_id, fd, allocated, reused=reused, filled=pooling)

    def _prepare_next(self) -> None:
        """Start preparing the file after the current one on the filler thread (not once closed:
        a sync completing after close must not start a thread nobody shuts down)."""
        if self._closed:
            return
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="journal-spare")
        self._next = self._filler.submit(self._prepare, self.file_id)

    def _roll(self, *, wait: bool = False) -> bool:
        """Move to the next file if it is prepared (nothing may be in flight); False if it is
        not yet: the current file takes the next blocks past its preallocation (extending
        writes: slower syncs for a while, never a stall of the shard). wait: block until it
        is (start-up, tests), and raise the OSError of a preparation that failed.

        A preparation that failed otherwise (ENOSPC while zero-filling, a pooled file
        released meanwhile...) is logged, counted and tried again at most every
        PREPARE_RETRY_S: the current file goes on taking blocks, and only a write that fails
        fails the journal. Failing it at the roll, as a roll on the loop did, would refuse
        every add over a file that could have grown (the space may be back by then)."""
        nxt = self._next
        if nxt is None:
            if self.clock() < self._retry_at and not wait:
                return self._defer()
            self._prepare_next()
            nxt = self._next
            if nxt is None:  # closed
                return False
        if not nxt.done() and not wait:
            return self._defer()
        self._next = None
        try:
            ready = nxt.result()
        except OSError as e:
            if wait:
                raise
            self.stats["prepare_failures"] += 1
            self._retry_at = self.clock() + PREPARE_RETRY_S
            log.warning("journal %s: preparing the next file failed (%s); file %d takes the next blocks "
                        "past its preallocation, trying again in %.0f s", self.dir, e, self.file_id, PREPARE_RETRY_S)
            return self._defer()
        if self._fd >= 0:
            os.close(self._fd)
        self.file_id, self._fd, self._allocated = ready.file_id, ready.fd, ready.allocated
        self._pos = BLOCK_ALIGN
        self._blocks_in_file = 0
        self._roll_deferred = False
        self.stats["reused_rolls" if ready.reused else "filled_rolls" if ready.filled else "unfilled_rolls"] += 1
        self._prepare_next()
        return True

    def _defer(self) -> bool:
        """The roll waits for the next file: counted once per file."""
        if not self._roll_deferred:
            self._roll_deferred = True
            self.stats["deferred_rolls"] += 1
        return False

    def _open_new_file(self) -> None:
        """Roll now, waiting for the next file if it is still being prepared (start-up, tests)."""
        self._roll(wait=True)

    def start(self) -> None:
        """Open a fresh journal file (after replay), past every file there is."""
        self._open_new_file()

    def position(self) -> tuple[int, int]:
        """(file_id, offset) just past the last block handed to the syncer."""
        return self.file_id, self._pos

    # -- replay --------------------------------------------------------------
    def replay(self, mark: tuple[int, int], apply: Callable[[list[Record]], None]) -> ReplayResult:
        """Apply every valid record past the checkpoint mark, file by file, in order."""
        result = ReplayResult()
        mark_file, mark_off = mark
        for fid in self.file_ids():
            result.last_file_id = fid
            if fid < mark_file:
                continue
            path = self._path(fid)
            records: list[Record] = []
            end = next_valid = -1
            scan: BlockScan | None = None
            flags = 0
            if path.stat().st_size < BLOCK_ALIGN:
                header = FileHeader.SHORT
            else:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    magic, version, hdr_id = _FILE_HEADER.unpack_from(mm, 0)
                    if magic != FILE_MAGIC or hdr_id != fid:
                        header = FileHeader.BAD
                    elif version > FILE_VERSION:
                        header = FileHeader.NEWER
                    else:
                        header = FileHeader.OK
                        flags = _FILE_FLAGS.unpack_from(mm, _FILE_HEADER.size)[0] if version >= 2 else 0
                        start = mark_off if fid == mark_file and mark_off >= BLOCK_ALIGN else BLOCK_ALIGN
                        records, end, torn, _, next_valid = scan_blocks(
                            mm, start, _generation(fid) if version >= 2 else -1)
                        scan = (BlockScan.CORRUPT_MIDDLE if next_valid >= 0
                                else BlockScan.TORN if torn else BlockScan.CLEAN)
            step = replay_step(header, scan, reused=bool(flags & FLAG_REUSED))
            if step is ReplayStep.SKIP:
                log.warning("journal %s: %s, skipped", path, "shorter than its header (created, never written)"
                            if header is FileHeader.SHORT else "bad header (no block was ever acknowledged from it)")
                continue
            if step is ReplayStep.REFUSE_NEWER:
                raise OSError(f"journal {path}: format version {version} is newer than supported")
            if step is ReplayStep.REFUSE_CORRUPT:
                raise JournalCorruptError(
                    f"journal {path}: the block at offset {end} is corrupt but a valid block follows at offset "
                    f"{next_valid}: it was damaged after it was acknowledged (a torn write can only be a "
                    f"file's last block). Replaying past it would lose acknowledged records, so this shard "
                    f"does not start: docs/operations.md, 'A corrupt journal block'")
            if step is ReplayStep.APPLY_REUSED_END:
                result.reused_ends += 1
                log.info("journal %s: blocks end at offset %d (after it: an earlier use's bytes or a torn "
                         "block; never acknowledged)", path, end)
            elif step is ReplayStep.APPLY_TORN:
                result.blocks_torn += 1
                log.warning("journal %s: torn block at offset %d discarded (never acknowledged)", path, end)
            if records:
                apply(records)
            result.files += 1
            result.records += len(records)
        self.file_id = result.last_file_id
        return result

    def trim(self, mark_file_id: int) -> int:
        """Retire journal files wholly before the checkpoint mark into the reuse pool (while it
        has room and pooling is on, format 2 only), else delete them; returns how many were
        retired. May run in a worker thread while the loop rolls and the filler prepares the
        next file: it touches only files before the mark and before the file in use (the next
        one prepared has a higher id), and the filler takes a pooled file whole (a rename) or
        not at all."""
        removed = 0
        pooled = len(self.pool())
        for fid in self.file_ids():
            if fid < min(mark_file_id, self.file_id):  # never the file in use, nor the next one prepared
                pooled += self._retire(fid, pooled)
                removed += 1
        return removed

    def _retire(self, file_id: int, pooled: int) -> bool:
        """Put a file no longer needed in the pool (pooling on, fewer than reuse_files pooled,
        format 2 only), else delete it; True if pooled."""
        path = self._path(file_id)
        if self.pooling and pooled < self.reuse_files and _file_version(path) >= 2:
            os.rename(path, self.dir / f"reuse-{file_id:016x}.jnl.tmp")
            return True
        path.unlink(missing_ok=True)
        return False

    def release(self, names: list[str] | tuple[str, ...]) -> list[tuple[str, int]]:
        """Delete these pooled files (names from pool_files); returns what was freed as (name,
        bytes). A spare still being filled stays (its thread writes on): it goes at a later
        call, once done; a name no longer pooled (taken by a roll) is skipped."""
        freed = []
        for name in names:
            if name == SPARE_FILE:
                if self._next is not None and not self._next.done():
                    continue  # being filled for the next file: its thread writes on
            elif not (name.startswith("reuse-") and name.endswith(".jnl.tmp")):
                raise ValueError(f"{name!r} is not a pooled journal file")
            path = self.dir / name
            try:
                size = os.stat(path).st_blocks * 512
                path.unlink()
            except FileNotFoundError:
                continue
            freed.append((name, size))
        return freed

    # -- group commit ----------------------------------------------------------
    @property
    def queued_bytes(self) -> int:
        """Bytes of records waiting to be written (every pending block)."""
        return self._queued()[0]

    @property
    def idle(self) -> bool:
        """Nothing in flight, nothing waiting to be written."""
        return self._inflight_items is None and not any(p.batch.count for p in self._queue)

    def _queued(self) -> tuple[int, int]:
        nbytes = count = 0
        for p in self._queue:
            nbytes += p.batch.nbytes
            count += p.batch.count
        return nbytes, count

    @property
    def full(self) -> bool:
        """What waits to be written reached its bytes or entries bound: senders should wait (backpressure)."""
        nbytes, count = self._queued()
        return nbytes >= self.batch_bytes_max or count >= self.batch_entries_max

    @property
    def under_twice_its_bounds(self) -> bool:
        """What waits to be written is under twice its bytes and entries bounds: the room light
        senders may still take while it is full (server.ShardServer.apply_backpressure)."""
        nbytes, count = self._queued()
        return nbytes < 2 * self.batch_bytes_max and count < 2 * self.batch_entries_max

    def select(self, sender: Any, light: bool) -> None:
        """Where the records of `sender`'s next receive buffer go, until deselect(): the next
        block to be written if the sender is light (the server's rule: a few small adds, none
        of them waiting on the Python path), every record it sent before is in that block or
        earlier, and that block holds under twice block_bytes_max; else the last block, as
        every record without a selection.

        Why (issue 28 item 3): behind a bulk writer the blocks waiting to be written hold up
        to batch_bytes_max; a latency-sensitive writer's lone add put at their end waited for
        every one of them. Put in the next block, it waits for the sync in flight and one
        block of bounded bytes. Why only then: a sender's adds are answered in the order they
        came (its encoded answers wait in order, bookie/server.py send_pending), so none of its
        records may pass one of its own; records of different senders have no order to keep
        (each answer waits for its own record to be durable, and what a fence or an add
        changes is visible in memory when it is accepted, not when it is durable).
        `sender.journal_block` keeps the number of the last block its records went to."""
        front = self._queue[0]
        if light and sender.journal_block <= front.seq and front.batch.nbytes < 2 * self.block_bytes_max:
            self._target, self.slice_at = front, _NEVER
        else:
            self._target, self.slice_at = self._queue[-1], self.block_bytes_max
        self._batch = self._target.batch
        self._sender = sender
        sender.journal_block = self._target.seq

    def deselect(self) -> None:
        """Records go to the last block again (the end of a receive buffer's dispatch)."""
        self._target = self._queue[-1]
        self._batch = self._target.batch
        self.slice_at = self.block_bytes_max
        self._sender = None

    def seal_target(self) -> None:
        """The last block reached block_bytes_max: later records (of this receive buffer too:
        the C add path asks at slice_at) go to a new one."""
        if self._target is self._queue[-1] and self._target.batch.count:
            self._add_pending()
        self._to_last()

    def _add_pending(self) -> None:
        """A new last pending block, on a durable block's buffer if one is kept."""
        self._queue.append(_Pending(JournalBatch(self._free_buffers.pop() if self._free_buffers else None),
                                    self._next_seq))
        self._next_seq += 1

    def _to_last(self) -> None:
        """The selected sender's later records go to the last block (deselect, keeping the sender)."""
        sender = self._sender
        self.deselect()
        if sender is not None:
            self._sender = sender
            sender.journal_block = self._target.seq

    def append(self, rtype: int, ledger_id: int, entry_id: int, data: bytes, item: Any, *,
               first: bool = False) -> None:
        """Add a record to the selected block (the last one unless select() chose the next to
        write); item is handed to on_durable once it is durable.

        first: to the first pending block, whatever is selected: a ledger's MASTER_KEY, which
        replay needs before any other record of the ledger (it drops an add or a fence of a
        ledger it has not seen created), while a light sender's add or fence of that ledger,
        accepted after it, may go to the first block (select). Earlier is always safe for it:
        the ledger exists in memory from then on."""
        if self._failed is not None:
            self.on_failed([item], self._failed)
            return
        target = self._queue[0] if first else self._target
        if target.batch.count == 0:
            target.started = self.clock()
        target.batch.add(rtype, ledger_id, entry_id, data)
        target.items.append(item)
        if target is self._target and self.slice_at != _NEVER and target.batch.nbytes >= self.block_bytes_max:
            self.seal_target()  # as the C add path does: no block past the bound by more than one record
        self._appended()

    def attach(self, item: Any, started_batch: bool) -> None:
        """Records were appended to the selected block's batch directly (the shard's C add
        path, shardpath.pyx, which checks that the journal has not failed): item is handed to
        on_durable once they are durable. started_batch: they were its first records."""
        target = self._target
        if started_batch:
            target.started = self.clock()
        target.items.append(item)
        self._appended()

    def _appended(self) -> None:
        if self._inflight_items is not None:
            return  # the blocks fill behind the sync in flight
        if self.full:
            self._maybe_flush()
        elif not self._flush_soon:
            # Decide at the end of this loop turn, not at this record: every record of the
            # receive buffers being dispatched now joins one block (one sync, not two).
            self._flush_soon = True
            self.loop.call_soon(self._flush_deferred)

    def _flush_deferred(self) -> None:
        self._flush_soon = False
        if not self._closed:  # closed within the turn that scheduled this: nothing to write to
            self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self._inflight_items is not None:
            return  # one sync in flight: the blocks fill until it returns (policy.flush_reason)
        front = self._queue[0]
        batch = front.batch
        reason = flush_reason(
            batch_count=batch.count, batch_bytes=batch.nbytes,
            oldest_wait_us=int((self.clock() - front.started) * 1e6) if batch.count else 0,
            sync_in_flight=False,
            group_wait_us_max=self.group_wait_us_max, batch_bytes_max=self.block_bytes_max,
            batch_entries_max=self.batch_entries_max)
        if reason is None and len(self._queue) > 1:
            reason = FlushReason.FULL  # a block sealed by size behind it waits: no group wait for it
        if reason is not None:
            self._flush()
        elif batch.count and self._timer is None:
            # Only the rest of the wait: the batch may have filled behind a sync already.
            waited_s = self.clock() - front.started
            self._timer = self.loop.call_later(max(0.0, self.group_wait_us_max / 1e6 - waited_s), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._maybe_flush()

    def _flush(self) -> None:
        """Write the next pending block (it has records)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        front = self._queue.popleft()
        if not self._queue:
            self._add_pending()
        if self._target is front:  # flushed while a light sender's records went to it
            self._to_last()
        batch, items = front.batch, front.items
        if self._pos + batch.sealed_bytes > self._allocated and self._pos > BLOCK_ALIGN:
            try:
                self._roll()  # nothing is in flight here: to the prepared next file, if it is ready
            except OSError as e:  # e.g. ENOSPC: this batch can never be durable; neither can later ones
                self._fail(e, items)
                return
        block = batch.seal(_generation(self.file_id) << 32 | self._blocks_in_file)  # the file it goes to
        if self._pos + len(block) > self._allocated:  # the next file not ready, or a block larger than a file
            self._allocated = self._pos + len(block)  # the write itself extends the file
        offset = self._pos
        self._pos += len(block)
        self._blocks_in_file += 1
        self._inflight_items = items
        self._inflight_batch = batch
        self.stats["blocks"] += 1
        self.stats["records"] += batch.count
        self.stats["bytes"] += len(block)
        self._inflight_size = (batch.count, len(block))
        self._inflight_started = self.clock()
        self.syncer.submit(self._fd, block, offset, self._on_synced)

    def _on_synced(self, err: OSError | None) -> None:
        items = self._inflight_items or []
        self._inflight_items = None
        if self._inflight_batch is not None:
            buffer = self._inflight_batch.buffer
            if len(self._free_buffers) < FREE_BUFFERS and len(buffer) <= 2 * self.block_bytes_max:
                self._free_buffers.append(buffer)  # not one grown by a light sender's slack
            self._inflight_batch = None
        if err is not None:
            self._fail(err, items)
        else:
            synced = self.clock()
            self.durable_block = (self._inflight_started, synced, *self._inflight_size)
            if self.observe_batch is not None:
                self.observe_batch(*self._inflight_size, synced - self._inflight_started)
            try:
                if self._pos >= self.file_max_bytes:
                    self._roll()  # while nothing is in flight (if the next file is ready)
                # The next block goes to the device first, then this one is answered: encoding
                # and sending responses overlaps the next sync instead of delaying it.
                self._maybe_flush()
            except OSError as e:  # a failed roll: what is queued fails, what is durable is still answered
                self._fail(e, [])
            finally:
                self.on_durable(items)
        self._wake_idle()

    def _wake_idle(self) -> None:
        """Resolve drain() waiters once nothing is in flight or queued."""
        if self.idle:
            for w in self._idle_waiters:
                if not w.done():
                    w.set_result(None)
            self._idle_waiters.clear()

    def _fail(self, err: OSError, items: list[Any]) -> None:
        """The journal can make nothing durable any more: fail items and every pending block's."""
        log.error("journal failed, shard stops accepting writes: %s", err)
        self._failed = JournalFailedError(err.errno or 5, str(err))
        self.on_failed(items, self._failed)
        for pending in self._queue:
            self.on_failed(pending.items, self._failed)
        self._queue = deque()
        self._add_pending()
        self.deselect()
        self._wake_idle()  # a failed roll in _flush leaves nothing in flight: nobody else would

    async def drain(self) -> None:
        """Wait until every appended record is durable (or failed)."""
        if self.idle:
            return
        # Waiter first: the flush may complete at once (a syncer that fails synchronously, a
        # failed roll) and wakes only the waiters registered by then.
        fut = self.loop.create_future()
        self._idle_waiters.append(fut)
        if self._inflight_items is None and self._queue[0].batch.count:
            self._flush()
        await fut

    def close(self) -> None:
        """Release the file and the filler; records not yet flushed stay unanswered (drain first)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None
        nxt, self._next = self._next, None
        if nxt is not None and nxt.done() and nxt.exception() is not None:
            log.warning("journal %s: preparing the next file failed: %s", self.dir, nxt.exception())
        elif nxt is not None and nxt.done():
            unused = nxt.result()  # prepared, never used: back to the pool (or gone) rather than left as
            os.close(unused.fd)    # a file of a header and no block (which replay would read as nothing)
            self._retire(unused.file_id, len(self.pool()))
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Pending:
    """A block not yet written: its records, what on_durable gets for them, when its first
    record came (group wait) and its number (select: a sender's records never pass its own)."""

    __slots__ = ("batch", "items", "started", "seq")

    def __init__(self, batch: JournalBatch, seq: int) -> None:
        self.batch = batch
        self.items: list[Any] = []
        self.started = 0.0
        self.seq = seq


@dataclass(frozen=True)
class _NextFile:
    """A journal file made ready by Journal._prepare: open, its header durable, its name too."""

    file_id: int
    fd: int
    allocated: int
    reused: bool  # from the pool (FLAG_REUSED)
    filled: bool  # written through: reused or zero-filled (else only fallocate'd)


def _generation(file_id: int) -> int:
    """The generation a file's blocks carry in their seq: the low 32 bits of its id (ids only grow,
    so an earlier use of a reused file has another one unless 2**32 files were made between)."""
    return file_id & 0xFFFFFFFF


def _file_version(path: Path) -> int:
    """The format version in a journal file's header, 0 if unreadable."""
    try:
        with open(path, "rb") as f:
            magic, version, _ = _FILE_HEADER.unpack(f.read(_FILE_HEADER.size))
    except (OSError, struct.error):
        return 0
    return version if magic == FILE_MAGIC else 0
