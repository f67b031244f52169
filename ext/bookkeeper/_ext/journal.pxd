# The journal batch's C interface, for the shard's add path (shardpath.pyx), which appends
# records straight from a receive buffer without a Python call per record.
from libc.stdint cimport uint8_t, uint64_t, int64_t


cdef class JournalBatch:
    cdef bytearray _buf
    cdef Py_ssize_t _used
    cdef public Py_ssize_t count

    cdef int append_record(self, int rtype, uint64_t ledger_id, int64_t entry_id, const uint8_t* data,
                           Py_ssize_t dlen) except -1
    cdef int _grow(self, Py_ssize_t size) except -1
