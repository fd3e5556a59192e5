# A lock in C: threading.Lock's interface for Python, and a take and a give that compiled
# callers make without a call (the plain server's of a manager's lock, the key lane's of
# the idle connections' pool).  Included by _compiled.pyx, before plain_server.pxi (which
# takes it).
#
# A Python lock's non-blocking acquire costs a call, its arguments' parsing and a clock
# read; so does CPython's PyThread_acquire_lock(lock, 0), which reads the monotonic clock
# and converts a deadline even when it does not wait (a tenth of a TCP put's user time in
# the client, which takes and gives the pool's lock twice).  This lock is a POSIX
# semaphore of its own (any thread may release it, as threading.Lock allows): a take is
# one sem_trywait, a give one sem_post; a timed wait counts on the monotonic clock
# (sem_clockwait) where the C library has it, as CPython's lock does.

cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass
    int sem_init(sem_t* sem, int pshared, unsigned int value)
    int sem_destroy(sem_t* sem)
    int sem_trywait(sem_t* sem)
    int sem_wait(sem_t* sem)
    int sem_post(sem_t* sem)

cdef extern from "<errno.h>":
    int ETIMEDOUT

cdef extern from *:
    """
    #include <semaphore.h>
    #include <time.h>
    #include <errno.h>
    /* A wait for the semaphore of at most `seconds`: 0 taken, else its errno
       (ETIMEDOUT, EINTR). Counted on the monotonic clock where the C library has
       sem_clockwait (glibc 2.30), as CPython's own lock counts it; else on the wall
       clock (sem_timedwait), a wait then cut to DDICT_WALL_SLICE, so that a jump of
       that clock moves the end of one slice only: the caller waits again until its
       monotonic deadline. */
    #if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    #define DDICT_WALL_SLICE 1e300
    #define DDICT_SEM_CLOCK CLOCK_MONOTONIC
    #define DDICT_SEM_WAIT(sem, t) sem_clockwait((sem), CLOCK_MONOTONIC, (t))
    #else
    #define DDICT_WALL_SLICE 1.0
    #define DDICT_SEM_CLOCK CLOCK_REALTIME
    #define DDICT_SEM_WAIT(sem, t) sem_timedwait((sem), (t))
    #endif
    static int ddict_sem_wait_for(sem_t* sem, double seconds) {
        struct timespec t;
        double end;
        if (seconds > DDICT_WALL_SLICE)
            seconds = DDICT_WALL_SLICE;
        clock_gettime(DDICT_SEM_CLOCK, &t);
        end = (double)t.tv_sec + t.tv_nsec * 1e-9 + seconds;
        t.tv_sec = (time_t)end;
        t.tv_nsec = (long)((end - (double)t.tv_sec) * 1e9);
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec += 1;
            t.tv_nsec -= 1000000000L;
        }
        if (DDICT_SEM_WAIT(sem, &t) == 0)
            return 0;
        return errno;
    }
    """
    int ddict_sem_wait_for(sem_t* sem, double seconds) nogil

cdef extern from "Python.h":
    void* PyMem_RawMalloc(size_t n) nogil
    void PyMem_RawFree(void* p) nogil

cdef double _MOST_WAIT = threading.TIMEOUT_MAX  # (seconds: threading.Lock's bound)


cdef sem_t* _new_semaphore() except NULL:
    """A free semaphore of this process (PyMem_RawFree'd after sem_destroy)."""
    cdef sem_t* sem = <sem_t*>PyMem_RawMalloc(sizeof(sem_t))
    cdef int err
    if sem == NULL:
        raise MemoryError()
    if sem_init(sem, 0, 1):
        err = errno
        PyMem_RawFree(sem)
        raise OSError(err, os.strerror(err))
    return sem


@cython.final  # (the plain server takes it by its exact type)
cdef class ManagerLock:
    """``threading.Lock``, whose non-blocking take is a C call for compiled callers."""

    cdef sem_t* sem
    cdef bint held
    cdef object __weakref__  # (as threading.Lock's)

    def __cinit__(self):
        self.sem = _new_semaphore()
        self.held = False

    def __dealloc__(self):
        if self.sem != NULL:
            sem_destroy(self.sem)
            PyMem_RawFree(self.sem)

    def __repr__(self):
        return f"<{'locked' if self.held else 'unlocked'} dask_ddict ManagerLock>"

    cdef inline bint take(self) noexcept:
        """Taken now (else held by some thread: nothing waited for)."""
        if sem_trywait(self.sem) == 0:
            self.held = True
            return True
        return False

    cdef inline void give(self) noexcept:
        """Released (the caller holds it)."""
        self.held = False
        sem_post(self.sem)

    def acquire(self, bint blocking=True, double timeout=-1):
        cdef int err
        cdef double deadline = 0, left = 1
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
            deadline = _monotonic() + timeout
        while True:  # (a signal's handler runs between waits, as CPython's lock does it)
            with nogil:
                if timeout < 0:
                    err = 0 if sem_wait(self.sem) == 0 else errno
                else:
                    left = deadline - _monotonic()
                    if left <= 0:
                        err = 0 if sem_trywait(self.sem) == 0 else ETIMEDOUT
                    else:
                        err = ddict_sem_wait_for(self.sem, left)
            if err == 0:
                self.held = True
                return True
            if err == EINTR:
                PyErr_CheckSignals()
            elif err != ETIMEDOUT:
                raise OSError(err, os.strerror(err))
            elif left <= 0:  # (else a wait timed out at or before the deadline: once more,
                return False  # a last take there, as CPython takes a lock given at the end)

    def release(self):
        if not self.held:
            raise RuntimeError("release unlocked lock")
        self.give()

    def locked(self):
        return self.held

    def _at_fork_reinit(self):
        """Free again in a forked child, as ``threading.Lock._at_fork_reinit`` does it: a
        new semaphore, the old one left as it was (a thread of the parent may have held
        it or waited on it: destroying it then is undefined)."""
        self.sem, self.held = _new_semaphore(), False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, exc_type, exc, tb):
        self.release()
