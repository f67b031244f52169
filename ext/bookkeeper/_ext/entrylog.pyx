# cython: language_level=3, boundscheck=False, wraparound=False
"""Entry-log batch encoding for a checkpoint, the storage hot path's second half
(bookkeeper/bookie/storage/ledger_storage.py).

Why Cython: a checkpoint re-writes every entry the journal took since the last one,
in a worker thread of the shard process. Packed in Python that cost ~3.5 us of CPU
per entry with the GIL held, a third of a core at 100,000 adds/s, taken from the
event loop serving adds. And whatever the worker does with the GIL held, the loop
waits for: one Python `sorted` of a full write cache's (ledger, entry) keys held it
~35 ms, one 8 MiB layout ~50 ms, the per-ledger byte count after it ~40 ms of Python
per 70,000 entries; under load the shard's loop stalled 0.25-0.5 s per checkpoint
and adds ran at 60 % of their rate without checkpoints (issue 28). Here the keys
are read in slices (`gather`), sorted without the GIL (`sort`), and laid out in
chunks of bounded count (`encode`, with the per-ledger bytes it laid out): no call
holds the GIL for more than about a millisecond.

Entry log record (big-endian): u32 length | u64 ledger_id | i64 entry_id | data.
Index key: u64 ledger_id | u64 entry_id; value: u32 log_id | u64 offset | u32 length
(offset of the data, past the record header).
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport qsort
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from bookkeeper._ext.endian cimport put_u32, put_u64

cdef enum:
    REC_HEADER = 20
    IDX_KEY = 16
    IDX_VAL = 16

RECORD_HEADER_BYTES = REC_HEADER


cdef extern from "Python.h":
    int PyDict_Next(object d, Py_ssize_t* pos, PyObject** key, PyObject** value)


cdef struct Entry:
    uint64_t ledger_id
    int64_t entry_id
    PyObject* data  # a reference of its own from gather until encode lays it out


cdef int _entry_order(const void* a, const void* b) noexcept nogil:
    cdef const Entry* x = <const Entry*>a
    cdef const Entry* y = <const Entry*>b
    if x.ledger_id != y.ledger_id:
        return -1 if x.ledger_id < y.ledger_id else 1
    if x.entry_id != y.entry_id:
        return -1 if x.entry_id < y.entry_id else 1
    return 0


cdef class SortedEntries:
    """The entries of a {(ledger_id, entry_id): data} dict in (ledger, entry) order, laid out
    as entry-log records chunk by chunk: so a ledger's entries sit together in the log.

    Use: `gather(n)` until it returns True (each call reads up to n more entries of the dict,
    leaving out the ledgers in `skip`; the dict must not change meanwhile: a change of its
    size is an error, a change that keeps its size is not seen: the snapshot flushed is
    never written to), `sort()` once (without the GIL), then `encode(...)` while
    `remaining`. An encode that raised (no memory) leaves the batch unusable: its caller's
    flush fails and the snapshot's dict, which still holds every entry, is put back.
    """

    cdef dict _entries
    cdef object _skip
    cdef Entry* _items
    cdef Py_ssize_t _size  # the dict's size when made: gather refuses a dict that changed
    cdef Py_ssize_t _dict_pos
    cdef Py_ssize_t _n  # entries gathered
    cdef Py_ssize_t _next  # the first entry not yet encoded
    cdef bint _gathered
    cdef bint _sorted
    cdef bint _broken  # an encode raised part-way: entries it laid out are gone from _items

    def __cinit__(self, dict entries not None, skip=None):
        self._entries = entries
        self._skip = skip if skip else None
        self._size = len(entries)
        self._items = <Entry*>PyMem_Malloc(max(self._size, 1) * sizeof(Entry))
        if self._items == NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._items != NULL:
            for i in range(self._next, self._n):  # those encode did not lay out
                Py_XDECREF(self._items[i].data)
            PyMem_Free(self._items)

    def gather(self, Py_ssize_t limit) -> bool:
        """Read up to `limit` more entries; True once all are read."""
        cdef PyObject* key
        cdef PyObject* value
        cdef Py_ssize_t taken = 0
        cdef object skip = self._skip
        cdef tuple pair
        if limit <= 0:
            raise ValueError("gather needs a positive limit")
        if len(self._entries) != self._size:
            raise RuntimeError("the entries changed while they were gathered")
        while taken < limit and PyDict_Next(self._entries, &self._dict_pos, &key, &value):
            taken += 1
            pair = <tuple?><object>key
            if skip is not None and pair[0] in skip:
                continue
            self._items[self._n].ledger_id = pair[0]
            self._items[self._n].entry_id = pair[1]
            Py_INCREF(<bytes?><object>value)
            self._items[self._n].data = value
            self._n += 1
        if taken < limit:
            self._gathered = True
        return self._gathered

    def sort(self) -> None:
        """Order the gathered entries by (ledger, entry), without the GIL."""
        if not self._gathered:
            raise RuntimeError("sort before every entry was gathered")
        with nogil:
            qsort(self._items, self._n, sizeof(Entry), _entry_order)
        self._sorted = True

    @property
    def remaining(self) -> int:
        """Entries not yet encoded (of those gathered)."""
        return self._n - self._next

    def encode(self, uint32_t log_id, uint64_t pos, Py_ssize_t max_bytes, Py_ssize_t max_entries):
        """Lay out the next entries as records starting at offset pos of log log_id: about
        max_bytes and at most max_entries (at least one record while any remain).

        Returns (records, index, end, per_ledger): the bytes to append, the (key, value) index
        pairs in key order (ready for an LMDB putmulti), the log offset after the last record,
        and {ledger_id: record bytes laid out here}.
        """
        if not self._sorted:
            raise RuntimeError("encode before sort")
        if self._broken:
            raise RuntimeError("encode after an encode that failed")
        if max_entries <= 0:
            raise ValueError("encode needs a positive max_entries")
        cdef Py_ssize_t start = self._next
        cdef Py_ssize_t stop = start
        cdef Py_ssize_t total = 0
        while stop < self._n and stop - start < max_entries and (total < max_bytes or stop == start):
            total += REC_HEADER + PyBytes_GET_SIZE(<bytes>self._items[stop].data)
            stop += 1
        cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
        cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
        cdef list index = []
        cdef dict per = {}
        cdef Py_ssize_t at = 0
        cdef Py_ssize_t dlen
        cdef Py_ssize_t i
        cdef Py_ssize_t run = 0
        cdef uint64_t lid
        cdef int64_t eid
        cdef bytes k, v, data
        self._broken = True  # until every entry of this chunk is laid out
        for i in range(start, stop):
            lid = self._items[i].ledger_id
            eid = self._items[i].entry_id
            data = <bytes>self._items[i].data
            dlen = PyBytes_GET_SIZE(data)
            put_u32(o + at, <uint32_t>dlen)
            put_u64(o + at + 4, lid)
            put_u64(o + at + 12, <uint64_t>eid)
            memcpy(o + at + REC_HEADER, PyBytes_AS_STRING(data), dlen)
            k = PyBytes_FromStringAndSize(NULL, IDX_KEY)
            put_u64(<uint8_t*>PyBytes_AS_STRING(k), lid)
            put_u64(<uint8_t*>PyBytes_AS_STRING(k) + 8, <uint64_t>eid)
            v = PyBytes_FromStringAndSize(NULL, IDX_VAL)
            put_u32(<uint8_t*>PyBytes_AS_STRING(v), log_id)
            put_u64(<uint8_t*>PyBytes_AS_STRING(v) + 4, pos + at + REC_HEADER)
            put_u32(<uint8_t*>PyBytes_AS_STRING(v) + 12, <uint32_t>dlen)
            index.append((k, v))
            Py_XDECREF(self._items[i].data)  # laid out: the dict's reference is the one left
            self._items[i].data = NULL
            at += REC_HEADER + dlen
            run += REC_HEADER + dlen
            if i + 1 == stop or self._items[i + 1].ledger_id != lid:
                per[lid] = run  # sorted: a ledger's entries of this chunk are one run
                run = 0
        self._next = stop
        self._broken = False
        return out, index, pos + total, per
