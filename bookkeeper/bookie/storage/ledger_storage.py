"""Ledger storage of one shard: write cache -> entry log files + LMDB index.

Lives in: one shard process, used from its event loop thread, except `flush` and
`compact`, which run in worker threads (a checkpoint flushes a swapped-out snapshot of
the write cache, so adds never wait for the entry log's fsync; compaction copies live
entries without holding the loop).

Why this shape (Apache BookKeeper's DbLedgerStorage): the journal makes an entry
durable with one sequential write; storage re-writes entries, grouped, to an
append-only entry log, and an index maps (ledger, entry) -> (log, offset, length).
LMDB holds the index and the durable per-ledger state (master key, fenced flag,
LAC), the checkpoint mark (the journal position up to which everything is in the
entry log and index) and one record per entry log: its committed size and the bytes
each ledger has in it (what compaction needs to know a log's live share without
reading it; Apache's EntryLogMetadata, kept in the index instead of a log trailer).
The mark, the index and the log records commit in one LMDB transaction, after the
entry log is fsynced: "index, records and mark never point past durable entry-log
bytes". Why LMDB: docs/index-store.md. Compaction: docs/compaction.md.

What a checkpoint costs is what changed (issue 26): the states it writes are those of the
ledgers created, handed out (`ledger()`: the server fences them, raises their LAC) or added
to since the last one (an add raises lac and last_entry: put_entry puts the ledger in the
dirty set, the C add path does once per checkpoint, `LedgerState.in_dirty`), each compared
with what LMDB holds; not a walk of every ledger held, nor of the entries cached.
`Snapshot.examined` says how many it compared. What LMDB
holds of a ledger is remembered on its LedgerState (`mark_saved`, set when a checkpoint that
wrote it is done), so a ledger deleted and made again is written whatever its deleted
incarnation's row held.

What a stored ledger costs in memory (issue 26; tests/test_gc_scale.py measures ~167 B):
its LedgerState (64 B, not tracked by the cyclic GC), its entry in `ledgers` and its id,
2 bytes in its bucket's sorted suffixes (HeldBucket), 16 bytes per entry log holding some
of it (LogInfo's packed pairs); master keys are shared among ledgers of one password.

Deleting a ledger (delete_ledger, for GC) costs the ledger alone: its state goes at once;
its entries still in the write cache stay there, counted in write_cache_bytes (they hold
that memory), until the next snapshot, whose flush skips them (`Snapshot.dropped`). On disk,
the flush of the first snapshot taken after the delete, under the flush lock, deletes its
index entries in transactions of at most SWEEP_KEYS_PER_TXN keys, and then its state row
(and writes its tombstone) in the checkpoint's one transaction, with the mark. Why no
flush ever writes a deleted ledger back: checkpoints run one at a time and flush their
snapshots in the order taken, so every snapshot that may hold the ledger's entries (taken
before the delete) has committed, or failed, before the one carrying the deletion
flushes; a failed one's entries of a ledger deleted since are not put back
(flush_failed); and no later snapshot holds any (dropped; a ledger made again after its
delete loses its old cached entries then). Compaction moves only index entries that still
point at their old copy, so it cannot bring swept ones back. Why the index entries go in
their own transactions, before the checkpoint's: a GC pass may delete millions of keys,
and LMDB holds every page a transaction dirties until it commits. A crash between the two
leaves the ledger's row, so the ledger is held again at the next open with part of its
index gone; its metadata is gone, so nobody reads it, and the next GC pass deletes it again.

Entry logs roll at `entry_log_max_bytes`; a new log goes to the ledger dir with the
most free space among those under the read-only threshold. A log file with no record
is one no index entry points into (a crash before its first commit, or after
compaction committed its removal): it is deleted when the storage opens.

Entry log record (big-endian): u32 length | u64 ledger_id | i64 entry_id | data.
Entry log file header: 8 bytes magic 'BKELOG01' (version 1: this layout).
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from bookkeeper._ext.entrylog import RECORD_HEADER_BYTES
from bookkeeper._ext.shardpath import LedgerState
from bookkeeper.bookie.files import fsync_dir
from bookkeeper.bookie.storage.compaction import CompactionResult, Compactor
from bookkeeper.bookie.storage.entrylog import (_IDX_KEY, _IDX_VAL, _LOG_KEY, FLUSH_SLICE_ENTRIES, LOG_MAGIC, LogInfo,
                                               sorted_entries)
from bookkeeper.meta.zk import BUCKET_SPAN

log = logging.getLogger(__name__)

_LEDGER_VAL = struct.Struct(">20sBqq")  # master key, fenced, lac, last stored entry id
_LEDGER_KEY = struct.Struct(">Q")  # ledger rows, tombstones, and the first 8 bytes of a ledger's index keys
_MARK = struct.Struct(">QQ")
# What a write-cache entry costs beyond its payload: the (ledger, entry) key tuple, its two
# ints, the dict slot and the bytes header (measured with tracemalloc: ~173 B). Counted so
# that write_cache_max_bytes bounds memory, not just payload bytes.
ENTRY_OVERHEAD_BYTES = 170
_FLUSH_CHUNK_BYTES = 8 << 20  # entry-log bytes laid out per encode at most: bounds the checkpoint's extra memory

LOG_MAX_BYTES = 1 << 30
_LOGS_FORMAT = b"logs_format"  # meta key: the per-log records exist (set once, by creation or migration)
# Distinct master keys a shard keeps one copy of (LedgerStorage._shared_key), for its life: a
# key stays after its ledgers are deleted (at most 4096 x ~100 B); past that, keys are not shared.
MASTER_KEYS_SHARED = 4096
SWEEP_KEYS_PER_TXN = 10_000  # index keys of deleted ledgers deleted per LMDB transaction (~1 MiB of dirty pages)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one checkpoint flushes: entries, ledger states and ledgers to delete.

    `dropped`: ledgers deleted after their entries were cached; the flush skips those entries.
    `examined`: ledgers whose state this snapshot compared with LMDB's (what finding the changes cost).
    """

    entries: dict[tuple[int, int], bytes]
    states: dict[int, "LedgerState"]
    deletes: set[int]
    dropped: set[int] = field(default_factory=set)
    examined: int = 0
    live: dict[int, "LedgerState"] = field(default_factory=dict)  # the state objects `states` copied

    def release(self) -> None:
        """Free the flushed entries an entry at a time (worker thread, after flush_done). Why:
        the last reference to a full cache's dict dropped on the loop freed ~250,000 keys and
        payloads in one C call, ~9 ms of the loop's time; a Python loop here gives the GIL
        back to the loop between entries."""
        pop = self.entries.popitem
        for _ in range(len(self.entries)):
            pop()


@dataclass(slots=True)
class HeldBucket:
    """The ledgers a shard holds in one metadata bucket (ids with one `lid // BUCKET_SPAN`:
    their znodes share a parent, meta/zk.py), as 4-digit suffixes (`lid % BUCKET_SPAN`),
    sorted, 2 bytes each (a set of ints cost ~85 bytes a ledger). `created` is the storage's
    serial of the last ledger made in it (serials never repeat), so a GC pass knows whether
    the bucket gained a ledger since it last compared it."""

    suffixes: array[int]
    created: int

    def add(self, suffix: int) -> None:
        """Ids come mostly in order: an append, else a move of at most 20 KB."""
        at = bisect_left(self.suffixes, suffix)
        if at == len(self.suffixes) or self.suffixes[at] != suffix:
            self.suffixes.insert(at, suffix)

    def discard(self, suffix: int) -> None:
        at = bisect_left(self.suffixes, suffix)
        if at < len(self.suffixes) and self.suffixes[at] == suffix:
            del self.suffixes[at]


class LedgerStorage:
    """Entries and ledger state of one shard (per shard; loop thread except flush and compact)."""

    def __init__(self, directory: str | os.PathLike[str], *, log_dirs: Iterable[str | os.PathLike[str]] = (),
                 entry_log_max_bytes: int = LOG_MAX_BYTES, dir_writable: Callable[[Path], bool] | None = None,
                 map_size: int = 1 << 34) -> None:
        """`directory` holds the index; entry logs go to `log_dirs` (default: `directory` alone).
        `dir_writable(path)` says whether a new log may go to a dir (the disk threshold)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_dirs = [Path(d) for d in log_dirs] or [self.dir]
        for d in self.log_dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.entry_log_max_bytes = entry_log_max_bytes
        self._dir_writable = dir_writable or (lambda _path: True)
        self.env = lmdb.open(str(self.dir / "index.lmdb"), map_size=map_size, max_dbs=8,
                             subdir=True, sync=True, metasync=True, lock=True)
        self.db_index = self.env.open_db(b"index")
        self.db_ledgers = self.env.open_db(b"ledgers")
        self.db_meta = self.env.open_db(b"meta")
        self.db_logs = self.env.open_db(b"logs")
        self.db_tombstones = self.env.open_db(b"tombstones")
        self.ledgers: dict[int, LedgerState] = {}
        # Ledgers fenced here and then deleted -> when (wall clock): an add to one is refused as
        # fenced, not taken as a new ledger (delete_ledger says why). Committed with the deletion.
        self.tombstones: dict[int, float] = {}
        self.write_cache: dict[tuple[int, int], bytes] = {}
        self.write_cache_bytes = 0
        self._flushing: dict[tuple[int, int], bytes] = {}
        self._pending_deletes: set[int] = set()
        self._dropped: set[int] = set()  # deleted since the last snapshot: their cached entries are skipped
        self._dirty: set[int] = set()  # created or handed out since the last snapshot (see the module doc)
        self.buckets: dict[int, HeldBucket] = {}  # lid // BUCKET_SPAN -> the ledgers held there (for GC)
        self._created = 0  # the serial of the last ledger made or loaded
        self._flush_lock = threading.Lock()  # one writer of the current log and of LMDB at a time
        self._readers: dict[int, int] = {}
        # One bytes object per distinct master key (ledgers of one password share it), up to
        # MASTER_KEYS_SHARED of them: 53 bytes a ledger otherwise, each key arriving anew.
        self._keys: dict[bytes, bytes] = {}
        with self.env.begin(db=self.db_ledgers) as txn:
            for k, v in txn.cursor():
                key, fenced, lac, last = _LEDGER_VAL.unpack(v)
                lid = _LEDGER_KEY.unpack(k)[0]
                st = self.ledgers[lid] = LedgerState(self._shared_key(key), bool(fenced), lac, last)
                st.mark_saved(bool(fenced), lac, last)  # what LMDB holds: a checkpoint writes only changes
                self._hold(lid)
        with self.env.begin(db=self.db_tombstones) as txn:
            made = sorted((struct.unpack(">d", v)[0], _LEDGER_KEY.unpack(k)[0]) for k, v in txn.cursor())
        self.tombstones.update((lid, at) for at, lid in made)  # oldest first: prune_tombstones stops early
        self.logs: dict[int, LogInfo] = {}
        self._paths: dict[int, Path] = {}  # every log an index entry may point into, set before it may
        files = self._log_files()
        self._load_log_records(files)
        self._log_id = max([*files, *self.logs], default=0)
        self._log_fd = -1
        self._log_pos = 0
        self._open_next_log()

    # -- entry logs ----------------------------------------------------------
    def _log_files(self) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for d in self.log_dirs:
            for p in d.glob("*.log"):
                if p.stem.isdigit():
                    found[int(p.stem)] = p
        return found

    def _load_log_records(self, files: dict[int, Path]) -> None:
        """Load every log's record (building them from the index once, for a store made before
        records existed), and delete log files no record names: no index entry points into them."""
        with self.env.begin(db=self.db_meta) as txn:
            migrated = txn.get(_LOGS_FORMAT) is not None
        if not migrated:
            self._migrate(files)
        with self.env.begin(db=self.db_logs) as txn:
            for k, v in txn.cursor():
                log_id = _LOG_KEY.unpack(k)[0]
                path = files.get(log_id)
                if path is None:
                    log.error("entry log %d has a record but no file in %s: its entries are lost", log_id,
                              [str(d) for d in self.log_dirs])
                    path = self.log_dirs[0] / f"{log_id:08d}.log"
                self.logs[log_id] = LogInfo.decode(path, v)
                self._paths[log_id] = path
        orphans = [p for log_id, p in files.items() if log_id not in self.logs]
        for p in orphans:
            log.info("deleting entry log %s: no index entry points into it", p)
            p.unlink()
        for d in {p.parent for p in orphans}:
            fsync_dir(d)

    def _migrate(self, files: dict[int, Path]) -> None:
        sizes: dict[int, dict[int, int]] = {}
        with self.env.begin(write=True) as txn:
            for k, v in txn.cursor(db=self.db_index):
                lid = _IDX_KEY.unpack(k)[0]
                log_id, _off, length = _IDX_VAL.unpack(v)
                per = sizes.setdefault(log_id, {})
                per[lid] = per.get(lid, 0) + length + RECORD_HEADER_BYTES
            for log_id, per in sizes.items():
                path = files.get(log_id, self.log_dirs[0] / f"{log_id:08d}.log")
                size = path.stat().st_size if path.exists() else 0
                txn.put(_LOG_KEY.pack(log_id), LogInfo.of(path, size, per).encode(), db=self.db_logs)
            txn.put(_LOGS_FORMAT, b"1", db=self.db_meta)
        if sizes:
            log.info("built records of %d entry log(s) from the index (one-time migration)", len(sizes))

    def _pick_dir(self) -> Path:
        """The ledger dir with the most free space, among those a new log may go to (all of them
        when none may: a checkpoint must still be able to write what the journal holds). Dirs on
        one filesystem tie: the one holding fewer of this shard's logs wins, so all are used."""
        held = {d: 0 for d in self.log_dirs}
        for p in list(self._paths.values()):
            if p.parent in held:
                held[p.parent] += 1

        def rank(d: Path) -> tuple[int, int]:
            st = os.statvfs(d)
            return st.f_bavail * st.f_frsize, -held[d]
        ok = [d for d in self.log_dirs if self._dir_writable(d)] or self.log_dirs
        return max(ok, key=rank)

    def _open_next_log(self) -> None:
        """A new entry log per start and per entry_log_max_bytes: never append after a torn tail.
        The previous log was fdatasynced by the flush or compaction that wrote to it."""
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        self._log_id += 1
        d = self._pick_dir()
        path = d / f"{self._log_id:08d}.log"
        self._log_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._log_fd, LOG_MAGIC)
        os.fsync(self._log_fd)
        fsync_dir(d)  # the new file's name must survive a power loss too
        self._log_pos = len(LOG_MAGIC)
        self._log_path = path
        self._paths[self._log_id] = path

    def _append(self, records: bytes | memoryview) -> int:
        """Write records at the current log's end (flush lock held); returns their offset."""
        view, off = memoryview(records), self._log_pos
        start = off
        while view:
            n = os.pwrite(self._log_fd, view, off)
            view, off = view[n:], off + n
        self._log_pos = off
        return start

    def _reader_fd(self, log_id: int) -> int:
        fd = self._readers.get(log_id)
        if fd is None:
            path = self._paths.get(log_id)
            if path is None:
                raise FileNotFoundError(f"entry log {log_id} is gone")
            fd = os.open(path, os.O_RDONLY)
            self._readers[log_id] = fd
        return fd

    def release_logs(self, log_ids: Iterable[int]) -> None:
        """Close cached readers of deleted logs (loop thread), so their space is freed."""
        for log_id in log_ids:
            fd = self._readers.pop(log_id, None)
            if fd is not None:
                os.close(fd)

    def log_usage(self) -> dict[int, tuple[str, int, int]]:
        """log id -> (path, size, live bytes): live counts the ledgers this shard still holds."""
        ledgers = self.ledgers
        out = {}
        for log_id, info in list(self.logs.items()):
            out[log_id] = (str(info.path), info.size, info.live_bytes(ledgers))
        return out

    # -- ledger state --------------------------------------------------------
    def ledger(self, ledger_id: int) -> LedgerState | None:
        """The ledger's state, or None. Its holder may change it (the server fences it, raises
        its LAC), so a ledger handed out is one the next checkpoint compares."""
        st = self.ledgers.get(ledger_id)
        if st is not None:
            self._dirty.add(ledger_id)
        return st

    def _shared_key(self, master_key: bytes) -> bytes:
        shared = self._keys.get(master_key)
        if shared is None:
            if len(self._keys) >= MASTER_KEYS_SHARED:
                return master_key
            shared = self._keys[master_key] = master_key
        return shared

    def create_ledger(self, ledger_id: int, master_key: bytes) -> LedgerState:
        if ledger_id in self._dropped:
            self._purge_cached(ledger_id)
        st = LedgerState(self._shared_key(master_key))
        self.ledgers[ledger_id] = st
        self._dirty.add(ledger_id)
        self._hold(ledger_id)
        return st

    def _hold(self, ledger_id: int) -> None:
        bucket, suffix = divmod(ledger_id, BUCKET_SPAN)
        self._created += 1
        held = self.buckets.get(bucket)
        if held is None:
            self.buckets[bucket] = HeldBucket(array("H", (suffix,)), self._created)
        else:
            held.add(suffix)
            held.created = self._created

    def _release(self, ledger_id: int) -> None:
        bucket, suffix = divmod(ledger_id, BUCKET_SPAN)
        held = self.buckets[bucket]
        held.discard(suffix)
        if not held.suffixes:
            del self.buckets[bucket]

    def _purge_cached(self, ledger_id: int) -> None:
        """Drop a deleted ledger's cached entries before it is made again (an add of a zombie
        writer): its new entries must not inherit them. A walk of the write cache, on this
        rare path only."""
        self._dropped.discard(ledger_id)
        for key in [k for k in self.write_cache if k[0] == ledger_id]:
            self.write_cache_bytes -= len(self.write_cache.pop(key)) + ENTRY_OVERHEAD_BYTES

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
            self._dirty.add(ledger_id)

    def get_entry(self, ledger_id: int, entry_id: int) -> bytes | None:
        key = (ledger_id, entry_id)
        data = self.write_cache.get(key)
        if data is None:
            data = self._flushing.get(key)
        if data is not None:
            return data
        for attempt in (0, 1):
            with self.env.begin(db=self.db_index) as txn:
                v = txn.get(_IDX_KEY.pack(ledger_id, entry_id))
            if v is None:
                return None
            log_id, offset, length = _IDX_VAL.unpack(v)
            try:
                return os.pread(self._reader_fd(log_id), length, offset)
            except FileNotFoundError:
                if attempt:
                    raise
                # Compaction moved the entry and deleted its old log between the lookup and the
                # open: the index now points at the copy.
        return None

    def last_entry_id(self, ledger_id: int) -> int:
        """Highest entry id this shard stores for the ledger, or -1."""
        st = self.ledgers.get(ledger_id)
        return st.last_entry if st is not None else -1

    # -- checkpoint ------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Swap out the write cache for flushing (loop thread); reads still see it. The states
        taken are those of the ledgers that may have changed (module doc): one comparison per
        ledger in the dirty set, whatever the ledgers held or the entries cached (the add path
        puts a ledger there once per checkpoint: `LedgerState.in_dirty`)."""
        cache, candidates, ledgers = self.write_cache, self._dirty, self.ledgers
        changed, live = {}, {}
        for lid in candidates:
            st = ledgers.get(lid)
            if st is not None:
                st.in_dirty = False
                if st.unsaved():
                    changed[lid] = LedgerState(st.master_key, st.fenced, st.lac, st.last_entry)
                    live[lid] = st
        snap = Snapshot(cache, changed, self._pending_deletes, self._dropped, len(candidates), live)
        self._flushing = cache
        self.write_cache = {}
        self.write_cache_bytes = 0
        self._pending_deletes = set()
        self._dropped = set()
        self._dirty = set()
        return snap

    def _roll_if_full(self) -> bool:
        """Roll to a new log once the current one reached its size (flush lock held, its bytes
        fdatasynced by the caller). True when it rolled."""
        if self._log_pos < self.entry_log_max_bytes:
            return False
        self._open_next_log()
        return True

    def _room(self) -> int:
        return max(1, self.entry_log_max_bytes - self._log_pos)

    def flush(self, snapshot: Snapshot, mark: tuple[int, int]) -> None:
        """Delete the index entries of the snapshot's deleted ledgers (bounded transactions), write
        its entries to the entry log(s), fsync, then commit index + log records + state +
        deletions + mark in one LMDB transaction (worker thread). Order: the module doc."""
        with self._flush_lock:
            self.sweep_index(snapshot.deletes)
            infos = self._flush_in(snapshot, mark)
            self.logs.update(infos)  # committed: compaction and stats may count these bytes now

    def sweep_index(self, ledger_ids: Iterable[int]) -> int:
        """Delete every index entry of these ledgers, at most SWEEP_KEYS_PER_TXN per LMDB
        transaction (flush lock held); returns how many. A ledger's keys are one range (its id
        is their first 8 bytes)."""
        todo = sorted(ledger_ids)
        swept = i = 0
        while i < len(todo):
            budget = SWEEP_KEYS_PER_TXN
            with self.env.begin(write=True, db=self.db_index) as txn:
                cur = txn.cursor()
                while i < len(todo) and budget:
                    prefix = _LEDGER_KEY.pack(todo[i])
                    if cur.set_range(prefix):
                        while budget and cur.key()[:8] == prefix:
                            cur.delete()  # and on to the next key (b"" past the last)
                            budget -= 1
                    if cur.key()[:8] != prefix:
                        i += 1  # else: the ledger has more keys, for the next transaction
            swept += SWEEP_KEYS_PER_TXN - budget
        return swept

    def _flush_in(self, snapshot: Snapshot, mark: tuple[int, int]) -> dict[int, LogInfo]:
        """flush's transaction (flush lock held); returns the records it committed. Its GIL-held
        steps are short (SortedEntries: module ext/bookkeeper/_ext/entrylog.pyx says why): the
        shard's loop waits for each one it meets."""
        with self.env.begin(write=True) as txn:
            for lid in snapshot.deletes:  # first: a ledger deleted and made again gets its new state below
                self._delete_in(txn, lid)
            # The index goes into the transaction chunk by chunk, but it commits only after the
            # entry logs' fdatasync: the index never points past durable entry-log bytes.
            batch = sorted_entries(snapshot.entries, snapshot.dropped)
            infos = {}
            if batch.remaining:
                written: dict[int, tuple[Path, dict[int, int], int]] = {}
                cursor = txn.cursor(db=self.db_index)
                while batch.remaining:
                    if self._log_pos >= self.entry_log_max_bytes:
                        os.fdatasync(self._log_fd)
                        self._roll_if_full()
                    records, index, _end, chunk = batch.encode(self._log_id, self._log_pos,
                                                               min(_FLUSH_CHUNK_BYTES, self._room()), FLUSH_SLICE_ENTRIES)
                    self._append(records)
                    cursor.putmulti(index)
                    _path, per, _size = written.get(self._log_id, (self._log_path, {}, 0))
                    for lid, nbytes in chunk.items():
                        per[lid] = per.get(lid, 0) + nbytes
                    written[self._log_id] = (self._log_path, per, self._log_pos)
                os.fdatasync(self._log_fd)
                infos = self._merge_written(written)
                for log_id, info in infos.items():
                    txn.put(_LOG_KEY.pack(log_id), info.encode(), db=self.db_logs)
            for lid, st in snapshot.states.items():
                txn.put(_LEDGER_KEY.pack(lid), _LEDGER_VAL.pack(st.master_key, int(st.fenced), st.lac,
                                                                st.last_entry), db=self.db_ledgers)
            txn.put(b"checkpoint_mark", _MARK.pack(*mark), db=self.db_meta)
        return infos

    def _merge_written(self, written: dict[int, tuple[Path, dict[int, int], int]]) -> dict[int, LogInfo]:
        out = {}
        for log_id, (path, per, size) in written.items():
            base = self.logs.get(log_id) or LogInfo(path, 0)
            out[log_id] = base.plus(per, size)
        return out

    def flush_done(self, snapshot: Snapshot) -> None:
        """Drop the flushed snapshot (loop thread): its entries are now in the index."""
        self._flushing = {}
        for lid, st in snapshot.states.items():  # on the incarnation copied: one made again since is not marked
            snapshot.live[lid].mark_saved(st.fenced, st.lac, st.last_entry)

    def flush_failed(self, snapshot: Snapshot) -> None:
        """Put a snapshot whose flush failed back (loop thread): its entries stay in memory and the
        journal is not trimmed, so the next checkpoint retries them, with its deletions and its
        states (their ledgers compared again). Entries of ledgers deleted before it (dropped) or
        since (pending deletes now: even if made again since) are not put back."""
        ledgers, dropped, deleted_since = self.ledgers, snapshot.dropped, self._pending_deletes
        for key, data in snapshot.entries.items():
            lid = key[0]
            if key not in self.write_cache and lid in ledgers and lid not in dropped and lid not in deleted_since:
                self.write_cache[key] = data
                self.write_cache_bytes += len(data) + ENTRY_OVERHEAD_BYTES
        self._pending_deletes |= snapshot.deletes
        self._dirty.update(snapshot.states)
        self._flushing = {}

    def checkpoint_mark(self) -> tuple[int, int]:
        with self.env.begin(db=self.db_meta) as txn:
            v = txn.get(b"checkpoint_mark")
        return _MARK.unpack(v) if v else (0, 0)

    # -- deletion ----------------------------------------------------------
    def delete_ledger(self, ledger_id: int, *, now: float) -> None:
        """Forget a ledger whose metadata is gone: at once in memory, on disk at the next checkpoint.

        Why through the checkpoint, and why its cached entries are skipped there rather than
        looked for now (a walk of the whole write cache per ledger): the module doc.

        A ledger fenced here leaves a tombstone (now: the wall clock): it was fenced because
        another client took it over, so a writer still adding to it is a zombie, and an add of
        it must stay refused rather than make the ledger again, which would acknowledge
        entries of a deleted ledger (apache/bookkeeper#4462: Pulsar lost messages so, when a
        new owner deleted the last, empty ledger of a topic its old owner still wrote to;
        the stream takeover here does the same). Apache keeps these in memory for a week;
        here they survive a restart too (prune_tombstones ends them).
        """
        st = self.ledgers.pop(ledger_id, None)
        if st is not None:
            self._release(ledger_id)
            self._dropped.add(ledger_id)
            self._dirty.discard(ledger_id)
            if st.fenced:
                self.tombstones.pop(ledger_id, None)  # re-added at the end: the dict stays oldest first
                self.tombstones[ledger_id] = now
        self._pending_deletes.add(ledger_id)

    def prune_tombstones(self, before: float) -> int:
        """Forget tombstones made before `before` (wall clock), on disk at the next checkpoint.
        They are kept oldest first, so this stops at the first younger one: a pass costs the
        tombstones it ends, not all of them (a wall clock stepped back may keep an old one
        behind a younger one for a while; none ends early)."""
        old = []
        for lid, at in self.tombstones.items():
            if at >= before:
                break
            old.append(lid)
        for lid in old:
            del self.tombstones[lid]
            self._pending_deletes.add(lid)
        return len(old)

    def _delete_in(self, txn: lmdb.Transaction, ledger_id: int) -> None:
        """A deleted ledger's row, and its tombstone written or removed (its index: sweep_index)."""
        key = _LEDGER_KEY.pack(ledger_id)
        txn.delete(key, db=self.db_ledgers)
        at = self.tombstones.get(ledger_id)
        if at is None:
            txn.delete(key, db=self.db_tombstones)
        else:
            txn.put(key, struct.pack(">d", at), db=self.db_tombstones)

    # -- compaction ----------------------------------------------------------
    def compact(self, threshold: float, *, rate_bytes_s: float = 0.0,
                on_step: Callable[[str, int], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> CompactionResult:
        """Rewrite or delete every closed entry log whose live share is under `threshold`
        (worker thread). See compaction.py for the steps and why each is crash-safe."""
        return Compactor(self, rate_bytes_s=rate_bytes_s, on_step=on_step, should_stop=should_stop).run(threshold)

    def close(self) -> None:
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        self.env.close()

