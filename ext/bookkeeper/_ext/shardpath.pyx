# cython: language_level=3, boundscheck=False, wraparound=False
"""The shard's add path: every ADD frame of a receive buffer handled in one C loop.

Why Cython: per entry, the Python path built a 9-tuple per frame, made a dispatch call,
checked ownership, key, fence and entry header in Python, staged the entry, appended the
journal record through a method call, and built a response tuple and a journal item per
add, then grouped and encoded the responses once durable: ~5 us of the shard's ~8 us
per add over the network. Here an add that passes every check costs the two objects the
write cache keeps (its (ledger, entry) key and its payload bytes), a copy into the journal
batch, and its 40-byte response, encoded at once at the end of the connection's `pending`
bytes. One journal item per run of such adds ((conn, None, arrival, count, nbytes, record bytes))
tells the durable callback how many of those bytes to write: one write per connection
per block, no Python per entry.

Every other frame, and every add that does not pass (ledger unknown to this shard, key
mismatch, fenced without RECOVERY_ADD, read-only, a bad entry header, a connection whose
principal lacks the add's role), goes to the Python dispatch as the tuple parse_requests makes, in arrival order: the Python path
defines the behaviour on bad input, and this loop only takes the adds whose answer is OK.
"""

cimport cython
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.ref cimport PyObject
from bookkeeper._ext.endian cimport get_u32, get_u64, put_u16, put_u32, put_u64
from bookkeeper._ext.frame cimport REQ_HEADER, RESP_HEADER, KEY_LEN, FRAME_INCOMPLETE, frame_len, frame_error
from bookkeeper._ext.journal cimport JournalBatch
from bookkeeper._ext.journal import BLOCK_HEADER_BYTES

from bookkeeper._ext.wire import FrameError
from bookkeeper.proto import Status

# The wire's status codes have one definition, bookkeeper.proto.Status: taken from it here.
cdef uint16_t STATUS_SERVER_ERROR = Status.SERVER_ERROR

cdef extern from "Python.h":
    PyObject* PyDict_GetItem(object d, object key)  # borrowed, NULL if absent (no exception)
    void PyObject_GC_UnTrack(object op)

cdef enum:
    OP_ADD = 1
    FLAG_RECOVERY_ADD = 1
    ROLE_WRITE = 1    # bookkeeper.bookie.trust.ADD_WRITE: the connection's `add_roles` bits
    ROLE_RECOVER = 2  # bookkeeper.bookie.trust.ADD_RECOVER
    ENTRY_HEADER = 32
    REC_ADD = 1


cdef inline bint keys_equal(const char* a, const char* b, Py_ssize_t n) noexcept nogil:
    """Compare two master keys in time that does not depend on where they differ (memcmp
    stops at the first difference, which tells a prober how much of a key it guessed)."""
    cdef unsigned char diff = 0
    cdef Py_ssize_t i
    for i in range(n):
        diff |= <unsigned char>(a[i] ^ b[i])
    return diff == 0


@cython.no_gc  # its one object field is bytes: it can be in no reference cycle, so the cyclic GC need not track it
cdef class LedgerState:
    """What a shard knows of one ledger; made durable by the journal, then checkpoints.
    A C struct behind attributes, so the add loop reads and raises lac and last_entry
    without attribute lookups.

    It also remembers what the index (LMDB) holds of it, as of the last checkpoint that wrote
    it (`mark_saved`): a checkpoint writes a state only if `unsaved()`. Why here and not a
    map beside it: a dict entry and a tuple per ledger were 124 of the ~450 bytes a stored
    ledger cost a shard; and the mark belongs to this incarnation of the ledger, so one
    deleted and made again is written whatever the deleted one's row held."""

    cdef public int64_t lac
    cdef public int64_t last_entry
    cdef int64_t _saved_lac
    cdef int64_t _saved_last
    cdef public bytes master_key
    cdef public bint fenced
    cdef unsigned char _saved
    cdef unsigned char _saved_fenced
    # Whether the ledger is in its storage's dirty set (`LedgerStorage._dirty`, which the next
    # checkpoint compares): the add loop adds it once per checkpoint, not per add, and the
    # snapshot clears it. Set means in the set; clear means nothing.
    cdef public unsigned char in_dirty

    def __init__(self, bytes master_key not None, bint fenced=False, int64_t lac=-1, int64_t last_entry=-1):
        self.master_key = master_key
        self.fenced = fenced
        self.lac = lac
        self.last_entry = last_entry
        self._saved = False

    def mark_saved(self, bint fenced, int64_t lac, int64_t last_entry) -> None:
        """The index now holds this ledger with these values (its key never changes)."""
        self._saved = True
        self._saved_fenced = fenced
        self._saved_lac = lac
        self._saved_last = last_entry

    def unsaved(self) -> bool:
        """Whether the index lacks this state as it is now."""
        return (not self._saved or self._saved_fenced != self.fenced or self._saved_lac != self.lac
                or self._saved_last != self.last_entry)

    def __repr__(self) -> str:
        # The master key opens the ledger's entries to whoever holds it: a repr lands in logs.
        return (f"LedgerState(master_key=<{len(self.master_key)} bytes>, fenced={self.fenced}, lac={self.lac}, "
                f"last_entry={self.last_entry})")


cdef tuple _request_tuple(const uint8_t* p, Py_ssize_t flen):
    """The frame as parse_requests returns it:
    (op, flags, request_id, ledger_id, entry_id, master_key, aux, payload, blob_lac)."""
    cdef Py_ssize_t plen = flen - REQ_HEADER
    cdef int64_t blob_lac = <int64_t>get_u64(p + REQ_HEADER + 16) if plen >= ENTRY_HEADER else -1
    return (p[5], (p[6] << 8) | p[7], get_u64(p + 8), get_u64(p + 16), <int64_t>get_u64(p + 24),
            PyBytes_FromStringAndSize(<const char*>(p + 32), KEY_LEN), get_u32(p + 52),
            PyBytes_FromStringAndSize(<const char*>(p + REQ_HEADER), plen), blob_lac)


cdef class AddPath:
    """The receive-buffer loop of one shard (loop thread only).

    server: the ShardServer (its dispatch takes every frame this loop does not, and its
    readonly flag, journal, long-poll waiters and counters are read per buffer);
    storage: the LedgerStorage (ledgers, write_cache, write_cache_bytes)."""

    cdef object server
    cdef object storage
    cdef Py_ssize_t max_frame
    cdef Py_ssize_t overhead
    # State read from the server per buffer, and again after every Python dispatch (which
    # may flush or fail the journal, or swap nothing else).
    cdef bint fast
    cdef object journal
    cdef JournalBatch batch
    cdef Py_ssize_t slice_used  # the batch's used bytes at which the journal seals it (Journal.slice_at)
    cdef dict ledgers
    cdef dict cache
    cdef set dirty
    cdef dict waiters
    cdef set to_wake
    # The run of fast adds not yet handed to the journal as an item.
    cdef Py_ssize_t run_n
    cdef Py_ssize_t run_bytes
    cdef Py_ssize_t run_used  # the batch's used bytes when the run began: its records' bytes at the end
    cdef bint run_started_batch
    cdef Py_ssize_t cache_delta

    def __init__(self, server, storage, Py_ssize_t max_frame, Py_ssize_t entry_overhead_bytes):
        self.server = server
        self.storage = storage
        self.max_frame = max_frame
        self.overhead = entry_overhead_bytes

    cdef int _load(self) except -1:
        server = self.server
        journal = server.journal
        self.journal = journal
        self.fast = (journal is not None and not server.readonly and journal._failed is None)
        if self.fast:
            self.batch = <JournalBatch?>journal._batch
            self.slice_used = <Py_ssize_t>journal.slice_at + BLOCK_HEADER_BYTES
            self.ledgers = <dict?>self.storage.ledgers
            self.cache = <dict?>self.storage.write_cache
            self.dirty = <set?>self.storage._dirty
            self.waiters = <dict?>server._waiters
            self.to_wake = <set?>server._to_wake
        return 0

    cdef int _end_run(self, conn, double now) except -1:
        """Hand the run of fast adds to the journal as one item, and their counts to the server."""
        if self.run_n == 0:
            return 0
        cdef Py_ssize_t record_bytes = self.batch._used - self.run_used
        self.storage.write_cache_bytes += self.cache_delta
        self.server.counters[OP_ADD] += self.run_n
        conn.journal_bytes += record_bytes
        conn.journal_records += self.run_n
        self.journal.attach((conn, None, now, self.run_n, self.run_bytes, record_bytes), self.run_started_batch)
        self.run_n = 0
        self.run_bytes = 0
        self.cache_delta = 0
        return 0

    def dispatch(self, conn, bytearray out, const uint8_t[::1] buf, double now):
        """Dispatch every complete request in buf; responses of fast adds go to `out` (the
        connection's pending bytes). Returns (consumed, error): error is the FrameError of a
        frame that can never parse (the frames before it were dispatched), else None.

        The connection's `add_roles` (which adds its principal may make) is read once per
        buffer and after each Python dispatch (an AUTH renewal may change it): an add it does
        not cover goes to Python, which answers FORBIDDEN."""
        cdef Py_ssize_t n = buf.shape[0]
        cdef Py_ssize_t pos = 0
        cdef Py_ssize_t flen, plen, old
        cdef const uint8_t* p
        cdef const uint8_t* payload
        cdef uint64_t ledger_id
        cdef int64_t entry_id, blob_lac
        cdef PyObject* found
        cdef LedgerState st
        cdef uint8_t* o
        cdef int roles = conn.add_roles
        self.run_n = 0
        self.run_bytes = 0
        self.cache_delta = 0
        self._load()
        dispatch = self.server.dispatch
        try:
            while pos < n:
                p = &buf[pos]
                flen = frame_len(p, n - pos, REQ_HEADER, self.max_frame)
                if flen < 0:
                    if flen == FRAME_INCOMPLETE:
                        break
                    return pos, FrameError(frame_error(flen, p, REQ_HEADER, self.max_frame))
                plen = flen - REQ_HEADER
                payload = p + REQ_HEADER
                ledger_id = get_u64(p + 16)
                entry_id = <int64_t>get_u64(p + 24)
                found = NULL
                if (self.fast and p[5] == OP_ADD and plen >= ENTRY_HEADER and entry_id >= 0
                        and roles & (ROLE_RECOVER if p[7] & FLAG_RECOVERY_ADD else ROLE_WRITE)
                        and get_u64(payload) == ledger_id and <int64_t>get_u64(payload + 8) == entry_id):
                    lid = ledger_id
                    found = PyDict_GetItem(self.ledgers, lid)
                if found != NULL and type(<object>found) is not LedgerState:
                    found = NULL
                if found != NULL:
                    st = <LedgerState>found
                    if (PyBytes_GET_SIZE(st.master_key) != KEY_LEN
                            or not keys_equal(PyBytes_AS_STRING(st.master_key), <const char*>p + 32, KEY_LEN)
                            or (st.fenced and not (p[7] & FLAG_RECOVERY_ADD))):
                        found = NULL
                if found == NULL:
                    self._end_run(conn, now)
                    dispatch(conn, _request_tuple(p, flen))
                    self._load()
                    roles = conn.add_roles
                    pos += flen
                    continue
                # An add whose answer is OK: stage it, journal it, encode its response.
                blob_lac = <int64_t>get_u64(payload + 16)
                eid = entry_id
                key = (lid, eid)
                # Two ints: no cycle can pass through it, so the cyclic GC need not track it (as
                # it would untrack it at its first pass). Untracked keys and bytes values keep
                # the write cache dict itself untracked: a collection never walks its entries
                # (a gen-2 pass over a full cache was a 10-50 ms stall of the shard's loop).
                PyObject_GC_UnTrack(key)
                data = PyBytes_FromStringAndSize(<const char*>payload, plen)
                found = PyDict_GetItem(self.cache, key)
                if found != NULL:
                    self.cache_delta -= len(<object>found) + self.overhead
                self.cache[key] = data
                self.cache_delta += plen + self.overhead
                if blob_lac > st.lac:
                    st.lac = blob_lac
                if entry_id > st.last_entry:
                    st.last_entry = entry_id
                if not st.in_dirty:
                    st.in_dirty = 1
                    self.dirty.add(lid)
                if self.run_n == 0:
                    self.run_started_batch = self.batch.count == 0
                    self.run_used = self.batch._used
                self.batch.append_record(REC_ADD, ledger_id, entry_id, payload, plen)
                if self.waiters and lid in self.waiters:
                    self.to_wake.add(lid)  # its LAC or its entries moved: the server's wake_parked
                old = PyByteArray_GET_SIZE(out)
                PyByteArray_Resize(out, old + RESP_HEADER)
                o = <uint8_t*>PyByteArray_AS_STRING(out) + old
                put_u32(o, <uint32_t>(RESP_HEADER - 4))
                o[4] = 1
                o[5] = OP_ADD
                put_u16(o + 6, 0)
                put_u64(o + 8, get_u64(p + 8))
                put_u64(o + 16, ledger_id)
                put_u64(o + 24, <uint64_t>entry_id)
                put_u64(o + 32, <uint64_t>st.lac)
                self.run_n += 1
                self.run_bytes += RESP_HEADER
                pos += flen
                if self.batch._used >= self.slice_used:
                    # The block reached journal_max_block_bytes: the rest of a long receive buffer
                    # goes to the next one, so no block (and no sync a light sender's add waits
                    # behind) grows past the bound by more than one frame.
                    self._end_run(conn, now)
                    self.journal.seal_target()
                    self._load()
        finally:
            self._end_run(conn, now)
        return pos, None


def fail_responses(bytearray out, Py_ssize_t nbytes) -> None:
    """Turn the first nbytes of pending add responses into SERVER_ERROR (LAC -1): their
    block could not be made durable."""
    cdef uint8_t* o = <uint8_t*>PyByteArray_AS_STRING(out)
    cdef Py_ssize_t pos = 0
    if nbytes > PyByteArray_GET_SIZE(out):
        raise ValueError("more bytes than are pending")
    while pos + RESP_HEADER <= nbytes:
        put_u16(o + pos + 6, STATUS_SERVER_ERROR)
        put_u64(o + pos + 32, <uint64_t>-1)
        pos += RESP_HEADER
