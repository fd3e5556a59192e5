# A manager's commit hook in C: a new generation word for it (shard.generations says why
# words change), written without a Python frame, and called by the plain server without
# a call.  Included by _compiled.pyx, before plain_server.pxi (which calls it).
#
# The words are 63 random bits and a one, as Generations.bump writes them; their source
# is splitmix64 over a seed from the system's entropy, reseeded in a forked child (two
# processes that drew the same words would hide each other's commits).

cdef uint64_t _word_state = 0


cdef inline int64_t _word_of(uint64_t* state) noexcept nogil:
    """The next word of the splitmix64 generator whose state is ``state``."""
    cdef uint64_t z
    state[0] += <uint64_t>0x9E3779B97F4A7C15
    z = state[0]
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return <int64_t>(((z ^ (z >> 31)) >> 1) | 1)


cdef inline int64_t _next_word() noexcept nogil:
    return _word_of(&_word_state)


def generation_words_forked():
    """(A forked child's hook, registered by ``kernels``: ``_forking.in_child``.)  A new
    seed for the generation words: the parent's state would draw the parent's words."""
    global _word_state
    _word_state = int.from_bytes(os.urandom(8), "little")


generation_words_forked()


@cython.auto_pickle(False)  # (a held buffer: nothing to pickle it as)
cdef class GenerationsState:
    """A generations file's words (``shard.generations.Generations``'s base), and their
    buffer, taken when they are set and held while they stay: the commit hook writes a
    word through it, without an attribute lookup and a buffer request at each commit
    (4% of a host's user time per TCP put, 2026-11-30).  Setting other words (a closed
    file's zeros) lets the old ones go."""

    cdef object _words
    cdef Py_buffer _view
    cdef bint _held

    @property
    def words(self):
        return self._words

    @words.setter
    def words(self, words):
        cdef Py_buffer view
        PyObject_GetBuffer(words, &view, PyBUF_WRITABLE)  # (C-contiguous, writable)
        if self._held:
            PyBuffer_Release(&self._view)
        self._view, self._held, self._words = view, True, words

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._view)


cdef class GenerationBump:
    """``store.on_commit`` of manager ``mid``, whose host keeps the generations ``gens``:
    ``gens.bump(mid)``, in C.  The words are taken where ``gens.words`` is at each call
    (a closed Generations points it at zeros) and let go at once: the hook keeps no
    mapping alive.  The generator's state is the interpreter lock's to guard."""

    cdef readonly object gens
    cdef readonly Py_ssize_t mid

    def __init__(self, gens, Py_ssize_t mid):
        if mid < 0:
            raise IndexError(f"manager {mid}: no generation word")
        self.gens, self.mid = gens, mid

    def __repr__(self):
        return f"<GenerationBump manager={self.mid} of {self.gens!r}>"

    cdef int bump(self) except -1:
        cdef Py_buffer view
        cdef GenerationsState held
        if isinstance(self.gens, GenerationsState):  # (the host's: its words' buffer, held)
            held = <GenerationsState>self.gens
            if not held._held or self.mid >= held._view.len // 8:
                raise IndexError(f"manager {self.mid}: no generation word in {self.gens!r}")
            (<int64_t*>held._view.buf)[self.mid] = _next_word()
            return 0
        PyObject_GetBuffer(self.gens.words, &view, PyBUF_WRITABLE)
        try:
            if self.mid >= view.len // 8:
                raise IndexError(f"manager {self.mid}: no generation word in {self.gens!r}")
            (<int64_t*>view.buf)[self.mid] = _next_word()
        finally:
            PyBuffer_Release(&view)
        return 0

    def __call__(self):
        self.bump()
