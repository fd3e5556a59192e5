# The state of a manager that the plain server reads, in C fields: bases of the Python
# classes that keep it (Manager, WorkingSet, ShardStore; and a connection's Reader, whose
# buffer the server reads its requests from).  Included by _compiled.pyx,
# before plain_server.pxi (which reads them).
#
# The Python code reads and writes these as before (a C field is a member descriptor of
# the base, as fast from Python as an instance attribute); the plain server reads them
# as struct fields, where an attribute lookup cost it about 60 ns each, some 25 times a
# put.  There is still one copy of each: the field is the attribute.


cdef class ManagerState:
    """What a manager's plain requests are checked against (``Manager``'s base)."""

    cdef public bint closed, frozen
    cdef public long long wire  # (its term as requests carry it: layout.wire_term)
    cdef public object store, working_set, _mutex, _deferred, _retiring


cdef class WindowState:
    """A manager's checkpoint window and retirement rules (``WorkingSet``'s base)."""

    cdef public long long size, newest
    cdef public bint wait_for_keys, wait_for_writers


cdef class StoreState:
    """A shard's environment, tables, replication, commit hook and room estimate
    (``ShardStore``'s base)."""

    cdef public object env, _data, _meta, replicate, on_commit
    cdef public bint indexed
    cdef public long long capacity, _used_estimate, _next_own
    cdef public double full_thresh


cdef class ReaderState:
    """A socket's receive buffer and the bytes received, not read yet: ``_buf[_pos:_end]``
    (``transport.protocol.Reader``'s base; ``_mv`` is a view of ``_buf``)."""

    cdef public object sock, _mv
    cdef public bytearray _buf
    cdef public Py_ssize_t _pos, _end


@cython.auto_pickle(False)  # (a copy would drop its subclass's slots)
cdef class ConnectionState:
    """What the event loop reads of a connection at each of its wake-ups: its plain
    server and its socket's reader (``host.loop.Connection``'s base)."""

    cdef public object plain, reader


@cython.auto_pickle(False)  # (a copy would drop its subclass's slots)
cdef class HostedState:
    """What the plain server reads of a dictionary at each run of requests: its managers
    here, and whether its primaries need this host's lease, and the lease
    (``host.hosted.HostedDict``'s base)."""

    cdef public object managers, lease
    cdef public bint leased


@cython.auto_pickle(False)  # (a copy would drop its subclass's slots)
cdef class LeaseState:
    """Whether a host's lease is kept at all, and its end (of ``lease_clock``), as the
    plain server checks them (``host.lease.LeaseKeeper``'s base)."""

    cdef public bint required
    cdef public double until


@cython.auto_pickle(False)  # (a copy would drop its subclass's slots)
cdef class DeferredState:
    """A manager's operations waiting to be retried, oldest first, which a plain put
    checks for (``shard.deferred.DeferredQueue``'s base)."""

    cdef public list waiting
