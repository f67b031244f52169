# cython: language_level=3, boundscheck=False, wraparound=False
"""Journal record batching and block encoding, the storage hot path (docs/journal.md).

Why Cython: every acknowledged entry is appended here once; a group-commit batch
gathers records into one contiguous buffer so the journal issues one write and
one fdatasync per batch.

Why one checksum per block, not per record: a block is written by one write and
made durable by one fdatasync, and no entry of a block is acknowledged before
that fdatasync returns. A torn block therefore only ever holds unacknowledged
entries, and discarding it whole is exactly right. Replay stops at the first
block whose magic, bounds or CRC32C do not hold.

Block (big-endian), padded with zeros to a multiple of BLOCK_ALIGN:
  u32 magic 'BKJB' | u32 payload_len | u32 crc32c | u32 record_count | u64 seq | payload
  crc32c covers bytes [4:8] and [12:24] of the header, then the payload.
Record inside a payload:
  u32 record_len (bytes after this field) | u8 type | u64 ledger_id | i64 entry_id | data

seq (file format 2): generation << 32 | n, where the generation is the low 32 bits of the
file's id and n counts the file's blocks from 0. Journal files are reused (overwritten
from the start, never zeroed), so the bytes after a file's last block may be valid blocks
of its previous use: they carry another generation, and replay stops at them.
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from bookkeeper._ext.endian cimport get_u32, get_u64, put_u32, put_u64
from libc.string cimport memcpy, memset
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_Resize, PyByteArray_GET_SIZE

import crc32c as _crc32c

cdef enum:
    BLOCK_HEADER = 24
    RECORD_HEADER = 21
    ALIGN = 4096

BLOCK_MAGIC = 0x424B4A42
BLOCK_ALIGN = ALIGN
BLOCK_HEADER_BYTES = BLOCK_HEADER

REC_ADD = 1
REC_MASTER_KEY = 2
REC_FENCE = 3


cdef uint32_t _block_crc(const uint8_t* hdr, const uint8_t* payload, Py_ssize_t plen):
    """CRC32C of header bytes [4:8] and [12:24], then the payload: read in place, never copied."""
    cdef uint8_t fields[16]
    memcpy(fields, hdr + 4, 4)
    memcpy(fields + 4, hdr + 12, 12)
    cdef uint32_t crc = _crc32c.crc32c(PyBytes_FromStringAndSize(<const char*>fields, 16))
    if plen == 0:
        return crc
    return _crc32c.crc32c(<const uint8_t[:plen]>payload, crc)


cdef inline Py_ssize_t _sealed_size(Py_ssize_t used) noexcept:
    """A block of `used` bytes (header and records) padded to ALIGN: seal()'s size, and what
    the journal checks against the room left in its file before sealing."""
    return ((used + ALIGN - 1) // ALIGN) * ALIGN


cdef class JournalBatch:
    """Records of one group commit, appended into one buffer (per shard, loop thread only).

    _used: bytes of _buf in use; the rest is room grown ahead (doubling). journal.pxd
    declares the fields and append_record for the shard's C add path."""

    def __cinit__(self, bytearray reuse=None):
        """reuse: the buffer of a batch whose block is durable (its size is kept as room,
        so a steady stream of batches neither reallocates nor faults in fresh pages)."""
        self._buf = reuse if reuse is not None and len(reuse) >= BLOCK_HEADER else bytearray(BLOCK_HEADER)
        self._used = BLOCK_HEADER
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes of records so far (without block header and padding)."""
        return self._used - BLOCK_HEADER

    def add(self, int rtype, uint64_t ledger_id, int64_t entry_id, const uint8_t[::1] data):
        """Append one record. data is copied; the caller may reuse its buffer."""
        cdef Py_ssize_t dlen = data.shape[0]
        self.append_record(rtype, ledger_id, entry_id, &data[0] if dlen else NULL, dlen)

    cdef int append_record(self, int rtype, uint64_t ledger_id, int64_t entry_id, const uint8_t* data,
                           Py_ssize_t dlen) except -1:
        cdef Py_ssize_t old = self._used
        cdef Py_ssize_t need = old + RECORD_HEADER + dlen
        cdef Py_ssize_t size = PyByteArray_GET_SIZE(self._buf)
        if need > size:  # grow by doubling: a big batch is copied O(log n) times, not O(n)
            self._grow(need if need > 2 * size else 2 * size)
        self._used = need
        cdef uint8_t* o = <uint8_t*>PyByteArray_AS_STRING(self._buf) + old
        put_u32(o, <uint32_t>(RECORD_HEADER - 4 + dlen))
        o[4] = <uint8_t>rtype
        put_u64(o + 5, ledger_id)
        put_u64(o + 13, <uint64_t>entry_id)
        if dlen:
            memcpy(o + RECORD_HEADER, data, dlen)
        self.count += 1
        return 0

    cdef int _grow(self, Py_ssize_t size) except -1:
        try:
            PyByteArray_Resize(self._buf, size)
        except BufferError:  # a view of a reused buffer is still alive somewhere: start a new one
            fresh = bytearray(size)
            memcpy(PyByteArray_AS_STRING(fresh), PyByteArray_AS_STRING(self._buf), self._used)
            self._buf = fresh
        return 0

    @property
    def sealed_bytes(self) -> int:
        """The size of the block seal() would make now (header, records, padding)."""
        return _sealed_size(self._used)

    @property
    def buffer(self) -> bytearray:
        """The underlying buffer, to hand to the next batch once this block is durable."""
        return self._buf

    def seal(self, uint64_t seq) -> memoryview:
        """The batch as one aligned block, ready to write; no record may be added after."""
        cdef Py_ssize_t plen = self._used - BLOCK_HEADER
        cdef Py_ssize_t total = _sealed_size(self._used)
        if total > PyByteArray_GET_SIZE(self._buf):
            self._grow(total)
        cdef uint8_t* o = <uint8_t*>PyByteArray_AS_STRING(self._buf)
        memset(o + BLOCK_HEADER + plen, 0, total - BLOCK_HEADER - plen)
        put_u32(o, BLOCK_MAGIC)
        put_u32(o + 4, <uint32_t>plen)
        put_u32(o + 12, <uint32_t>self.count)
        put_u64(o + 16, seq)
        put_u32(o + 8, _block_crc(o, o + BLOCK_HEADER, plen))
        return memoryview(self._buf)[:total]


cdef Py_ssize_t _block_len(const uint8_t* p, Py_ssize_t pos, Py_ssize_t n) noexcept:
    """The payload length of a block at pos whose magic, bounds and checksum hold, else -1."""
    cdef uint32_t plen
    if pos + BLOCK_HEADER > n or get_u32(p) != BLOCK_MAGIC:
        return -1
    plen = get_u32(p + 4)
    if pos + BLOCK_HEADER + <Py_ssize_t>plen > n or get_u32(p + 8) != _block_crc(p, p + BLOCK_HEADER, plen):
        return -1
    return plen


def scan_blocks(const uint8_t[::1] buf, Py_ssize_t offset, int64_t generation=-1):
    """Decode the valid blocks of a journal file image from offset.

    generation: the file's generation (format 2), or -1 (format 1: any seq). With a
    generation, a block belongs to the file only if its seq carries that generation and
    its n follows the previous block's: a block of an earlier use of a reused file ends
    the scan like a zero tail.

    Returns (records, end_offset, torn, last_seq, next_valid). records are tuples
    (type, ledger_id, entry_id, data). end_offset is where the next block would
    start; torn is True when the bytes at end_offset are neither zeros nor a valid
    block of another generation (a block that failed its magic, bounds or checksum,
    or, in a reused file, the middle of an earlier use's block). last_seq is the seq
    of the last valid block, or -1. next_valid is the offset of a valid block of this
    file after the one that stopped the scan, or -1: blocks are written one at a time,
    so a torn write can only be the file's last block, and a valid block after an
    invalid one means the invalid one was damaged after it was acknowledged (the
    caller must not go on).
    """
    cdef Py_ssize_t n = buf.shape[0]
    cdef Py_ssize_t pos = offset
    cdef const uint8_t* p
    cdef uint32_t count, rlen
    cdef Py_ssize_t plen, rpos, rend, total
    cdef list records = []
    cdef int64_t last_seq = -1
    cdef uint64_t seq
    cdef bint torn = False
    cdef Py_ssize_t i, q
    cdef Py_ssize_t next_valid = -1
    while pos + BLOCK_HEADER <= n:
        p = &buf[pos]
        plen = _block_len(p, pos, n)
        if plen < 0:
            break
        seq = get_u64(p + 16)
        if generation >= 0 and not _follows(seq, generation, last_seq):
            break
        count = get_u32(p + 12)
        rpos = pos + BLOCK_HEADER
        rend = rpos + plen
        block = []
        while rpos + RECORD_HEADER <= rend:
            rlen = get_u32(&buf[rpos])
            if rpos + 4 + <Py_ssize_t>rlen > rend or rlen < RECORD_HEADER - 4:
                break
            block.append((buf[rpos + 4], get_u64(&buf[rpos + 5]), <int64_t>get_u64(&buf[rpos + 13]),
                          PyBytes_FromStringAndSize(<const char*>&buf[rpos + RECORD_HEADER],
                                                    rlen - (RECORD_HEADER - 4))))
            rpos += 4 + rlen
        if len(block) != count or rpos != rend:
            break
        records.extend(block)
        last_seq = <int64_t>seq
        total = ((BLOCK_HEADER + plen + ALIGN - 1) // ALIGN) * ALIGN
        pos += total
    if pos + BLOCK_HEADER <= n and _block_len(&buf[pos], pos, n) >= 0 and generation >= 0 \
            and <int64_t>(get_u64(&buf[pos] + 16) >> 32) != generation:
        return records, pos, False, last_seq, -1  # an earlier use's block: where this use ends
    for i in range(pos, n):
        if buf[i] != 0:
            torn = True
            break
    if torn:
        q = pos + ALIGN
        while q + BLOCK_HEADER <= n:
            if _block_len(&buf[q], q, n) >= 0 and _later(get_u64(&buf[q] + 16), generation, last_seq):
                next_valid = q
                break
            q += ALIGN
    return records, pos, torn, last_seq, next_valid


cdef inline bint _follows(uint64_t seq, int64_t generation, int64_t last_seq) noexcept:
    """seq is this file's next block: its generation, and n one past the last (any n for the first)."""
    if <int64_t>(seq >> 32) != generation:
        return False
    return last_seq < 0 or seq == <uint64_t>last_seq + 1


cdef inline bint _later(uint64_t seq, int64_t generation, int64_t last_seq) noexcept:
    """seq is a block of this file written after last_seq (format 1: any larger seq)."""
    if generation >= 0 and <int64_t>(seq >> 32) != generation:
        return False
    return <int64_t>seq > last_seq
