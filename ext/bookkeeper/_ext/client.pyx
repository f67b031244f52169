# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's hot path: entry digests, the request pipe of a shard connection, and the
acknowledgement tracker of a write handle (docs/architecture.md, "Client").

Why Cython: a pipelined writer pays for every add several times over (encode, checksum,
one frame per write-set bookie, one response per bookie, the in-order ack). Written in
Python that was ~16 us of CPU per add, enough for one client process to saturate before
any bookie. Here a frame is encoded straight into the connection's outbox, a receive
buffer is parsed and dispatched in one call, and acknowledged futures are resolved in
order by a C loop over a ring of outstanding entries, which also records each one's add
latency into a C histogram (LatencyHistogram) as it goes.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.math cimport isfinite
from libc.string cimport memcpy, memmove
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_Resize, PyByteArray_GET_SIZE
from cpython.buffer cimport PyBUF_READ, PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.weakref cimport PyWeakref_GetObject
from bookkeeper._ext.endian cimport get_u64, put_u32, put_u64
from bookkeeper._ext.frame cimport (REQ_HEADER, RESP_HEADER, KEY_LEN, FRAME_INCOMPLETE, frame_len,
                                   frame_error, put_request, response_tuple)

import hashlib
import hmac
import logging

import crc32c as _crc32c

from bookkeeper._ext.wire import FrameError

_log = logging.getLogger("bookkeeper.client")

cdef enum:
    OP_ADD = 1
    ENTRY_HEADER = 32
    MAX_ENSEMBLE = 64
    READ_CHUNK = 64 * 1024         # the least free space offered to the transport per read
    RECV_INITIAL = 256 * 1024      # a receive buffer's size (per connection), kept while frames fit in it

DIGEST_DUMMY = 0
DIGEST_CRC32C = 1
DIGEST_MAC = 2
MAX_ENSEMBLE_SIZE = MAX_ENSEMBLE

cdef bytes _EMPTY = b""


cdef inline double _monotonic() noexcept nogil:
    """CLOCK_MONOTONIC in seconds (the clock of time.monotonic(), without a Python call)."""
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return now.tv_sec + now.tv_nsec * 1e-9


# -- latency histogram --------------------------------------------------------------
cdef class LatencyHistogram:
    """Counts of observed latencies over fixed upper bounds (Prometheus `le`: a value equal
    to a bound counts in that bound's bucket; above the last bound, in +Inf), and their sum.

    Lives in: the client loop (observe) and any thread that scrapes it (snapshot, under the
    GIL: a consistent copy). Why in C: the add path observes every acknowledged entry from
    AddTracker._advance, a C loop; a Python histogram there would be a call and a bisect
    per entry on a path that costs ~1-3 us an add in all.
    """

    cdef double* _bounds
    cdef uint64_t* _counts   # one per bound, then +Inf
    cdef Py_ssize_t _n
    cdef double _sum

    def __cinit__(self, bounds):
        """bounds: the finite upper bounds in seconds, strictly increasing (+Inf is implied)."""
        values = [float(b) for b in bounds]
        if not values:
            raise ValueError("a histogram needs at least one bound")
        cdef Py_ssize_t i
        for i in range(len(values)):
            if not isfinite(values[i]) or (i and values[i] <= values[i - 1]):
                raise ValueError(f"histogram bounds must be finite and strictly increasing, got {values}")
        self._n = len(values)
        self._bounds = <double*>malloc(self._n * sizeof(double))
        self._counts = <uint64_t*>malloc((self._n + 1) * sizeof(uint64_t))
        if self._bounds == NULL or self._counts == NULL:
            raise MemoryError()
        for i in range(self._n):
            self._bounds[i] = values[i]
        for i in range(self._n + 1):
            self._counts[i] = 0
        self._sum = 0.0

    def __dealloc__(self):
        free(self._bounds)
        free(self._counts)

    cdef inline void _observe(self, double seconds) noexcept:
        """Binary search for the first bound >= seconds (bisect_left), +Inf past the last."""
        cdef Py_ssize_t lo = 0
        cdef Py_ssize_t hi = self._n
        cdef Py_ssize_t mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self._bounds[mid] < seconds:
                lo = mid + 1
            else:
                hi = mid
        self._counts[lo] += 1
        self._sum += seconds

    def observe(self, double seconds) -> None:
        """Record one latency of `seconds`."""
        self._observe(seconds)

    @property
    def bounds(self) -> tuple:
        return tuple([self._bounds[i] for i in range(self._n)])

    @property
    def count(self) -> int:
        """Observations so far."""
        cdef uint64_t total = 0
        cdef Py_ssize_t i
        for i in range(self._n + 1):
            total += self._counts[i]
        return total

    def snapshot(self) -> dict:
        """{"bounds": [...], "counts": [...], "sum": s}: per-bucket (not cumulative) counts,
        +Inf last; the shape of bookkeeper.bookie.metrics.Histogram.snapshot()."""
        return {"bounds": [self._bounds[i] for i in range(self._n)],
                "counts": [self._counts[i] for i in range(self._n + 1)], "sum": self._sum}


# -- entry digests ------------------------------------------------------------------
cdef int _digest_size(int kind) except -1:
    if kind == DIGEST_CRC32C:
        return 4
    if kind == DIGEST_MAC:
        return 20
    if kind == DIGEST_DUMMY:
        return 0
    raise ValueError(f"unknown digest kind {kind}")


cdef bytes _digest(int kind, bytes mac_key, object header, object data):
    """The digest of an entry: over its 32-byte header, then its data."""
    cdef uint32_t crc
    cdef uint8_t out[4]
    if kind == DIGEST_CRC32C:
        crc = _crc32c.crc32c(data, _crc32c.crc32c(header))
        put_u32(out, crc)
        return PyBytes_FromStringAndSize(<const char*>out, 4)
    if kind == DIGEST_MAC:
        m = hmac.new(mac_key, header, hashlib.sha1)
        m.update(data)
        return m.digest()
    return _EMPTY


def encode_entry(int kind, bytes mac_key, uint64_t ledger_id, int64_t entry_id, int64_t lac,
                 uint64_t length, bytes data) -> bytes:
    """The stored form of an entry: u64 ledger | i64 entry | i64 lac | u64 length | digest | data."""
    return _encode_entry(kind, mac_key, ledger_id, entry_id, lac, length, data)


cdef bytes _encode_entry(int kind, bytes mac_key, uint64_t ledger_id, int64_t entry_id, int64_t lac,
                         uint64_t length, bytes data):
    cdef Py_ssize_t dsize = _digest_size(kind)
    cdef Py_ssize_t dlen = PyBytes_GET_SIZE(data)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, ENTRY_HEADER + dsize + dlen)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    put_u64(o, ledger_id)
    put_u64(o + 8, <uint64_t>entry_id)
    put_u64(o + 16, <uint64_t>lac)
    put_u64(o + 24, length)
    if dlen:
        memcpy(o + ENTRY_HEADER + dsize, PyBytes_AS_STRING(data), dlen)
    if dsize:
        view = memoryview(out)
        memcpy(o + ENTRY_HEADER, PyBytes_AS_STRING(_digest(kind, mac_key, view[:ENTRY_HEADER], data)), dsize)
    return out


def check_entry(int kind, bytes mac_key, uint64_t ledger_id, int64_t entry_id, const uint8_t[::1] payload):
    """Verify a stored entry against the ledger and entry it was asked for.

    payload is any buffer (a borrowed view of the receive buffer on the read path): the
    entry's data is copied out of it once, as the returned bytes. Returns (data, lac,
    length); raises ValueError saying what does not hold.
    """
    cdef Py_ssize_t dsize = _digest_size(kind)
    cdef Py_ssize_t n = payload.shape[0]
    if n < ENTRY_HEADER + dsize:
        raise ValueError(f"entry {ledger_id}:{entry_id} is truncated ({n} bytes)")
    cdef const uint8_t* p = &payload[0]
    cdef uint64_t got_ledger = get_u64(p)
    cdef int64_t got_entry = <int64_t>get_u64(p + 8)
    if got_ledger != ledger_id or got_entry != entry_id:
        raise ValueError(f"entry {ledger_id}:{entry_id} came back as {got_ledger}:{got_entry}")
    if dsize:
        view = memoryview(payload)
        if not hmac.compare_digest(_digest(kind, mac_key, view[:ENTRY_HEADER], view[ENTRY_HEADER + dsize:]),
                                   view[ENTRY_HEADER:ENTRY_HEADER + dsize]):
            raise ValueError(f"entry {ledger_id}:{entry_id} failed its digest check")
    return (PyBytes_FromStringAndSize(<const char*>(p + ENTRY_HEADER + dsize), n - ENTRY_HEADER - dsize),
            <int64_t>get_u64(p + 16), get_u64(p + 24))


# -- request pipe -------------------------------------------------------------------
cdef class RequestPipe:
    """Outstanding requests of one shard connection (client loop only).

    send() encodes a request frame straight into the outbox (the connection writes the
    whole outbox once per loop iteration). Responses arrive in the pipe's own receive
    buffer: get_buffer() offers its free space to the transport (asyncio.BufferedProtocol:
    the kernel copies into it, nothing else does), buffer_updated() parses every complete
    response there and calls each request's callback(ctx, response, error) in arrival
    order. A response is the tuple (op, status, request_id, ledger_id, entry_id, lac,
    payload); error is None for OK, else error_for(status[, payload]), a BKError. A request sent with
    borrow=True gets its payload as a read-only memoryview of the receive buffer, valid
    only during the callback (released after it): the entry read path copies the data
    out once, after its digest check, instead of once per layer.
    """

    cdef bytearray _out
    cdef char* _rbuf
    cdef Py_ssize_t _rcap, _rstart, _rend
    cdef uint64_t _generation
    cdef dict _pending
    cdef double _min_timeout
    cdef uint64_t _next_id
    cdef Py_ssize_t _max_frame
    cdef object _error_for
    cdef object _schedule_flush
    cdef object _flush_now
    cdef Py_ssize_t _eager_bytes
    cdef object _clock
    cdef public bint connected

    def __cinit__(self, Py_ssize_t max_frame, error_for, schedule_flush, flush_now,
                  Py_ssize_t eager_bytes=16384, clock=None):
        """error_for(status[, payload]) -> BKError (payload, the bookie's reason for the error,
        is passed only when the response has one: a view valid during the call when the
        request borrowed); schedule_flush() arranges one write of the outbox
        (called when a frame lands in an empty outbox of a connected pipe); flush_now()
        writes it at once (called when the outbox reaches eager_bytes: a burst of requests,
        e.g. sent from the callbacks of one big receive buffer, starts reaching the bookie
        while the rest is still being made, instead of all at the end of the loop turn).
        clock: seconds now, read once per send (None: CLOCK_MONOTONIC read in C, no Python
        call; a simulation passes its virtual clock, bookkeeper/testing/sim)."""
        self._out = bytearray()
        self._clock = clock
        self._rbuf = NULL
        self._rcap = self._rstart = self._rend = 0
        self._generation = 0
        self._pending = {}
        self._min_timeout = 1e300
        self._next_id = 1
        self._max_frame = max_frame
        self._error_for = error_for
        self._schedule_flush = schedule_flush
        self._flush_now = flush_now
        self._eager_bytes = eager_bytes
        self.connected = False

    def __dealloc__(self):
        free(self._rbuf)

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def send(self, int op, int flags, uint64_t ledger_id, int64_t entry_id, bytes key, uint32_t aux,
             bytes payload, callback, ctx, double timeout_s, bint borrow=False) -> bool:
        """Queue one request, due within timeout_s. True if the pipe is not connected: the
        caller must see that a connection is under way (its frames wait in the outbox).
        borrow: the callback gets the response payload as a view it must not keep."""
        return self._send(op, flags, ledger_id, entry_id, key, aux, payload, callback, ctx, timeout_s, borrow,
                          _monotonic() if self._clock is None else <double>self._clock())

    cdef bint _send(self, int op, int flags, uint64_t ledger_id, int64_t entry_id, bytes key, uint32_t aux,
                    bytes payload, callback, ctx, double timeout_s, bint borrow, double sent) except -1:
        """send(), sent at `sent` (CLOCK_MONOTONIC seconds: a batch reads the clock once)."""
        if PyBytes_GET_SIZE(key) != KEY_LEN:
            raise ValueError("master_key must be 20 bytes")
        cdef Py_ssize_t plen = PyBytes_GET_SIZE(payload)
        cdef Py_ssize_t old = PyByteArray_GET_SIZE(self._out)
        cdef uint64_t rid = self._next_id
        self._next_id += 1
        PyByteArray_Resize(self._out, old + REQ_HEADER + plen)
        put_request(<uint8_t*>PyByteArray_AS_STRING(self._out) + old, op, flags, rid, ledger_id, entry_id,
                    PyBytes_AS_STRING(key), aux, PyBytes_AS_STRING(payload), plen)
        self._pending[rid] = (callback, ctx, sent + timeout_s, borrow, sent)
        if timeout_s < self._min_timeout:
            self._min_timeout = timeout_s
        if not self.connected:
            return True
        if old == 0:
            self._schedule_flush()
        elif old + REQ_HEADER + plen >= self._eager_bytes:
            self._flush_now()
        return False

    def take(self):
        """The queued frames as one buffer (None if none); the outbox starts empty again."""
        if PyByteArray_GET_SIZE(self._out) == 0:
            return None
        out = self._out
        self._out = bytearray()
        return out

    def discard_outbox(self) -> None:
        """Drop queued frames (their requests were failed: the connection never came up)."""
        self._out = bytearray()

    def get_buffer(self, Py_ssize_t sizehint=-1):
        """Free space at the end of the receive buffer, at least READ_CHUNK bytes: the partial
        frame left by the last read is moved to the front first (at most one frame's bytes)
        and the buffer grows only for a frame bigger than what it holds. Nothing else may
        hold a view of the buffer when this is called (borrowed payloads are released by then)."""
        cdef Py_ssize_t held = self._rend - self._rstart
        cdef Py_ssize_t cap
        cdef char* grown
        if held == 0:
            self._rstart = self._rend = 0
            if self._rcap > 4 * RECV_INITIAL:  # a huge frame passed: give the memory back
                free(self._rbuf)
                self._rbuf = NULL
                self._rcap = 0
        if self._rcap - self._rend < READ_CHUNK:
            if self._rstart:
                memmove(self._rbuf, self._rbuf + self._rstart, held)
                self._rstart, self._rend = 0, held
            if self._rcap - self._rend < READ_CHUNK:
                cap = max(RECV_INITIAL, 2 * self._rcap, self._rend + READ_CHUNK)
                grown = <char*>realloc(self._rbuf, cap)
                if grown == NULL:
                    raise MemoryError()
                self._rbuf, self._rcap = grown, cap
        return PyMemoryView_FromMemory(self._rbuf + self._rend, self._rcap - self._rend, PyBUF_WRITE)

    def buffer_updated(self, Py_ssize_t nbytes) -> None:
        """nbytes arrived in the space get_buffer() offered: dispatch every complete response
        (a partial frame stays for the next read). Raises FrameError on a response that can
        never parse (the connection must close)."""
        if nbytes < 0 or nbytes > self._rcap - self._rend:
            raise ValueError(f"buffer_updated({nbytes}) past the {self._rcap - self._rend} bytes offered")
        self._rend += nbytes
        cdef uint64_t generation = self._generation
        cdef Py_ssize_t used = self._dispatch(<const uint8_t*>self._rbuf + self._rstart, self._rend - self._rstart)
        if self._generation == generation:  # else fail_all emptied the pipe from a callback
            self._rstart += used

    def feed(self, data) -> None:
        """buffer_updated() for bytes that arrived elsewhere (tests, the in-process echo of
        `bk bench client`): copied into the receive buffer, then dispatched."""
        cdef const uint8_t[::1] src = data
        cdef Py_ssize_t off = 0
        cdef Py_ssize_t n = src.shape[0]
        cdef Py_ssize_t room
        while off < n:
            self.get_buffer()
            room = min(n - off, self._rcap - self._rend)
            memcpy(self._rbuf + self._rend, &src[off], room)
            self.buffer_updated(room)
            off += room

    cdef Py_ssize_t _dispatch(self, const uint8_t* base, Py_ssize_t n) except -1:
        cdef list progressed = []
        try:
            return self._dispatch_frames(base, n, progressed)
        finally:
            for sink in progressed:
                (<AckSink>sink).queued = False
                try:
                    (<AckSink>sink)._progress()
                except Exception:
                    _log.exception("add progress callback failed")

    cdef Py_ssize_t _dispatch_frames(self, const uint8_t* base, Py_ssize_t n, list progressed) except -1:
        cdef Py_ssize_t pos = 0
        cdef Py_ssize_t flen
        cdef const uint8_t* p
        cdef int status
        cdef uint64_t rid
        cdef uint64_t generation = self._generation
        cdef AckSink sink
        cdef double now = -1.0  # read once per buffer, at its first acknowledged entry: when it arrived
        while pos < n:
            p = base + pos
            flen = frame_len(p, n - pos, RESP_HEADER, self._max_frame)
            if flen == FRAME_INCOMPLETE:
                break
            if flen < 0:
                raise FrameError(frame_error(flen, p, RESP_HEADER, self._max_frame))
            pos += flen
            rid = get_u64(p + 8)
            entry = self._pending.pop(rid, None)
            if entry is None:
                continue  # timed out earlier, or failed with the connection
            callback, ctx, _, borrow, _ = <tuple>entry
            if type(callback) is AckSink and p[6] == 0 and p[7] == 0:  # an OK add: counted in C
                sink = <AckSink>callback
                try:
                    if sink._ack(<tuple>ctx, &now) and not sink.queued:
                        sink.queued = True
                        progressed.append(sink)
                except Exception:
                    _log.exception("add acknowledgement failed")
                continue
            view = None
            if borrow and flen > RESP_HEADER:
                view = PyMemoryView_FromMemory(<char*>(p + RESP_HEADER), flen - RESP_HEADER, PyBUF_READ)
                resp = response_tuple(p, flen, view)
            else:
                resp = response_tuple(p, flen, None)
            status = resp[1]
            try:
                callback(ctx, resp, None if status == 0 else self._error(status, resp[6]))
            except Exception:
                _log.exception("response callback failed")
            if view is not None:
                del resp
                try:
                    view.release()
                except BufferError:
                    _log.error("a response callback kept a view of a borrowed payload")
            if self._generation != generation:
                break
        return pos

    cdef object _error(self, int status, object payload):
        """error_for(status), or error_for(status, payload) when the error response carries a
        payload (the bookie's reason, UTF-8): only error responses come here, so OK ones pay
        nothing for it."""
        if len(payload) == 0:
            return self._error_for(status)
        return self._error_for(status, payload)

    def expire(self, double now, error) -> None:
        """Fail the requests whose deadline passed with error(), a fresh BKError each.

        Looks at the oldest pending requests only: the pending dict is in send order, and no
        request sent after one with sent + min_timeout > now can be due yet, so a sweep stops
        there (usually at the first request) instead of visiting every pending one.
        """
        cdef list late = []
        cdef tuple entry
        for rid, value in self._pending.items():
            entry = <tuple>value
            if <double>entry[4] + self._min_timeout > now:
                break
            if <double>entry[2] < now:
                late.append(rid)
        for rid in late:
            value = self._pending.pop(rid, None)
            if value is not None:
                (<tuple>value)[0]((<tuple>value)[1], None, error())

    def fail_all(self, err) -> None:
        """Fail every outstanding request with err (the connection is gone)."""
        pending, self._pending = self._pending, {}
        self._rstart = self._rend = 0
        self._generation += 1
        for callback, ctx, _, _, _ in pending.values():
            callback(ctx, None, err)


cdef class AckSink:
    """A write handle's add callback whose OK responses the pipe counts in C.

    Why: at Qw=2 every entry gets two responses; through Python each cost a response tuple
    and a call into the handle. An OK add response only sets a bit in the tracker and may
    acknowledge a run of entries (resolving their futures, in C): RequestPipe does that
    itself and, once per receive buffer in which some entry of this handle became
    acknowledged, makes progress (_progress): it wakes `room` (a future a waiter for room or
    for the last acknowledgement set), joins `lacs` (the client's LacQueue, None for a
    handle that sends no explicit LAC) and calls on_progress() unless it is None.
    Everything else (errors, timeouts, a lost connection) calls the sink like any callback,
    and it hands that to on_response(ctx, resp, err), or with an owner to
    on_response(owner, ctx, resp, err) while the owner lives; an OK response reaching it
    that way is acknowledged here too (progress at once). ctx is (entry_id, ensemble slot,
    bookie). The bookies being replaced, whose OK responses do not count, are the tracker's
    failed_bookies (failed_bookies, unless None, becomes that set).

    Why an owner held weakly (a write handle: `owner` is a weakref.ref to it): a sink holding
    the handle's bound methods, held by the handle, made every handle a reference cycle,
    freed only by the cyclic GC (never once gc.freeze() froze it); and the handle in every
    request's ctx instead made those tuples, atoms only before, objects the GC tracks (at
    W=4000, twice the objects each young collection walked and promoted).
    """

    cdef AddTracker tracker
    cdef object on_response
    cdef object on_progress
    cdef object owner
    cdef object pinned        # the owner itself while it has adds outstanding (see _pin)
    cdef object core
    cdef LacQueue lacs
    cdef public object room
    cdef int64_t lac_mark     # the tracker's next entry id when the sink joined `lacs`
    cdef readonly bint lac_queued
    cdef bint queued

    def __init__(self, AddTracker tracker, failed_bookies, on_response, on_progress=None, *, owner=None,
                 core=None, LacQueue lacs=None):
        """owner: a weakref.ref to the handle (on_response gets it first); core: the handle's
        WriterCore (its `writing` is read when the LAC queue visits the handle). lacs needs both."""
        if lacs is not None and (core is None or owner is None):
            raise ValueError("a sink in a LAC queue needs its writer's core and owner")
        self.tracker = tracker
        if failed_bookies is not None:
            tracker.failed_bookies = failed_bookies
        self.on_response = on_response
        self.on_progress = on_progress
        self.owner = owner
        self.pinned = None
        self.core = core
        self.lacs = lacs
        self.room = None
        self.lac_mark = -1
        self.lac_queued = False
        self.queued = False

    cdef Py_ssize_t _ack(self, tuple ctx, double* now) except -1:
        """An OK response for ctx: how many entries became acknowledged (the tracker ignores a
        slot re-sent elsewhere since, or a bookie being replaced). now: as for _advance."""
        cdef Py_ssize_t n = self.tracker._ack_from(ctx[0], ctx[1], ctx[2], self.tracker.failed_bookies, now)
        if n and self.lacs is not None:
            self.lacs.acked += n
        return n

    cdef inline void _pin(self) noexcept:
        """Hold the owner strongly while it has adds outstanding: an application may drop a
        handle and still await its adds, and an error or timeout for one of them needs the
        handle (a bookie replaced, the entry re-sent, or the add failed); through the weak
        reference alone those adds never resolved. Dropped when none is outstanding (_settled),
        so an idle handle is again no reference cycle."""
        if self.pinned is None and self.owner is not None:
            self.pinned = <object>PyWeakref_GetObject(self.owner)

    cdef inline void _settled(self) noexcept:
        if self.pinned is not None and self.tracker._count == 0:
            self.pinned = None

    def pin(self) -> None:
        """_pin, for adds sent outside AddTracker.send_entries."""
        self._pin()

    def unpin(self) -> None:
        """Let the owner go though adds are outstanding (its adds have all been failed)."""
        self.pinned = None

    @property
    def pinned_owner(self):
        """The owner while pinned, else None (tests)."""
        return self.pinned

    cdef int _progress(self) except -1:
        """Entries became acknowledged."""
        self._settled()
        room = self.room
        if room is not None:
            self.room = None
            if not room.done():
                room.set_result(None)
        if self.lacs is not None and not self.lac_queued:
            self.lacs._join(self)
        if self.on_progress is not None:
            self.on_progress()
        return 0

    def __call__(self, ctx, resp, err):
        cdef double now = -1.0
        if err is None:
            if self._ack(<tuple?>ctx, &now):
                self._progress()
            return None
        if self.owner is None:
            return self.on_response(ctx, resp, err)
        owner = <object>PyWeakref_GetObject(self.owner)
        if owner is None:  # gone with nothing outstanding (else _pin holds it): nobody to tell
            return None
        try:
            return self.on_response(owner, ctx, resp, err)
        finally:
            self._settled()


# -- explicit LAC -------------------------------------------------------------------
cdef enum:
    STEP_NOTHING = 0  # the bookies know the LAC, or the handle no longer writes
    STEP_REARM = 1    # adds were sent since the handle joined: the next one piggybacks the LAC
    STEP_SEND = 2     # idle: send WRITE_LAC to the last acknowledged entry's write set

LAC_NOTHING, LAC_REARM, LAC_SEND = STEP_NOTHING, STEP_REARM, STEP_SEND


cdef inline int _lac_step(bint writing, int64_t lac, int64_t lac_told, int64_t adds_sent,
                          int64_t adds_at_arm) noexcept:
    if not writing or lac <= lac_told:
        return STEP_NOTHING
    if adds_sent != adds_at_arm:
        return STEP_REARM
    return STEP_SEND


def lac_step_code(bint writing, int64_t lac, int64_t lac_told, int64_t adds_sent, int64_t adds_at_arm) -> int:
    """The explicit-LAC decision (bookkeeper.client.core.writer.lac_step says why), as LAC_*:
    the one implementation, which LacQueue.tick runs in C for every handle it visits."""
    return _lac_step(writing, lac, lac_told, adds_sent, adds_at_arm)


cdef class LacQueue:
    """The write handles of one client whose LAC moved since the bookies were last told it
    (their sinks), oldest first (client loop only; bookkeeper/client/lac_wheel.py ticks it).

    A handle joins from C when an acknowledgement moves its LAC (AckSink._progress), once
    until it is visited; it is visited at the second tick after it joined (between one and
    two ticks later), where _lac_step decides: nothing (dropped), re-arm (adds were sent
    since it joined: it joins again) or send. At most `budget` sends per tick: the rest wait,
    in order, for the next. Why in C: with many handles each written less often than the
    interval, every add makes its handle join and be visited once; in Python that was a
    call per add, on a path that costs a few microseconds an add in all. Why two lists kept
    for the queue's life, changed in place: a new list of 10^4 handles each tick was young,
    and every young collection of the cyclic GC walked it, touching every queued handle.
    """

    cdef list _incoming   # sinks joined since the last tick
    cdef list _ready      # sinks joined before the last tick: visited at the next
    cdef object _arm
    cdef public uint64_t acked  # entries acknowledged on the handles of this queue (the budget's measure)

    def __init__(self, arm):
        """arm(): called when a handle joins an empty queue (a tick must come)."""
        self._incoming = []
        self._ready = []
        self._arm = arm
        self.acked = 0

    cdef int _join(self, AckSink sink) except -1:
        if not self._incoming and not self._ready:
            self._arm()
        sink.lac_queued = True
        sink.lac_mark = sink.tracker._next_id()
        self._incoming.append(sink)
        return 0

    @property
    def queued(self) -> int:
        """Handles waiting for a tick."""
        return len(self._incoming) + len(self._ready)

    def tick(self, Py_ssize_t budget) -> list:
        """Visit the handles due, oldest first, until `budget` of them are to send: returns
        [handle, lac, handle, lac, ...] of those (their tracker's lac_told is set to it: the
        caller sends WRITE_LAC now; a handle dropped meanwhile is skipped). Those past the
        budget stay first in line."""
        cdef list ready = self._ready
        cdef list incoming = self._incoming
        cdef list out = []
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t n = len(ready)
        cdef AckSink sink
        cdef AddTracker t
        cdef int64_t lac, nxt
        cdef int step
        while i < n and budget > 0:
            sink = <AckSink>ready[i]
            i += 1
            t = sink.tracker
            lac = t.lac
            nxt = t._next_id()
            step = _lac_step(True, lac, t.lac_told, nxt, sink.lac_mark)
            # `writing` (a Python property) is asked only where it decides: a handle that no
            # longer writes may be re-armed once or twice more (its tracker settles), then dropped.
            if step == STEP_SEND and not sink.core.writing:
                step = STEP_NOTHING
            if step == STEP_REARM:
                sink.lac_mark = nxt
                incoming.append(sink)
                continue
            sink.lac_queued = False
            if step == STEP_SEND:
                handle = <object>PyWeakref_GetObject(sink.owner)
                if handle is None:
                    continue
                t.lac_told = lac
                out.append(handle)
                out.append(lac)
                budget -= 1
        del ready[:i]
        ready += incoming
        del incoming[:]
        return out

    def clear(self) -> None:
        """Forget every queued handle (explicit LACs are off now, or the client closed)."""
        for queued in (self._incoming, self._ready):
            for sink in queued:
                (<AckSink>sink).lac_queued = False
            del queued[:]


# -- add tracker --------------------------------------------------------------------
cdef enum:
    RING_INITIAL = 4  # a new tracker's ring (entries): most handles have few adds in flight; it doubles as needed
    OBJS = 3          # Python objects per ring slot in _objs: future, payload, where each ensemble slot was sent


cdef struct Slot:
    uint64_t acked   # bitmask of ensemble slots that acknowledged
    uint64_t failed  # ... and that refused or lost the entry
    int64_t size     # data bytes
    double sent_at   # seconds at add (the tracker's clock)


cdef frozenset _NO_FAILED = frozenset()
cdef dict _WRITE_SETS = {}  # (E, Qw) -> each entry's write set by entry id mod E, shared by every tracker


cdef tuple _write_sets(int e, int qw):
    """The write sets of an E/Qw ledger (at most 64 x 64 shapes: bounded)."""
    key = (e, qw)
    sets = _WRITE_SETS.get(key)
    if sets is None:
        sets = _WRITE_SETS[key] = tuple([tuple([(first + i) % e for i in range(qw)]) for first in range(e)])
    return <tuple>sets


cdef class AddTracker:
    """Acknowledgement state of a write handle's outstanding adds (client loop only).

    Entries are added in id order and stay in a ring from LAC + 1 on, each with its
    future, its encoded payload, the bookie each ensemble slot was last sent to,
    bitmasks of the slots that acked or failed, and its send time. An entry is
    acknowledged once Qa slots of its write set acked and every entry before it is
    acknowledged: ack() then resolves the futures of the whole newly acknowledged run, in
    order, and observes each one's latency (first send to acknowledgement, resends after
    an ensemble change included: what the caller waited) into `latency` unless it is None.
    (Reference: Apache BookKeeper, PendingAddOp / RoundRobinDistributionSchedule.)

    Memory: the ring starts at RING_INITIAL entries and doubles when full (its capacity, a
    power of two, is kept: a handle that had many adds in flight will again); it is taken
    with PyMem_Malloc, so tracemalloc counts it. The write sets are shared by every tracker
    of the same E/Qw. A client with 10^4 open handles holds 10^4 of these (issue 26).
    """

    cdef readonly int e, qw, qa
    cdef public int64_t lac
    cdef public int64_t length
    cdef readonly int64_t sent_length  # the ledger's length after the last entry added (each entry's length field)
    cdef public int64_t lac_told  # the LAC the bookies were last told: piggybacked on an add, or explicit
    cdef public object failed_bookies  # bookies being replaced (their OKs do not count): a set, or an empty frozenset
    cdef Py_ssize_t _cap, _head, _count
    cdef Slot* _slots
    cdef LatencyHistogram _latency
    cdef list _objs  # OBJS per ring slot
    cdef tuple _write_sets
    cdef object _clock

    def __cinit__(self, *, int ensemble_size, int write_quorum, int ack_quorum, int64_t lac=-1,
                  int64_t length=0, LatencyHistogram latency=None, clock=None):
        """clock: seconds now, for add times and latencies (None: CLOCK_MONOTONIC read in C)."""
        if not (1 <= ack_quorum <= write_quorum <= ensemble_size):
            raise ValueError(f"need 1 <= Qa <= Qw <= E, got E={ensemble_size} Qw={write_quorum} Qa={ack_quorum}")
        if ensemble_size > MAX_ENSEMBLE:
            raise ValueError(f"ensemble of {ensemble_size} bookies exceeds the maximum of {MAX_ENSEMBLE}")
        self.e, self.qw, self.qa = ensemble_size, write_quorum, ack_quorum
        self.lac = lac
        self.lac_told = lac
        self.failed_bookies = _NO_FAILED
        self.length = length
        self.sent_length = length
        self._latency = latency
        self._clock = clock
        self._cap = 0
        self._head = 0
        self._count = 0
        self._slots = NULL
        self._objs = []
        self._write_sets = _write_sets(ensemble_size, write_quorum)
        self._grow(RING_INITIAL)

    def __dealloc__(self):
        PyMem_Free(self._slots)

    cdef int _grow(self, Py_ssize_t cap) except -1:
        """Re-lay the ring, oldest first, into cap slots (a power of two)."""
        cdef Slot* slots = <Slot*>PyMem_Malloc(cap * sizeof(Slot))
        if slots == NULL:
            raise MemoryError()
        cdef Py_ssize_t i, src
        cdef list objs = [None] * (OBJS * cap)
        for i in range(self._count):
            src = (self._head + i) & (self._cap - 1)
            slots[i] = self._slots[src]
            objs[OBJS * i:OBJS * i + OBJS] = self._objs[OBJS * src:OBJS * src + OBJS]
        PyMem_Free(self._slots)
        self._slots = slots
        self._objs = objs
        self._cap = cap
        self._head = 0
        return 0

    cdef inline Py_ssize_t _slot(self, int64_t entry_id) noexcept:
        """Ring position of an outstanding entry, -1 if it is not outstanding."""
        cdef int64_t off = entry_id - self.lac - 1
        if off < 0 or off >= self._count:
            return -1
        return (self._head + <Py_ssize_t>off) & (self._cap - 1)

    cdef inline int64_t _next_id(self) noexcept:
        """The id the next entry added gets: it moves with every add, so it also counts them."""
        return self.lac + 1 + self._count

    cdef inline double _now(self) except? -1.0:
        return _monotonic() if self._clock is None else <double>self._clock()

    cdef inline bint _in_write_set(self, int64_t entry_id, int idx) noexcept:
        return 0 <= idx < self.e and (idx - entry_id % self.e + self.e) % self.e < self.qw

    @property
    def outstanding(self) -> int:
        return self._count

    @property
    def next_id(self) -> int:
        """The id the next entry added gets (LAC + 1 + outstanding)."""
        return self._next_id()

    @property
    def capacity(self) -> int:
        """Entries the ring holds before it grows (RING_INITIAL, doubled at each growth)."""
        return self._cap

    def add(self, int64_t entry_id, int64_t size, future=None, payload=None, list ensemble=None) -> tuple:
        """Register the next entry (ids in order from LAC + 1); returns its write set.

        With ensemble, each write-set slot is marked as sent to that ensemble's bookie
        (the list is shared, not copied: mark_sent copies before it changes a slot).
        """
        return self._add(entry_id, size, future, payload, ensemble, self._now())

    def send_entries(self, list datas, int64_t first_entry, int64_t piggyback_lac, int kind, bytes mac_key,
                     uint64_t ledger_id, bytes key, int flags, list ensemble, list pipes, sink, double timeout_s,
                     last_future) -> list:
        """Encode, register and send a batch of entries with consecutive ids from first_entry
        (next_id): the write handle's add_entries path in one C loop (the per-entry Python it
        replaces cost ~1.5 us an entry). pipes[i] is the RequestPipe of ensemble slot i (all
        routable); each entry's length field continues from sent_length, and its piggybacked
        LAC (recorded as lac_told) is piggyback_lac; only the last entry gets a future.
        Returns the slots whose pipe is not connected."""
        cdef Py_ssize_t i, n = len(datas)
        cdef int64_t entry_id
        cdef int64_t length = self.sent_length
        cdef tuple ws
        cdef bytes data, payload
        cdef uint64_t unconnected = 0
        cdef double now = self._now()  # once per batch: its requests and entries are sent in this call
        if len(pipes) != self.e:
            raise ValueError(f"{len(pipes)} pipes for a ledger of ensemble size {self.e}")
        self.lac_told = piggyback_lac
        for i in range(n):
            data = <bytes?>datas[i]
            entry_id = first_entry + i
            length += PyBytes_GET_SIZE(data)
            payload = _encode_entry(kind, mac_key, ledger_id, entry_id, piggyback_lac, <uint64_t>length, data)
            ws = self._add(entry_id, PyBytes_GET_SIZE(data), last_future if i == n - 1 else None, payload, ensemble,
                           now)
            if i == 0 and isinstance(sink, AckSink):
                (<AckSink>sink)._pin()  # once an add is outstanding: a refused one leaves no pin
            for idx in ws:
                if (<RequestPipe?>pipes[idx])._send(OP_ADD, flags, ledger_id, entry_id, key, 0, payload, sink,
                                                   (entry_id, idx, ensemble[idx]), timeout_s, False, now):
                    unconnected |= (<uint64_t>1) << <int>idx
        return [i for i in range(self.e) if unconnected >> i & 1]

    cdef tuple _add(self, int64_t entry_id, int64_t size, future, payload, list ensemble, double sent_at):
        if entry_id != self.lac + 1 + self._count:
            raise ValueError(f"entry {entry_id} added out of order (expected {self.lac + 1 + self._count})")
        if ensemble is not None and len(ensemble) != self.e:
            raise ValueError(f"ensemble of {len(ensemble)} bookies for a ledger of ensemble size {self.e}")
        if self._count == self._cap:
            self._grow(self._cap * 2)
        cdef Py_ssize_t pos = (self._head + self._count) & (self._cap - 1)
        self._count += 1
        self.sent_length += size
        self._slots[pos] = Slot(0, 0, size, sent_at)
        self._objs[OBJS * pos] = future
        self._objs[OBJS * pos + 1] = payload
        self._objs[OBJS * pos + 2] = ensemble if ensemble is not None else [None] * self.e
        return <tuple>self._write_sets[entry_id % self.e]

    def ack(self, int64_t entry_id, int idx) -> list:
        """Ensemble slot idx stored entry_id durably.

        Returns the newly acknowledged run as (entry_id, ledger length after it), having
        resolved each one's future with its id.
        """
        cdef Py_ssize_t pos = self._slot(entry_id)
        if pos < 0 or not self._in_write_set(entry_id, idx):
            return []
        self._slots[pos].acked |= (<uint64_t>1) << idx
        cdef list done = []
        cdef double now = -1.0
        self._advance(done, &now)
        return done

    def ack_from(self, int64_t entry_id, int idx, bookie, failed_bookies) -> int:
        """ack() of a response from bookie, unless that slot was re-sent elsewhere since or
        bookie is being replaced; returns how many entries became acknowledged."""
        cdef double now = -1.0
        return self._ack_from(entry_id, idx, bookie, failed_bookies, &now)

    cdef Py_ssize_t _ack_from(self, int64_t entry_id, int idx, object bookie, object failed_bookies,
                              double* now) except -1:
        cdef Py_ssize_t pos = self._slot(entry_id)
        if pos < 0 or not self._in_write_set(entry_id, idx):
            return 0
        if (<list>self._objs[OBJS * pos + 2])[idx] != bookie or (
                failed_bookies is not _NO_FAILED and failed_bookies and bookie in failed_bookies):
            return 0
        self._slots[pos].acked |= (<uint64_t>1) << idx
        return self._advance(None, now)

    cdef Py_ssize_t _advance(self, list done, double* now) except -1:
        """Acknowledge the run of entries from LAC + 1 with Qa acks, resolving their futures
        and observing their latencies; (entry, length) of each is appended to done unless it
        is None. Returns how many. now: the acknowledgement time, shared by the caller's
        calls (RequestPipe: one receive buffer); read from the clock here, at the first
        entry to observe, while it is negative."""
        cdef Py_ssize_t count = 0
        cdef Py_ssize_t pos
        cdef uint64_t bits
        cdef int n
        while self._count:
            pos = self._head
            bits = self._slots[pos].acked
            n = 0
            while bits:
                bits &= bits - 1
                n += 1
            if n < self.qa:
                break
            self.lac += 1
            self.length += self._slots[pos].size
            if self._latency is not None:
                if now[0] < 0.0:
                    now[0] = self._now()
                self._latency._observe(now[0] - self._slots[pos].sent_at)
            fut = self._objs[OBJS * pos]
            self._objs[OBJS * pos] = None
            self._objs[OBJS * pos + 1] = None
            self._objs[OBJS * pos + 2] = None
            self._head = (pos + 1) & (self._cap - 1)
            self._count -= 1
            count += 1
            if done is not None:
                done.append((self.lac, self.length))
            if fut is not None and not fut.done():
                fut.set_result(self.lac)
        return count

    def fail(self, int64_t entry_id, int idx) -> bool:
        """Slot idx refused or lost entry_id. True if the entry can no longer reach Qa."""
        cdef Py_ssize_t pos = self._slot(entry_id)
        if pos < 0 or not self._in_write_set(entry_id, idx):
            return False
        self._slots[pos].failed |= (<uint64_t>1) << idx
        cdef uint64_t bits = self._slots[pos].failed
        cdef int n = 0
        while bits:
            bits &= bits - 1
            n += 1
        return self.qw - n < self.qa

    def reset(self, int64_t entry_id, int idx) -> None:
        """The bookie at slot idx was replaced: its ack or failure no longer counts."""
        cdef Py_ssize_t pos = self._slot(entry_id)
        if pos >= 0 and 0 <= idx < self.e:
            self._slots[pos].acked &= ~((<uint64_t>1) << idx)
            self._slots[pos].failed &= ~((<uint64_t>1) << idx)

    def mark_sent(self, int64_t entry_id, int idx, bookie) -> None:
        """Slot idx of entry_id was (re)sent to bookie: only its response counts from now on."""
        cdef Py_ssize_t pos = self._slot(entry_id)
        cdef list sent
        if pos >= 0 and 0 <= idx < self.e:
            sent = list(self._objs[OBJS * pos + 2])
            sent[idx] = bookie
            self._objs[OBJS * pos + 2] = sent

    def sent_to(self, int64_t entry_id) -> list:
        """The bookie each ensemble slot of entry_id was last sent to (None: not sent); [] if settled."""
        cdef Py_ssize_t pos = self._slot(entry_id)
        if pos < 0:
            return []
        cdef list sent = <list>self._objs[OBJS * pos + 2]
        return [sent[i] if self._in_write_set(entry_id, i) else None for i in range(self.e)]

    def is_current(self, int64_t entry_id, int idx, bookie) -> bool:
        """Whether entry_id is outstanding and slot idx was last sent to bookie."""
        cdef Py_ssize_t pos = self._slot(entry_id)
        return pos >= 0 and 0 <= idx < self.e and (<list>self._objs[OBJS * pos + 2])[idx] == bookie

    def payload(self, int64_t entry_id):
        """The encoded payload of an outstanding entry (for a resend)."""
        cdef Py_ssize_t pos = self._slot(entry_id)
        if pos < 0:
            raise KeyError(entry_id)
        return self._objs[OBJS * pos + 1]

    def pending_ids(self) -> list:
        """Outstanding entry ids in order."""
        return list(range(self.lac + 1, self.lac + 1 + self._count))

    def drop_all(self) -> list:
        """Forget every outstanding entry (the handle failed); returns (entry_id, future) in order."""
        cdef Py_ssize_t i, pos
        out = []
        for i in range(self._count):
            pos = (self._head + i) & (self._cap - 1)
            out.append((self.lac + 1 + i, self._objs[OBJS * pos]))
            self._objs[OBJS * pos] = None
            self._objs[OBJS * pos + 1] = None
            self._objs[OBJS * pos + 2] = None
        self._count = 0
        self._head = 0
        self.sent_length = self.length
        return out
