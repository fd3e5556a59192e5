# A lock in C: threading.Lock's interface for Python, and a take and a give that compiled
# callers make without a call (the plain server's of a manager's lock, the key lane's of
# the idle connections' pool).  Included by _compiled.pyx, before
# plain_server.pxi (which takes it).
#
# A Python lock's non-blocking acquire costs a call, its arguments' parsing and a clock
# read; the plain server's put takes and gives its manager's lock once each.  This is the
# same PyThread lock (a semaphore: any thread may release it, as threading.Lock allows),
# taken with one PyThread_acquire_lock(lock, 0).

cdef extern from "pythread.h":
    ctypedef void* PyThread_type_lock
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE
        PY_LOCK_ACQUIRED
        PY_LOCK_INTR
    PyThread_type_lock PyThread_allocate_lock()
    void PyThread_free_lock(PyThread_type_lock lock)
    int PyThread_acquire_lock(PyThread_type_lock lock, int waitflag) nogil
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds,
                                             int intr_flag) nogil
    void PyThread_release_lock(PyThread_type_lock lock) nogil

cdef double _MOST_WAIT = threading.TIMEOUT_MAX  # (seconds: threading.Lock's bound)


@cython.final  # (the plain server takes it by its exact type)
cdef class ManagerLock:
    """``threading.Lock``, whose non-blocking take is a C call for compiled callers."""

    cdef PyThread_type_lock lock
    cdef bint held

    def __cinit__(self):
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError()
        self.held = False

    def __dealloc__(self):
        if self.lock != NULL:
            if self.held:  # (as CPython's lock does: a semaphore is freed released)
                PyThread_release_lock(self.lock)
            PyThread_free_lock(self.lock)

    def __repr__(self):
        return f"<{'locked' if self.held else 'unlocked'} dask_ddict ManagerLock>"

    cdef inline bint take(self) noexcept:
        """Taken now (else held by some thread: nothing waited for)."""
        if PyThread_acquire_lock(self.lock, 0):
            self.held = True
            return True
        return False

    cdef inline void give(self) noexcept:
        """Released (the caller holds it)."""
        self.held = False
        PyThread_release_lock(self.lock)

    def acquire(self, bint blocking=True, double timeout=-1):
        cdef PyLockStatus r
        cdef long long us
        cdef double deadline = 0
        if timeout != timeout:
            raise ValueError("Invalid value NaN (not a number)")
        if not blocking and timeout != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if timeout < 0 and timeout != -1:
            raise ValueError("timeout value must be a non-negative number")
        if timeout > _MOST_WAIT:
            raise OverflowError("timeout value is too large")
        if self.take():
            return True
        if not blocking:
            return False
        if timeout >= 0:
            deadline = time.monotonic() + timeout
        while True:  # (a signal's handler runs between waits, as CPython's lock does it)
            us = -1 if timeout < 0 else <long long>(max(0.0, deadline - time.monotonic()) * 1e6)
            with nogil:
                r = PyThread_acquire_lock_timed(self.lock, us, 1)
            if r == PY_LOCK_ACQUIRED:
                self.held = True
                return True
            if r != PY_LOCK_INTR:
                return False
            PyErr_CheckSignals()

    def release(self):
        if not self.held:
            raise RuntimeError("release unlocked lock")
        self.give()

    def locked(self):
        return self.held

    def _at_fork_reinit(self):
        """Free again in a forked child, as ``threading.Lock._at_fork_reinit`` does it: a
        new lock, the old one left as it was (a thread of the parent may have held it;
        freeing a semaphore in that state is undefined)."""
        cdef PyThread_type_lock fresh = PyThread_allocate_lock()
        if fresh == NULL:
            raise MemoryError()
        self.lock, self.held = fresh, False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, exc_type, exc, tb):
        self.release()
