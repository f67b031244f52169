"""Ledger storage of one shard: write cache -> entry log files + LMDB index.

Lives in: one shard process, used from its event loop thread, except `flush`,
which a checkpoint runs in a worker thread on a swapped-out snapshot of the
write cache (so adds never wait for the entry log's fsync).

Why this shape (Apache BookKeeper's DbLedgerStorage): the journal makes an entry
durable with one sequential write; storage re-writes entries, grouped, to an
append-only entry log, and an index maps (ledger, entry) -> (log, offset, length).
LMDB holds the index and the durable per-ledger state (master key, fenced flag,
LAC) plus the checkpoint mark: the journal position up to which everything is in
the entry log and index. The mark is committed in the same LMDB transaction as
the index, after the entry log is fsynced: the invariant is "index and mark never
point past durable entry-log bytes". Why LMDB: docs/index-store.md.

Entry log record (big-endian): u32 length | u64 ledger_id | i64 entry_id | data.
Entry log file header: 8 bytes magic 'BKELOG01' (version 1: this layout).
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import lmdb

from bookkeeper._ext.entrylog import encode_batch
from bookkeeper.bookie.files import fsync_dir

log = logging.getLogger(__name__)

LOG_MAGIC = b"BKELOG01"
_IDX_KEY = struct.Struct(">QQ")  # entry ids stored are >= 0
_IDX_VAL = struct.Struct(">IQI")  # log id, offset of the data, length (records: _ext/entrylog.pyx)
_LEDGER_VAL = struct.Struct(">20sBqq")  # master key, fenced, lac, last stored entry id
_MARK = struct.Struct(">QQ")
# What a write-cache entry costs beyond its payload: the (ledger, entry) key tuple, its two
# ints, the dict slot and the bytes header (measured with tracemalloc: ~173 B). Counted so
# that write_cache_max_bytes bounds memory, not just payload bytes.
ENTRY_OVERHEAD_BYTES = 170
_FLUSH_CHUNK_BYTES = 8 << 20  # entry-log bytes laid out per encode_batch: bounds the checkpoint's extra memory
LOG_MAX_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one checkpoint flushes: entries, ledger states and ledgers to delete."""

    entries: dict[tuple[int, int], bytes]
    states: dict[int, "LedgerState"]
    deletes: set[int]


@dataclass(slots=True)
class LedgerState:
    """What a shard knows of one ledger; made durable by the journal, then checkpoints."""

    master_key: bytes
    fenced: bool = False
    lac: int = -1
    last_entry: int = -1


class LedgerStorage:
    """Entries and ledger state of one shard (per shard; loop thread except flush)."""

    def __init__(self, directory: str | os.PathLike[str], *, map_size: int = 1 << 34) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.dir / "index.lmdb"), map_size=map_size, max_dbs=4,
                             subdir=True, sync=True, metasync=True, lock=True)
        self.db_index = self.env.open_db(b"index")
        self.db_ledgers = self.env.open_db(b"ledgers")
        self.db_meta = self.env.open_db(b"meta")
        self.ledgers: dict[int, LedgerState] = {}
        self.write_cache: dict[tuple[int, int], bytes] = {}
        self.write_cache_bytes = 0
        self._flushing: dict[tuple[int, int], bytes] = {}
        self._pending_deletes: set[int] = set()
        self._flush_lock = threading.Lock()
        self._readers: dict[int, int] = {}
        # What LMDB holds of each ledger's state: a checkpoint writes only states that differ.
        self._persisted: dict[int, tuple[bytes, bool, int, int]] = {}
        with self.env.begin(db=self.db_ledgers) as txn:
            for k, v in txn.cursor():
                key, fenced, lac, last = _LEDGER_VAL.unpack(v)
                lid = struct.unpack(">Q", k)[0]
                self.ledgers[lid] = LedgerState(key, bool(fenced), lac, last)
                self._persisted[lid] = (key, bool(fenced), lac, last)
        self._log_id = max((int(p.stem) for p in self.dir.glob("*.log")), default=0)
        self._log_fd = -1
        self._log_pos = 0
        self._open_next_log()

    # -- entry log ---------------------------------------------------------
    def _log_path(self, log_id: int) -> Path:
        return self.dir / f"{log_id:08d}.log"

    def _open_next_log(self) -> None:
        """A new entry log per start and per LOG_MAX_BYTES: never append after a torn tail."""
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        self._log_id += 1
        self._log_fd = os.open(self._log_path(self._log_id), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._log_fd, LOG_MAGIC)
        os.fsync(self._log_fd)
        fsync_dir(self.dir)  # the new file's name must survive a power loss too
        self._log_pos = len(LOG_MAGIC)

    def _reader_fd(self, log_id: int) -> int:
        fd = self._readers.get(log_id)
        if fd is None:
            fd = os.open(self._log_path(log_id), os.O_RDONLY)
            self._readers[log_id] = fd
        return fd

    # -- ledger state --------------------------------------------------------
    def ledger(self, ledger_id: int) -> LedgerState | None:
        return self.ledgers.get(ledger_id)

    def create_ledger(self, ledger_id: int, master_key: bytes) -> LedgerState:
        st = LedgerState(master_key)
        self.ledgers[ledger_id] = st
        return st

    # -- entries -------------------------------------------------------------
    def put_entry(self, ledger_id: int, entry_id: int, data: bytes, lac: int) -> None:
        """Stage an entry (the journal makes it durable); readable at once."""
        key = (ledger_id, entry_id)
        old = self.write_cache.get(key)
        if old is not None:
            self.write_cache_bytes -= len(old) + ENTRY_OVERHEAD_BYTES
        self.write_cache[key] = data
        self.write_cache_bytes += len(data) + ENTRY_OVERHEAD_BYTES
        st = self.ledgers.get(ledger_id)
        if st is not None:
            if lac > st.lac:
                st.lac = lac
            if entry_id > st.last_entry:
                st.last_entry = entry_id

    def get_entry(self, ledger_id: int, entry_id: int) -> bytes | None:
        key = (ledger_id, entry_id)
        data = self.write_cache.get(key)
        if data is None:
            data = self._flushing.get(key)
        if data is not None:
            return data
        with self.env.begin(db=self.db_index) as txn:
            v = txn.get(_IDX_KEY.pack(ledger_id, entry_id))
        if v is None:
            return None
        log_id, offset, length = _IDX_VAL.unpack(v)
        return os.pread(self._reader_fd(log_id), length, offset)

    def last_entry_id(self, ledger_id: int) -> int:
        """Highest entry id this shard stores for the ledger, or -1."""
        st = self.ledgers.get(ledger_id)
        return st.last_entry if st is not None else -1

    # -- checkpoint ------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Swap out the write cache for flushing (loop thread); reads still see it."""
        changed = {}
        for lid, st in self.ledgers.items():
            now = (st.master_key, st.fenced, st.lac, st.last_entry)
            if self._persisted.get(lid) != now:
                changed[lid] = LedgerState(*now)
        snap = Snapshot(self.write_cache, changed, self._pending_deletes)
        self._flushing = snap.entries
        self.write_cache = {}
        self.write_cache_bytes = 0
        self._pending_deletes = set()
        return snap

    def flush(self, snapshot: Snapshot, mark: tuple[int, int]) -> None:
        """Write a snapshot to the entry log, fsync, then commit index + state + deletions + mark
        in one LMDB transaction (worker thread)."""
        snap, states, deletes = snapshot.entries, snapshot.states, snapshot.deletes
        with self._flush_lock, self.env.begin(write=True) as txn:
            # The index goes into the transaction chunk by chunk, but it commits only after the
            # entry log's fdatasync: the index never points past durable entry-log bytes.
            if snap:
                if self._log_pos > LOG_MAX_BYTES:
                    self._open_next_log()
                cursor = txn.cursor(db=self.db_index)
                keys = sorted(snap)
                pos, start = self._log_pos, 0
                while start < len(keys):
                    records, index, pos, start = encode_batch(keys, start, snap, self._log_id, pos,
                                                              _FLUSH_CHUNK_BYTES)
                    view, off = memoryview(records), pos - len(records)
                    while view:
                        n = os.pwrite(self._log_fd, view, off)
                        view, off = view[n:], off + n
                    cursor.putmulti(index)
                os.fdatasync(self._log_fd)
                self._log_pos = pos
            for lid, st in states.items():
                txn.put(struct.pack(">Q", lid), _LEDGER_VAL.pack(st.master_key, int(st.fenced), st.lac,
                                                                 st.last_entry), db=self.db_ledgers)
            for lid in deletes:
                self._delete_in(txn, lid)
            txn.put(b"checkpoint_mark", _MARK.pack(*mark), db=self.db_meta)

    def flush_done(self, snapshot: Snapshot) -> None:
        """Drop the flushed snapshot (loop thread): its entries are now in the index."""
        self._flushing = {}
        for lid, st in snapshot.states.items():
            self._persisted[lid] = (st.master_key, st.fenced, st.lac, st.last_entry)
        for lid in snapshot.deletes:
            self._persisted.pop(lid, None)

    def flush_failed(self, snapshot: Snapshot) -> None:
        """Put a snapshot whose flush failed back (loop thread): its entries stay in memory and the
        journal is not trimmed, so the next checkpoint retries them."""
        for key, data in snapshot.entries.items():
            if key not in self.write_cache and key[0] in self.ledgers:
                self.write_cache[key] = data
                self.write_cache_bytes += len(data) + ENTRY_OVERHEAD_BYTES
        self._pending_deletes |= snapshot.deletes
        self._flushing = {}

    def checkpoint_mark(self) -> tuple[int, int]:
        with self.env.begin(db=self.db_meta) as txn:
            v = txn.get(b"checkpoint_mark")
        return _MARK.unpack(v) if v else (0, 0)

    # -- deletion ----------------------------------------------------------
    def delete_ledger(self, ledger_id: int) -> None:
        """Forget a ledger whose metadata is gone: at once in memory, on disk at the next checkpoint.

        Why through the checkpoint: the deletion commits in the same LMDB transaction that
        writes the index, so an in-flight flush can never write the ledger back.
        """
        self.ledgers.pop(ledger_id, None)
        for key in [k for k in self.write_cache if k[0] == ledger_id]:
            self.write_cache_bytes -= len(self.write_cache.pop(key)) + ENTRY_OVERHEAD_BYTES
        self._pending_deletes.add(ledger_id)

    def _delete_in(self, txn: lmdb.Transaction, ledger_id: int) -> None:
        txn.delete(struct.pack(">Q", ledger_id), db=self.db_ledgers)
        cur = txn.cursor(db=self.db_index)
        if cur.set_range(_IDX_KEY.pack(ledger_id, 0)):
            while cur.key() and _IDX_KEY.unpack(cur.key())[0] == ledger_id:
                if not cur.delete():
                    break

    def close(self) -> None:
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        self.env.close()
