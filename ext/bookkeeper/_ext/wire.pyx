# cython: language_level=3, boundscheck=False, wraparound=False
"""Frame codec of the bookie wire protocol (docs/protocol.md), the network hot path.

Why Cython: every byte a bookie receives passes through here. A receive buffer
holding many frames is parsed in one call, and all responses of a batch are
encoded into one buffer, so Python runs per batch, not per byte or per field.

Layout (all integers big-endian):
  request  = u32 length | u8 version | u8 op | u16 flags | u64 request_id
             | u64 ledger_id | i64 entry_id | 20 B master_key | u32 aux | payload
  response = u32 length | u8 version | u8 op | u16 status | u64 request_id
             | u64 ledger_id | i64 entry_id | i64 lac | payload
`length` counts the bytes after itself. An entry payload (the digest-framed
entry built by the client) starts with u64 ledger | i64 entry | i64 lac | u64 length.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from bookkeeper._ext.endian cimport get_u32, get_u64, put_u16, put_u32, put_u64
from bookkeeper._ext.frame cimport (REQ_HEADER, RESP_HEADER, KEY_LEN, FRAME_INCOMPLETE, frame_len,
                                   frame_error, put_request, response_tuple)
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.pyport cimport PY_SSIZE_T_MAX

import os


PROTOCOL_VERSION = 1
REQUEST_HEADER_BYTES = REQ_HEADER
RESPONSE_HEADER_BYTES = RESP_HEADER
MASTER_KEY_BYTES = KEY_LEN
ENTRY_HEADER_BYTES = 32


class FrameError(ValueError):
    """A frame that can never be parsed: the connection that sent it must be closed.

    `frames` holds the complete, valid requests that came before it in the same buffer
    (parse_requests fills it), so they are still answered before the connection closes.
    """

    frames: list = []


# TEST ONLY, never a configuration key: BK_FUZZ_NO_LENGTH_CHECK=1 in the environment of a
# process that imports this module turns off the frame-length checks of parse_requests and
# parse_responses (a frame shorter than its header or over max_frame is taken as it declares
# itself). tests/fuzz uses it to prove that its frame-decoder targets find the over-read
# that follows: a harness that cannot fail proves nothing. Read once, at import.
cdef bint _NO_LENGTH_CHECK = os.environ.get("BK_FUZZ_NO_LENGTH_CHECK") == "1"
LENGTH_CHECK = not _NO_LENGTH_CHECK


cdef Py_ssize_t _frame_len(const uint8_t* p, Py_ssize_t avail, Py_ssize_t min_len,
                           Py_ssize_t max_frame) except -2:
    """Length of the whole frame at p, -1 if incomplete; raises FrameError if never valid."""
    cdef Py_ssize_t flen
    if _NO_LENGTH_CHECK:
        min_len, max_frame = 5, PY_SSIZE_T_MAX
    flen = frame_len(p, avail, min_len, max_frame)
    if flen < FRAME_INCOMPLETE:
        raise FrameError(frame_error(flen, p, min_len, max_frame))
    return flen


def parse_requests(const uint8_t[::1] buf, Py_ssize_t max_frame):
    """Parse every complete request frame in buf.

    Returns (frames, consumed): frames is a list of tuples
    (op, flags, request_id, ledger_id, entry_id, master_key, aux, payload, blob_lac),
    where blob_lac is the LAC piggybacked in an entry payload (-1 if the payload is
    too short to carry one). consumed is how many bytes of buf those frames took;
    the caller keeps the rest for the next call. Raises FrameError on a frame that
    can never be valid (over the limit, under the header size, unknown version).
    """
    cdef Py_ssize_t n = buf.shape[0]
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t flen
    cdef const uint8_t* p
    cdef list out = []
    cdef int64_t blob_lac
    cdef Py_ssize_t plen
    if n == 0:
        return out, 0
    while pos < n:
        p = &buf[pos]
        try:
            flen = _frame_len(p, n - pos, REQ_HEADER, max_frame)
        except FrameError as e:
            e.frames = out
            raise
        if flen < 0:
            break
        plen = flen - REQ_HEADER
        blob_lac = -1
        if plen >= 32:
            blob_lac = <int64_t>get_u64(p + REQ_HEADER + 16)
        out.append((
            p[5],
            (p[6] << 8) | p[7],
            get_u64(p + 8),
            get_u64(p + 16),
            <int64_t>get_u64(p + 24),
            PyBytes_FromStringAndSize(<const char*>(p + 32), KEY_LEN),
            get_u32(p + 52),
            PyBytes_FromStringAndSize(<const char*>(p + REQ_HEADER), plen),
            blob_lac,
        ))
        pos += flen
    return out, pos


def parse_responses(const uint8_t[::1] buf, Py_ssize_t max_frame):
    """Parse every complete response frame in buf.

    Returns (frames, consumed) with tuples
    (op, status, request_id, ledger_id, entry_id, lac, payload).
    """
    cdef Py_ssize_t n = buf.shape[0]
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t flen
    cdef const uint8_t* p
    cdef list out = []
    if n == 0:
        return out, 0
    while pos < n:
        p = &buf[pos]
        flen = _frame_len(p, n - pos, RESP_HEADER, max_frame)
        if flen < 0:
            break
        out.append(response_tuple(p, flen, None))
        pos += flen
    return out, pos


def encode_request(int op, int flags, uint64_t request_id, uint64_t ledger_id,
                   int64_t entry_id, bytes master_key, uint32_t aux, payload) -> bytes:
    """One request frame. master_key must be 20 bytes (zeros where unused)."""
    cdef const uint8_t[::1] pv = payload
    cdef Py_ssize_t plen = pv.shape[0]
    if len(master_key) != KEY_LEN:
        raise ValueError("master_key must be 20 bytes")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, REQ_HEADER + plen)
    put_request(<uint8_t*>PyBytes_AS_STRING(out), op, flags, request_id, ledger_id, entry_id,
                PyBytes_AS_STRING(master_key), aux, <const char*>&pv[0] if plen else NULL, plen)
    return out


cdef inline void _write_response(uint8_t* o, int op, int status, uint64_t request_id,
                                 uint64_t ledger_id, int64_t entry_id, int64_t lac,
                                 const uint8_t* payload, Py_ssize_t plen) noexcept:
    put_u32(o, <uint32_t>(RESP_HEADER - 4 + plen))
    o[4] = 1
    o[5] = <uint8_t>op
    put_u16(o + 6, <uint16_t>status)
    put_u64(o + 8, request_id)
    put_u64(o + 16, ledger_id)
    put_u64(o + 24, <uint64_t>entry_id)
    put_u64(o + 32, <uint64_t>lac)
    if plen:
        memcpy(o + RESP_HEADER, payload, plen)


def encode_responses(list responses) -> bytes:
    """All responses of a batch, for one connection, in one buffer (one write).

    Each item is (op, status, request_id, ledger_id, entry_id, lac, payload), where
    payload is bytes (other buffers are copied to bytes first; anything else is a TypeError).
    """
    cdef Py_ssize_t total = 0
    cdef tuple r
    cdef list payloads = []
    cdef object p
    for r in responses:
        p = r[6]
        if type(p) is not bytes:
            if isinstance(p, str):
                raise TypeError("response payload must be a bytes-like object, not str")
            p = bytes(p)
        payloads.append(p)
        total += RESP_HEADER + len(<bytes>p)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t plen
    cdef Py_ssize_t i
    cdef bytes payload
    for i in range(len(responses)):
        r = <tuple>responses[i]
        payload = <bytes>payloads[i]
        plen = len(payload)
        _write_response(o + pos, r[0], r[1], r[2], r[3], r[4], r[5],
                        <const uint8_t*>PyBytes_AS_STRING(payload), plen)
        pos += RESP_HEADER + plen
    return out


def entry_header(const uint8_t[::1] payload):
    """(ledger_id, entry_id, lac, length) from a digest-framed entry payload."""
    if payload.shape[0] < 32:
        raise FrameError("entry payload shorter than its 32-byte header")
    cdef const uint8_t* p = &payload[0]
    return (get_u64(p), <int64_t>get_u64(p + 8), <int64_t>get_u64(p + 16),
            get_u64(p + 24))
