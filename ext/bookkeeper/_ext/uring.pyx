# cython: boundscheck=False, wraparound=False
"""The journal's io_uring: one O_DSYNC write per block, submitted and reaped in C.

Why in Cython: a lone add (W=1) pays the syncer once per block, and through
python-liburing's Python API that was ~15 Python calls (get_sqe, prep, flags and data per
SQE, submit; peek, the CQE's fields and advance per CQE) and an eventfd read per block.
Here a block is one call to `submit_write` and its completion one call to `reap`, and the
event loop watches the ring's own fd (readable while completions wait): no eventfd.

One SQE per block: a write with RWF_DSYNC (the kernel syncs the written range before it
completes: fdatasync semantics for those bytes) instead of a write linked to an fdatasync,
so one completion, not two. liburing's inline helpers come from python-liburing's .pxd
and headers; `io_uring_queue_init`, `io_uring_submit` and `io_uring_queue_exit` are its
cpdef functions (C calls through its module), since they are not inline.
"""
from libc.errno cimport EBUSY
from liburing.lib.uring cimport *
from liburing.queue cimport io_uring, io_uring_queue_exit, io_uring_queue_init, io_uring_submit

cdef extern from *:
    """
    #ifndef RWF_DSYNC
    #define RWF_DSYNC 0x00000002
    #endif
    static inline void bk_prep_write_dsync(struct io_uring_sqe *sqe, int fd, const void *buf,
                                           unsigned nbytes, unsigned long long offset) {
        io_uring_prep_write(sqe, fd, buf, nbytes, offset);
        sqe->rw_flags = RWF_DSYNC;
    }
    /* The next completion, or NULL: never enters the kernel (io_uring_peek_cqe would, through a
       function python-liburing does not export, and the loop only reaps when the fd is readable). */
    static inline struct io_uring_cqe *bk_peek_cqe(struct io_uring *ring) {
        struct io_uring_cqe *cqe = NULL;
        if (__io_uring_peek_cqe(ring, &cqe, NULL) < 0)
            return NULL;
        return cqe;
    }
    """
    void bk_prep_write_dsync(__io_uring_sqe* sqe, int fd, const void* buf, unsigned nbytes,
                             unsigned long long offset) nogil
    __io_uring_cqe* bk_peek_cqe(__io_uring* ring) nogil


cdef class Ring:
    """An io_uring for durable block writes (one event loop thread uses it).

    The caller keeps each submitted buffer alive and unresized (a memoryview of a bytearray
    pins it) until `reap` has returned the write's token.
    """

    cdef io_uring _ring
    cdef readonly int fd
    cdef bint _open

    def __cinit__(self, unsigned int entries=64) -> None:
        self._ring = io_uring()
        io_uring_queue_init(entries, self._ring, 0)  # raises the OSError of a failed setup
        self._open = True
        self.fd = self._ring.ptr.ring_fd

    def submit_write(self, int fd, const unsigned char[::1] buf, unsigned long long offset,
                     unsigned long long token) -> None:
        """Write buf at offset and sync it (RWF_DSYNC); token comes back from reap."""
        if not self._open:
            raise ValueError("ring is closed")
        if buf.shape[0] == 0:
            raise ValueError("an empty write")
        cdef __io_uring_sqe* sqe = __io_uring_get_sqe(&self._ring.ptr)
        if sqe == NULL:
            raise OSError(EBUSY, "journal ring: no free submission entry")
        bk_prep_write_dsync(sqe, fd, &buf[0], <unsigned>buf.shape[0], offset)
        __io_uring_sqe_set_data64(sqe, token)
        io_uring_submit(self._ring)

    def reap(self) -> list:
        """Every completion waiting: [(token, result)], result = bytes written or -errno."""
        cdef __io_uring_cqe* cqe
        cdef list done = []
        if not self._open:
            return done
        while True:
            cqe = bk_peek_cqe(&self._ring.ptr)
            if cqe == NULL:
                break
            done.append((__io_uring_cqe_get_data64(cqe), cqe.res))
            __io_uring_cq_advance(&self._ring.ptr, 1)
        return done

    def close(self) -> None:
        """Unmap the ring and close its fd; reap returns nothing after this."""
        if self._open:
            self._open = False
            io_uring_queue_exit(self._ring)

    def __dealloc__(self) -> None:
        if self._open:  # not closed by its owner: the ring's fd and mappings are not left behind
            self._open = False
            io_uring_queue_exit(self._ring)
