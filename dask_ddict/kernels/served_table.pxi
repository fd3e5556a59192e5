# A connection's requests served, by manager and operation, counted in C fields: a row
# of counters per manager, an operation's code its column.  Included by _compiled.pyx,
# before plain_server.pxi (which counts in it).
#
# Counted in a connection's Python dictionaries, a request cost two lookups, an int
# object and a store, a put group's count a few more: 7.6% of a host process's user time
# per TCP put (perf, 2026-11-30).  Here it is an add to a row found by a scan of the few
# managers one connection reaches, the last one first.

from cpython.mem cimport PyMem_Realloc


cdef unsigned int _SERVED_OPS = SERVED_OPS  # (operation codes: 0 .. SERVED_OPS - 1)
cdef Py_ssize_t _SERVED_ROW = 1 + _SERVED_OPS  # (a row's words: its manager, its counts)


@cython.final
@cython.auto_pickle(False)  # (C counters: nothing to pickle them as)
cdef class ServedTable:
    """One connection's counts (``pure.ServedTable``): written by the connection's
    thread, read by :meth:`items` under the interpreter lock, so a read never sees a row
    half written or the rows moved."""

    cdef uint64_t* rows  # (nrows rows of _SERVED_ROW words; cap of them allocated)
    cdef Py_ssize_t nrows, cap, last

    def __dealloc__(self):
        PyMem_Free(self.rows)

    def __repr__(self):
        return f"<ServedTable managers={self.nrows}>"

    cdef uint64_t* _row(self, uint32_t mid) except NULL:
        """Manager ``mid``'s counts (a new row of zeros at its first count)."""
        cdef Py_ssize_t i, cap
        cdef uint64_t* grown
        if self.last < self.nrows and self.rows[self.last * _SERVED_ROW] == mid:
            return self.rows + self.last * _SERVED_ROW + 1
        for i in range(self.nrows):
            if self.rows[i * _SERVED_ROW] == mid:
                self.last = i
                return self.rows + i * _SERVED_ROW + 1
        if self.nrows == self.cap:
            cap = max(4, 2 * self.cap)
            grown = <uint64_t*>PyMem_Realloc(self.rows, cap * _SERVED_ROW * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            self.rows, self.cap = grown, cap
        i = self.nrows
        memset(self.rows + i * _SERVED_ROW, 0, _SERVED_ROW * sizeof(uint64_t))
        self.rows[i * _SERVED_ROW] = mid
        self.last, self.nrows = i, i + 1
        return self.rows + i * _SERVED_ROW + 1

    cdef int add(self, uint32_t mid, unsigned int op, uint64_t times) except -1:
        """``times`` requests ``op`` for manager ``mid``."""
        if op >= _SERVED_OPS:
            raise ValueError(f"operation {op}: not under {SERVED_OPS}")
        self._row(mid)[op] += times
        return 0

    def count(self, uint32_t mid, unsigned int op, uint64_t times=1):
        """``times`` requests ``op`` for manager ``mid`` (the server's Python path)."""
        self.add(mid, op, times)

    def items(self):
        """``[(manager, {operation: requests})]``, copies of the rows counted so far (a
        manager none of whose requests counted yet has no row)."""
        cdef Py_ssize_t i, j, words = self.nrows * _SERVED_ROW
        cdef uint64_t* copy = <uint64_t*>PyMem_Malloc(max(words, 1) * sizeof(uint64_t))
        cdef uint64_t* row
        if copy == NULL:
            raise MemoryError()
        try:
            memcpy(copy, self.rows, words * sizeof(uint64_t))  # (before any Python code runs)
            out = []
            for i in range(0, words, _SERVED_ROW):
                row = copy + i
                counts = {j: row[1 + j] for j in range(_SERVED_OPS) if row[1 + j]}
                if counts:
                    out.append((<uint32_t>row[0], counts))
            return out
        finally:
            PyMem_Free(copy)
