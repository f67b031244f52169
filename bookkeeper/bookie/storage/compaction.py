"""Entry-log compaction of one shard (worker thread of its process): docs/compaction.md.

One log at a time, lowest live share first (empty logs first: they cost no copy):
  1. before_copy          read the log's records up to its committed size; a record is live
                          when the index still points at exactly that copy;
  2. after_copy           live records appended to the current entry log (rolling as usual)
                          in ~1 MiB batches, each under the flush lock so checkpoints interleave,
                          throttled to rate_bytes_s; then fdatasync;
  3. after_index_switch   one LMDB transaction: each index entry that still points at the old
                          copy now points at the new one; the target logs' records gain those
                          bytes; the old log's record goes;
  4. after_delete         the old file is unlinked and its directory fsynced.
A kill at any step loses nothing: before 3 the index points at the old log, which still
exists (copies past the current log's committed size are dead bytes, or a whole orphan
file the next open deletes); after 3 the old file has no record, so the next open deletes
it if 4 did not. Free space needed: the copies, at most one log's live bytes.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bookkeeper._ext.entrylog import RECORD_HEADER_BYTES
from bookkeeper.bookie.files import fsync_dir
from bookkeeper.bookie.storage.entrylog import (_IDX_KEY, _IDX_VAL, _LOG_KEY, FLUSH_SLICE_ENTRIES, LogInfo, read_records,
                                               sorted_entries)

if TYPE_CHECKING:
    from bookkeeper.bookie.storage.ledger_storage import LedgerStorage

log = logging.getLogger(__name__)

_COPY_BATCH_BYTES = 1 << 20  # held under the flush lock per batch: a checkpoint waits at most this long


@dataclass(slots=True)
class CompactionResult:
    """What one compaction pass did; `retired` are log ids whose readers the loop must close."""

    logs_compacted: int = 0
    logs_deleted: int = 0
    entries_copied: int = 0
    bytes_copied: int = 0
    bytes_reclaimed: int = 0
    duration_s: float = 0.0
    retired: list[int] = field(default_factory=list)


class Compactor:
    """One compaction pass over a LedgerStorage (see the module doc for the steps)."""

    def __init__(self, storage: LedgerStorage, *, rate_bytes_s: float = 0.0,
                 on_step: Callable[[str, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.st = storage
        self.rate = rate_bytes_s
        self.on_step = on_step or (lambda _step, _log_id: None)
        self.should_stop = should_stop or (lambda: False)
        self.result = CompactionResult()
        self._t0 = time.monotonic()

    def candidates(self, threshold: float) -> list[int]:
        """Closed logs under `threshold` live share: empty ones first, then least live first."""
        current = self.st._log_id
        ranked = []
        for log_id, (_path, size, live) in self.st.log_usage().items():
            if log_id >= current or size <= 0:
                continue
            share = live / size
            if share < threshold:
                ranked.append((live > 0, share, log_id))
        return [log_id for _nonempty, _share, log_id in sorted(ranked)]

    def run(self, threshold: float) -> CompactionResult:
        for log_id in self.candidates(threshold):
            if self.should_stop():
                break
            info = self.st.logs.get(log_id)
            if info is None:
                continue
            self.on_step("before_copy", log_id)
            copies = self._copy(log_id, info)
            if copies is None:
                break  # stopped mid-copy: what was copied is dead bytes, the index never moved
            self.on_step("after_copy", log_id)
            self._switch(log_id, copies)
            self.on_step("after_index_switch", log_id)
            freed = self._unlink(info.path)
            self.on_step("after_delete", log_id)
            self.result.retired.append(log_id)
            self.result.bytes_reclaimed += freed
            if copies:
                self.result.logs_compacted += 1
            else:
                self.result.logs_deleted += 1
        self.result.duration_s = round(time.monotonic() - self._t0, 3)
        return self.result

    def _copy(self, log_id: int, info: LogInfo) -> list[tuple[bytes, bytes, bytes, int, int]] | None:
        """Append the log's live records to the current log; fdatasync. Returns (key, old index
        value, new index value, target log, record bytes) per copy, or None when told to stop."""
        st = self.st
        copies: list[tuple[bytes, bytes, bytes, int, int]] = []
        batch: dict[tuple[int, int], bytes] = {}
        old: dict[bytes, bytes] = {}  # index key -> the value pointing at this log
        batch_bytes = 0
        with st.env.begin(db=st.db_index) as txn:
            for lid, eid, offset, data in read_records(info.path, info.size):
                key = _IDX_KEY.pack(lid, eid)
                here = _IDX_VAL.pack(log_id, offset, len(data))
                if txn.get(key) != here:
                    continue  # deleted ledger, or an older copy of a re-added entry
                batch[(lid, eid)] = data
                old[key] = here
                batch_bytes += len(data) + RECORD_HEADER_BYTES
                if batch_bytes >= _COPY_BATCH_BYTES:
                    copies += self._write(batch, old)
                    batch, old, batch_bytes = {}, {}, 0
                    if self.should_stop():
                        return None
        if batch:
            copies += self._write(batch, old)
        if copies:
            with st._flush_lock:
                os.fdatasync(st._log_fd)  # copies in logs a roll left behind were synced at the roll
        return copies

    def _write(self, batch: dict[tuple[int, int], bytes],
               old: dict[bytes, bytes]) -> list[tuple[bytes, bytes, bytes, int, int]]:
        st = self.st
        out = []
        entries = sorted_entries(batch)
        with st._flush_lock:
            while entries.remaining:
                if st._log_pos >= st.entry_log_max_bytes:
                    os.fdatasync(st._log_fd)
                    st._roll_if_full()
                records, index, _end, _per = entries.encode(st._log_id, st._log_pos, st._room(), FLUSH_SLICE_ENTRIES)
                st._append(records)
                for k, v in index:
                    out.append((k, old[k], v, st._log_id, _IDX_VAL.unpack(v)[2] + RECORD_HEADER_BYTES))
        copied = sum(c[4] for c in out)
        self.result.entries_copied += len(out)
        self.result.bytes_copied += copied
        self._throttle()
        return out

    def _throttle(self) -> None:
        """Sleep so that bytes copied since the pass began stay under rate_bytes_s."""
        if self.rate > 0:
            ahead = self._t0 + self.result.bytes_copied / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    def _switch(self, log_id: int, copies: list[tuple[bytes, bytes, bytes, int, int]]) -> None:
        """One transaction: index entries still at their old copy move to the new one; target
        logs' records gain the bytes that moved; the old log's record goes."""
        st = self.st
        with st._flush_lock:
            infos = self._switch_in(log_id, copies)
            st.logs.update(infos)
            st.logs.pop(log_id, None)
            st._paths.pop(log_id, None)  # a reader that looked up the old copy retries (get_entry)

    def _switch_in(self, log_id: int, copies: list[tuple[bytes, bytes, bytes, int, int]]) -> dict[int, LogInfo]:
        st = self.st
        with st.env.begin(write=True) as txn:
            gained: dict[int, dict[int, int]] = {}
            for key, was, now, target, nbytes in copies:
                if txn.get(key, db=st.db_index) != was:
                    continue  # deleted or re-added meanwhile: this copy is dead bytes
                txn.put(key, now, db=st.db_index)
                per = gained.setdefault(target, {})
                lid = _IDX_KEY.unpack(key)[0]
                per[lid] = per.get(lid, 0) + nbytes
            infos = {}
            for target, per in gained.items():
                base = st.logs.get(target) or LogInfo(st._paths[target], 0)
                end = st._log_pos if target == st._log_id else os.stat(base.path).st_size
                infos[target] = base.plus(per, max(base.size, end))
                txn.put(_LOG_KEY.pack(target), infos[target].encode(), db=st.db_logs)
            txn.delete(_LOG_KEY.pack(log_id), db=st.db_logs)
        return infos

    def _unlink(self, path: Path) -> int:
        try:
            size = os.stat(path).st_blocks * 512
            path.unlink()
        except FileNotFoundError:
            return 0
        fsync_dir(path.parent)
        return size
