# Frame layout shared by the bookie's codec (wire.pyx) and the client's pipe (client.pyx):
# inline helpers, so each module compiles them in and neither depends on the other at C level.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize
from bookkeeper._ext.endian cimport get_u32, get_u64, put_u16, put_u32, put_u64

cdef enum:
    REQ_HEADER = 56
    RESP_HEADER = 40
    KEY_LEN = 20
    FRAME_INCOMPLETE = -1
    FRAME_TOO_LONG = -2
    FRAME_TOO_SHORT = -3
    FRAME_BAD_VERSION = -4


cdef inline Py_ssize_t frame_len(const uint8_t* p, Py_ssize_t avail, Py_ssize_t min_len,
                                 Py_ssize_t max_frame) noexcept:
    """Length of the whole frame at p, FRAME_INCOMPLETE, or a FRAME_* code for a frame that
    can never be valid (over the limit, under its header size, unknown version)."""
    cdef uint32_t body
    if avail < 4:
        return FRAME_INCOMPLETE
    body = get_u32(p)
    if <Py_ssize_t>body + 4 > max_frame:
        return FRAME_TOO_LONG
    if <Py_ssize_t>body + 4 < min_len:
        return FRAME_TOO_SHORT
    if avail < 5:
        return FRAME_INCOMPLETE
    if p[4] != 1:
        return FRAME_BAD_VERSION
    if avail < <Py_ssize_t>body + 4:
        return FRAME_INCOMPLETE
    return <Py_ssize_t>body + 4


cdef inline str frame_error(Py_ssize_t code, const uint8_t* p, Py_ssize_t min_len, Py_ssize_t max_frame):
    """Why frame_len refused the frame at p."""
    cdef Py_ssize_t size = <Py_ssize_t>get_u32(p) + 4
    if code == FRAME_TOO_LONG:
        return f"frame of {size} bytes exceeds the limit of {max_frame}"
    if code == FRAME_TOO_SHORT:
        return f"frame of {size} bytes is shorter than its header ({min_len})"
    return f"unsupported protocol version {p[4]}"


cdef inline void put_request(uint8_t* o, int op, int flags, uint64_t request_id, uint64_t ledger_id,
                             int64_t entry_id, const char* key, uint32_t aux, const char* payload,
                             Py_ssize_t plen) noexcept:
    """One request frame at o (REQ_HEADER + plen bytes); key is KEY_LEN bytes."""
    put_u32(o, <uint32_t>(REQ_HEADER - 4 + plen))
    o[4] = 1
    o[5] = <uint8_t>op
    put_u16(o + 6, <uint16_t>flags)
    put_u64(o + 8, request_id)
    put_u64(o + 16, ledger_id)
    put_u64(o + 24, <uint64_t>entry_id)
    memcpy(o + 32, key, KEY_LEN)
    put_u32(o + 52, aux)
    if plen:
        memcpy(o + REQ_HEADER, payload, plen)


cdef inline tuple response_tuple(const uint8_t* p, Py_ssize_t flen, object payload):
    """(op, status, request_id, ledger_id, entry_id, lac, payload) of the response frame at p:
    payload as given, or if None a copy of the frame's (b"" when it has none)."""
    if payload is None:
        payload = b"" if flen == RESP_HEADER else PyBytes_FromStringAndSize(<const char*>(p + RESP_HEADER),
                                                                          flen - RESP_HEADER)
    return (p[5], (p[6] << 8) | p[7], get_u64(p + 8), get_u64(p + 16), <int64_t>get_u64(p + 24),
            <int64_t>get_u64(p + 32), payload)
