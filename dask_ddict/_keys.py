"""Canonical key bytes: equal keys are equal bytes in every process.

A key's serialized bytes are its identity (as in Dragon: ``1``, ``1.0`` and
``True`` are three keys) and, through their digest, its place.  Plain pickle
is not canonical across processes, so keys are pickled with three changes:

* **unordered containers in a fixed order.**  A ``set``'s iteration order
  depends on the ``str`` hash seed, which differs per process (Dask's nanny
  fixes ``PYTHONHASHSEED`` for its workers; the client has its own).  Sets
  and frozensets are written with their elements sorted by their own
  canonical bytes, and dicts with their items sorted by key bytes, so that
  equal dicts are one key whatever their insertion order.  This applies
  inside tuples, lists, dicts and the state of any object.
* **no memo.**  Pickle writes a back-reference for an object it met before
  *by identity*: ``("ab", "ab")`` pickles differently depending on whether the
  two strings are one object, which is an accident of how the key was built.
  Keys are pickled in "fast" mode, without memo (a cyclic key is refused).
* **classes and functions of** ``__main__`` **by name.**  A script's class
  pickles by reference (``__main__.Point``), but inside a task the same class
  was rebuilt by cloudpickle and pickle cannot reference it; falling back to
  cloudpickle would write different bytes.  Both are written as
  ``__main__.<qualname>``, resolved on load from this process's ``__main__``
  or from the classes this process has encoded.  Anything else that pickle
  cannot write by reference (a lambda, a class defined in a function) is
  refused with :class:`~dask_ddict.DDictSerializationError` (a ``TypeError``): by-value bytes are not stable.

Atoms (``str``, ``bytes``, ``int``, ``float``, ``bool``, ``None``) are
plain ``pickle.dumps`` bytes, the fast path of every put.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
import types
from typing import Any

from .errors import DDictSerializationError

#: Part of every shard's and checkpoint store's format: bump when key bytes change.
KEY_ENCODING = 2

_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})
#: Key types that are encoded as plain pickles and never placed by a user ``__hash__``.
PLAIN_KEYS = _ATOMS | {tuple}
_NAMED = (type, types.FunctionType)
_MAIN: dict[str, Any] = {}  # __main__ objects this process encoded, by qualname


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def main_object(qualname: str) -> Any:
    """Load a ``__main__`` class or function written by name (see module docs)."""
    obj = _MAIN.get(qualname)
    if obj is not None:
        return obj
    obj = sys.modules.get("__main__")
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise DDictSerializationError(
            f"key refers to __main__.{qualname}, which this process does not define "
            "(define key classes in an importable module to read such keys everywhere)"
        ) from None
    return obj


class _Ordered:
    """A container replaced by its canonical reduction (see :func:`_canon`)."""

    __slots__ = ("rv",)

    def __init__(self, rv: tuple[Any, ...]) -> None:
        self.rv = rv


def _sorted(items: Any) -> list[Any]:
    canon = [_canon(x) for x in items]
    return sorted(canon, key=_encode_canon)


def _canon(obj: Any) -> Any:
    """``obj`` with its builtin containers made canonical (unchanged objects are kept)."""
    t = type(obj)
    if t in _ATOMS:
        return obj
    if t is tuple or t is list:
        for x in obj:
            if type(x) not in _ATOMS:
                break
        else:
            return obj  # the common case: a tuple of atoms
        items = [_canon(x) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return tuple(items) if t is tuple else items
    if t is set or t is frozenset:
        return _Ordered((t, (_sorted(obj),)))
    if t is dict:
        pairs = sorted(
            ((_canon(k), _canon(v)) for k, v in obj.items()), key=lambda kv: _encode_canon(kv[0])
        )
        return _Ordered((dict, (pairs,)))
    return obj  # other objects: _KeyPickler.reducer_override


class _KeyPickler(pickle.Pickler):
    """Protocol-5 pickler in fast mode that canonicalizes what builtins cannot."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)
        self.fast = True  # no memo: bytes never depend on object identity

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _Ordered:
            return obj.rv
        if isinstance(obj, _NAMED):
            if getattr(obj, "__module__", None) == "__main__" and "<" not in obj.__qualname__:
                _MAIN[obj.__qualname__] = obj
                return (main_object, (obj.__qualname__,))
            return NotImplemented  # pickle writes it by reference (or refuses)
        reduce = copyreg.dispatch_table.get(type(obj))
        rv = reduce(obj) if reduce is not None else obj.__reduce_ex__(5)
        if isinstance(rv, str):
            return NotImplemented
        rv = list(rv)
        if isinstance(obj, (set, frozenset)) and len(rv) > 1:  # a set subclass
            rv[1] = (_sorted(obj),)
        elif rv[0] is copyreg.__newobj_ex__:  # type: ignore[attr-defined]  # (not in typeshed)  # (cls, args, kwargs): kwargs must stay a dict
            cls, args, kwargs = rv[1]
            rv[1] = (cls, _canon(args), {k: _canon(kwargs[k]) for k in sorted(kwargs)})
        else:
            rv[1] = _canon(rv[1])
        if len(rv) > 2:
            rv[2] = _canon(rv[2])
        if len(rv) > 3 and rv[3] is not None:
            rv[3] = iter([_canon(x) for x in rv[3]])
        if len(rv) > 4 and rv[4] is not None:
            pairs = sorted(
                ((_canon(k), _canon(v)) for k, v in rv[4]), key=lambda kv: _encode_canon(kv[0])
            )
            rv[4] = iter(pairs)
        return tuple(rv)


_idle = threading.local()  # picklers ready for reuse (creating one costs more than a dump)


def _encode_canon(obj: Any) -> bytes:
    if type(obj) in _ATOMS:
        return pickle.dumps(obj, protocol=5)
    free = getattr(_idle, "free", None)
    if free is None:
        free = _idle.free = []
    if free:
        pickler, buf = free.pop()  # nested calls (sorting a set's elements) take another
    else:
        buf = io.BytesIO()
        pickler = _KeyPickler(buf)
    try:
        pickler.dump(obj)
        return buf.getvalue()
    finally:
        buf.seek(0)
        buf.truncate()
        if len(free) < 8:
            free.append((pickler, buf))


def encode_key(key: Any) -> bytes:
    """The canonical bytes of ``key`` (its identity in every process).

    Raises
    ------
    DDictSerializationError
        (a ``TypeError``) if the key cannot be written canonically (a cyclic key, or an object
        pickle can only write by value).
    """
    if type(key) in _ATOMS:
        return pickle.dumps(key, protocol=5)
    try:
        return _encode_canon(_canon(key))
    except RecursionError:
        raise DDictSerializationError(
            f"a key of type {_describe(key)} is cyclic or nested too deeply"
        ) from None
    except DDictSerializationError:
        raise
    except Exception as e:  # whatever a __reduce__ raises
        raise DDictSerializationError(
            f"cannot use a {_describe(key)} as a key: {e} (keys must pickle by reference, "
            "without cycles: define their classes at the top level of a module)"
        ) from None


def dumps_key(key: Any, pickler: Any = None) -> bytes:
    """Serialize a key: canonical bytes, or a custom key pickler's (which must be bytes-like)."""
    if pickler is None:
        return encode_key(key)
    try:
        data = pickler.dumps(key)
    except Exception as e:
        raise DDictSerializationError(
            f"custom key pickler failed on a key of type {_describe(key)}: {e}"
        ) from e
    if isinstance(data, bytes):
        return data
    try:
        return memoryview(data).tobytes()
    except TypeError:
        raise DDictSerializationError(
            f"key_pickler.dumps must return a bytes-like object, got {type(data).__name__}"
        ) from None


def loads_key(data: Any, pickler: Any = None) -> Any:
    """Deserialize key bytes."""
    if pickler is not None:
        return pickler.loads(bytes(data))
    try:
        return pickle.loads(data)
    except DDictSerializationError:
        raise
    except Exception as e:
        raise DDictSerializationError(f"cannot deserialize a key: {e}") from e
