"""Write a faithfully read object tree back as a torch pickle.

The inverse of ``ckptool.read.pickle.unpickler`` in faithful mode: stand-ins go back as the
globals they stand for (``NEWOBJ`` or ``REDUCE``, then their items and
``BUILD`` state), tensor records as the rebuild call that made them, storage
records as persistent ids from a callback (which is where a rewrite changes
a location tag or a dtype). Globals are written from the names the objects
carry: nothing is imported, unlike ``pickle.Pickler.save_global``. For an
unchanged tree the output is the input's pickle, byte for byte.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import types
from collections.abc import Callable
from typing import Any, ClassVar

from ckptool.errors import UnsupportedCheckpointError
from ckptool.read import constructors, pickles, values
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import CompositeTensor, StorageRef, StorageType, TensorRecord
from ckptool.read.values import StandIn, TorchDtype

PROTOCOL = 2  # what torch.save writes
PersistentId = Callable[[StorageRef], tuple[Any, ...]]


def _newobj(cls: Any, *args: Any) -> Any:  # pragma: no cover - never called
    raise AssertionError("only its name is used: it makes pickle write NEWOBJ")


_newobj.__name__ = "__newobj__"


_PLAIN = frozenset({int, float, str, bytes, bool, type(None), tuple, list, dict})


class Repickler(pickle._Pickler):
    # pickle._Pickler's own attributes, undeclared in typeshed
    memoize: Callable[[Any], None]
    write: Callable[[bytes], Any]
    get: Callable[[int], bytes]
    memo: dict[int, tuple[int, Any]]
    proto: int
    fix_imports: bool
    # (not ``fast``: that is pickle's own switch, which turns the memo off)
    plain_shortcut: ClassVar[bool] = True  # tests turn it off to compare the bytes

    def __init__(self, file: io.BytesIO, persistent: PersistentId) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self._persistent = persistent

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        """``pickle._Pickler.save``, with plain values dispatched at once: for
        these exact types, at protocol 2 (no frames), neither ``persistent_id``
        nor ``reducer_override`` ever answers, so only the memo and the type's
        own saver are left; a third of a re-pickle's time goes otherwise to
        asking them (tests hold both ways to the same bytes)."""
        kind = type(obj)
        if kind in _PLAIN and self.plain_shortcut:
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            self.dispatch[kind](self, obj)
            return
        pickle._Pickler.save(self, obj, save_persistent_id)  # type: ignore[attr-defined]

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return self._persistent(obj)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (TensorRecord, CompositeTensor)):
            if obj.origin is None:
                raise UnsupportedCheckpointError(
                    "a tensor was read without its rebuild call; read with faithful()")
            name, args = obj.origin
            return _Global(name), args
        if isinstance(obj, StandIn):
            items = iter(obj.items) if obj.items else None
            dictitems = iter(obj.dictitems.items()) if obj.dictitems else None
            if obj.kwargs:
                raise UnsupportedCheckpointError(
                    f"cannot rewrite {obj.qualname}: built with keyword arguments")
            if obj.reduced:
                return type(obj), obj.args, obj.state, items, dictitems
            return _newobj, (type(obj), *obj.args), obj.state, items, dictitems
        if isinstance(obj, (StorageType, TorchDtype)):
            return _global_name(obj)
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module, qualname = _global_name(obj).rsplit(".", 1) if not isinstance(
            obj, _Global) else obj.dotted.rsplit(".", 1)
        if self.proto < 3 and self.fix_imports:
            # protocol 2 files name builtins the Python 2 way, as torch writes them
            module, qualname = _compat_pickle.REVERSE_NAME_MAPPING.get(
                (module, qualname), (module, qualname))
            module = _compat_pickle.REVERSE_IMPORT_MAPPING.get(module, module)
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)

    dispatch: ClassVar[dict[Any, Any]] = dict(pickle._Pickler.dispatch)


class _Global:
    """A global named only by its dotted name (a tensor's rebuild function)."""

    _cache: ClassVar[dict[str, _Global]] = {}

    def __new__(cls, dotted: str) -> _Global:
        # one object per name, so the pickler memoizes each global once
        obj = cls._cache.get(dotted)
        if obj is None:
            obj = cls._cache[dotted] = object.__new__(cls)
            obj.dotted = dotted
        return obj

    dotted: str

    def __call__(self, *args: Any) -> Any:  # pragma: no cover - never called
        raise AssertionError("pickle only needs a callable here; it writes the name")


def _save_global_object(pickler: Repickler, obj: Any) -> None:
    pickler.save_global(obj)


def _save_function(pickler: Repickler, obj: Any) -> None:
    if hasattr(obj, "ckpt_global"):
        # a rebuild function passed as an argument (``_rebuild_from_type_v2(func,
        # ...)``, how torch saves a tensor with Python attributes): by the name
        # it carries, never by the stdlib's save_global, which imports it
        pickler.save_global(obj)
    else:  # the pickler's own helpers (bytes at protocol 2: codecs.encode)
        pickle._Pickler.save_global(pickler, obj)  # type: ignore[attr-defined]


Repickler.dispatch[_Global] = _save_global_object
Repickler.dispatch[types.FunctionType] = _save_function
Repickler.dispatch[types.BuiltinFunctionType] = _save_function


def _global_name(obj: Any) -> str:
    if isinstance(obj, type) and issubclass(obj, StandIn):
        return obj.qualname
    if isinstance(obj, StorageType):
        module = "torch.storage" if obj.name in ("UntypedStorage", "TypedStorage") else "torch"
        return f"{module}.{obj.name}"
    if isinstance(obj, TorchDtype):
        return f"torch.{obj}"
    dotted = getattr(obj, "ckpt_global", None)
    if isinstance(dotted, str):
        return dotted
    if obj is constructors.safe_callable("collections.OrderedDict"):
        return "collections.OrderedDict"
    if isinstance(obj, type) and obj.__module__ in ("builtins", "collections"):
        return f"{obj.__module__}.{obj.__qualname__}"
    raise UnsupportedCheckpointError(f"cannot write back the global {values.brief(obj)}")


def dumps(root: Any, persistent: PersistentId, judge: bool = True) -> bytes:
    """The protocol-2 pickle of ``root``, storages written by ``persistent``;
    judged before anything writes it (``judge_written``), unless ``judge``
    is off (a test of the bytes alone)."""
    buf = io.BytesIO()
    Repickler(buf, persistent).dump(root)
    data = buf.getvalue()
    if judge:
        judge_written(data)
    return data


def judge_written(data: bytes) -> None:
    """A pickle ckptool is about to write is judged as any file ckptool reads.

    Writing a tree back puts each object whole where it is first reached: a
    call the input made before an object got its attributes (``dict(M)``,
    then ``M.keys = f``) comes after them in the output, where it calls
    them. The input's verdict does not vouch for the output's order; this
    does. Raises (nothing written) where the output would run code."""
    seen = GlobalsSeen()
    seen.part = "the pickle to write"
    with seen.naming_unsafe():
        pickles.load(data, _anywhere, seen)
    unsafe = seen.unsafe()
    if unsafe:
        raise UnsupportedCheckpointError(
            f"the pickle ckptool would write names globals that run code when loaded "
            f"({', '.join(unsafe[:4])}{' …' if len(unsafe) > 4 else ''}): nothing was written",
            "the input's objects call what they carry in another order once written back: "
            "keep only the weights (--extract) or drop the entries that carry them (--drop PATH)")


def _anywhere(pid: tuple[Any, ...]) -> StorageRef:
    """A storage of the pickle to write: where its bytes lie is the writer's
    business; its dtype, for the tensors that view it."""
    stype = next((p for p in pid if isinstance(p, StorageType)), None)
    dtype = stype.dtype if stype is not None else "uint8"
    return StorageRef("written", dtype, None, 1 << 62)
