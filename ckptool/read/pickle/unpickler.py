"""A pickle reader that never imports or calls anything the file names.

``SafeUnpickler.find_class`` resolves each global to one of: a safe torch
rebuild function (``ckptool.read.tensors``), an inert value (``ckptool.read.values``),
or a ``StandIn`` class for that dotted name. Every global is recorded with
its name's verdict (``names.classify``), and every call, creation and BUILD
with what the real loader would do there (``reach.Calls``,
``lookups.Lookups``): ``policy.judge`` turns those records into verdicts.
Persistent ids (torch storages) go to a callback given by the format reader,
which turns them into ``StorageRef``s without reading any tensor byte.

It runs on the pure-Python unpickler so that the opcodes which reach past
the file's own objects are ours too, not only ``find_class``:

- ``EXT1/2/4`` look a code up by name, never in ``copyreg``'s cache of live
  objects (which a plain ``pickle.loads`` in the same process fills);
- ``BUILD`` sets state only on objects this read made for the file
  (``constructors.BUILDABLE``): never on a class or function we hand out, which
  every later read shares, nor on a tensor or storage record already checked
  (but a ``__setstate__`` an earlier BUILD put on it is a call, as in CPython);
- every dict key and set item is checked before it is hashed
  (``values.check_key``): the C unpickler hashes a 100k-deep tuple key
  straight into a stack overflow, a crash no ``except`` catches;
- ``FRAME``s are read through as the C unpickler does, each checked to end
  where an opcode does (``ckptool.read.frames``).

After a load, ``check_tree`` refuses too deep trees and too long integers.

Inside ``ckptool.read.observe.observe(callback)`` dict entries are reported
as they are read (``observe.Observing``); other reads cost nothing extra.

Tensors pickled with plain pickle carry their storage as an embedded legacy
torch file (``torch.storage._load_from_bytes``): the format reader passes
``read_embedded``, which parses those bytes in memory, and this layer says
where in the stream they lie, so that they can later be read in place.
"""

from __future__ import annotations

import _compat_pickle
import contextvars
import copyreg
import pickle
import struct
from collections.abc import Callable
from typing import IO, Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read import frames, observe, values
from ckptool.read.pickle import policy
from ckptool.read.pickle.lookups import Lookups
from ckptool.read.resolve import resolve_global
from ckptool.read.seen import GlobalsSeen
from ckptool.read.treecheck import HINT
from ckptool.read.values import StandIn

PersistentLoader = Callable[[tuple[Any, ...]], Any]
# (bytes of an embedded legacy torch file, storage id prefix, the offset in
# the stream where those bytes lie as they are, or None where the pickle
# spells them otherwise: protocols 0 to 2 write bytes as text) -> its RawRead
EmbeddedReader = Callable[[bytes, str, int | None], Any]

MAX_GLOBALS = 10_000  # distinct globals one file may name: each becomes a class
MAX_EMBEDDED_DEPTH = 2  # legacy files inside storages inside legacy files...
MAX_FRAME = 64 << 20  # pickle frames are ~64 KiB; a bigger claim is checked against this


_U32 = struct.Struct("<I").unpack

_embedded_depth = contextvars.ContextVar("ckptool_embedded_depth", default=0)

class _Done(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class _Dispatch(dict[int, Any]):
    def __missing__(self, key: int) -> Any:
        raise pickle.UnpicklingError(f"invalid load key, {bytes([key])!r}")


class SafeUnpickler(observe.Observing, Lookups, pickle._Unpickler):
    # set by pickle._Unpickler or by load(); declared for mypy
    stack: list[Any]
    metastack: list[list[Any]]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    proto: int
    pop_mark: Callable[[], list[Any]]
    memo: dict[int, Any]

    def __init__(self, file: IO[bytes], persistent: PersistentLoader | None,
                 seen: GlobalsSeen, embedded: dict[str, Any] | None = None,
                 read_embedded: EmbeddedReader | None = None) -> None:
        super().__init__(file)
        self.read = file.read  # straight from the stream, through frames (as C does)
        self.readline = file.readline
        self._persistent = persistent
        self.seen = seen
        # storages of tensors pickled with plain pickle, keyed by storage id
        self.embedded = embedded if embedded is not None else {}
        self._read_embedded = read_embedded
        self._tell, self._seek = file.tell, file.seek
        # id of each bytes object read -> (it, the stream offset of its data)
        self._bytes_at: dict[int, tuple[bytes, int]] = {}
        # what each global became (id -> (it, dotted)), each dotted name's
        # (module, name), and what BUILD put on instances: the call model's
        self._resolved: dict[int, tuple[Any, str]] = {}
        self._split: dict[str, tuple[str, str]] = {}
        self._injected: dict[int, tuple[Any, list[dict[Any, Any]]]] = {}
        self._dispatch = self.dispatch
        self._observer = None
        watch = observe.claim(persistent is not None or embedded is not None)
        if watch is not None:
            self._observer = watch.callback
            self._wanted = watch.values
            self._from_memo = set()
            self._dispatch = _OBSERVED_DISPATCH

    def load(self) -> Any:
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self._dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("pickle data ends before its STOP opcode")
                dispatch[key[0]](self)  # type: ignore[arg-type]
        except _Done as done:
            return done.value
        finally:  # the bound reader refers back to self: no cycle outlives the read
            self._resolved.clear()
            self._injected.clear()

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise CorruptCheckpointError("pickle names a global that is not a string", HINT)
        module, name = python3_name(module, name)
        dotted = f"{module}.{name}"
        verdict = policy.classify(module, name)
        self._record(dotted, verdict)
        self._split.setdefault(dotted, (module, name))
        if dotted == "torch.storage._load_from_bytes":
            found: Any = self._load_from_bytes  # known by its id while the read lasts
        else:
            found = resolve_global(module, name, verdict)
        if not (type(found) is type and issubclass(found, StandIn)):
            self._resolved[id(found)] = (found, dotted)
        return found

    def _position(self) -> str:
        try:
            return f"at byte {self._tell()} of {self.seen.part}"
        except (OSError, ValueError):
            return f"in {self.seen.part}"

    def _record(self, dotted: str, verdict: policy.Verdict) -> None:
        if dotted not in self.seen.verdicts and len(self.seen.verdicts) >= MAX_GLOBALS:
            raise CorruptCheckpointError(
                f"pickle names more than {MAX_GLOBALS} different globals", HINT)
        self.seen.add(dotted, verdict)

    def get_extension(self, code: int) -> None:
        """EXT opcodes: by name from the registry, never copyreg's object cache."""
        key = getattr(copyreg, "_inverted_registry", {}).get(code)
        if key is not None:
            self.append(self.find_class(*key))
            return
        if code <= 0:
            raise pickle.UnpicklingError("EXT specifies code <= 0")
        dotted = f"copyreg.extension.{code}"
        if dotted not in self.seen.verdicts and len(self.seen.verdicts) >= MAX_GLOBALS:
            raise CorruptCheckpointError(
                f"pickle names more than {MAX_GLOBALS} different globals", HINT)
        self.seen.flag(dotted, "an extension code: the loading process's copyreg registry "
                       "decides which global it is")
        self.append(values.standin_class(dotted, policy.UNSAFE))

    def _load_from_bytes(self, data: Any) -> Any:
        """A storage pickled with plain pickle: an embedded legacy torch file."""
        if self._read_embedded is None:
            raise CorruptCheckpointError(
                "a pickle that holds no tensors embeds a torch file", HINT)
        if not isinstance(data, bytes):
            raise CorruptCheckpointError("embedded storage is not bytes", HINT)
        depth = _embedded_depth.get()
        if depth >= MAX_EMBEDDED_DEPTH:
            raise CorruptCheckpointError("embedded torch files nest too deeply", HINT)
        placed = self._bytes_at.get(id(data))
        at = placed[1] if placed is not None and placed[0] is data else None
        token = _embedded_depth.set(depth + 1)
        try:
            with observe.unobserved():  # its keys are not the outer file's
                raw = self._read_embedded(data, f"embedded{len(self.embedded)}/", at)
        finally:
            _embedded_depth.reset(token)
        self.embedded.update(raw.storages)
        self.seen.merge(raw.seen, f"{self.seen.part}: an embedded torch file")
        return raw.root

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CorruptCheckpointError("pickle refers to external data it does not carry",
                                         HINT)
        if not isinstance(pid, tuple):
            raise CorruptCheckpointError(f"unexpected persistent id: {values.brief(pid)}", HINT)
        return self._persistent(pid)

    # -- opcodes that differ from pickle._Unpickler ------------------------

    # memo traffic is a third of a torch pickle's opcodes: these skip the
    # stdlib's generic struct calls (a bad index still fails: KeyError)
    def _load_binput(self) -> None:
        self.memo[self.read(1)[0]] = self.stack[-1]

    def _load_long_binput(self) -> None:
        self.memo[_U32(self.read(4))[0]] = self.stack[-1]

    def _load_binget(self) -> None:
        self._get(self.read(1)[0])

    def _load_long_binget(self) -> None:
        self._get(_U32(self.read(4))[0])

    def _get(self, index: int) -> None:
        try:
            self.append(self.memo[index])
        except KeyError:
            raise observe.memo_miss(index) from None

    def _load_stop(self) -> None:
        raise _Done(self.stack.pop())

    def _load_frame(self) -> None:  # the opcodes inside are read as they come, but
        (length,) = struct.unpack("<Q", self.read(8))  # the frame must end where one does
        at = self._tell()
        frames.check(self.read(min(length, MAX_FRAME)), length)
        self._seek(at)

    # bytes (protocol 3+): where each one's data starts, for embedded storages
    def _load_short_binbytes(self) -> None:
        self._bytes(self.read(1)[0])

    def _load_binbytes(self) -> None:
        self._bytes(_U32(self.read(4))[0])

    def _load_binbytes8(self) -> None:
        self._bytes(struct.unpack("<Q", self.read(8))[0])

    def _bytes(self, n: int) -> None:
        at = self._tell()
        data = self.read(n)  # never more than the stream holds, whatever n claims
        if len(data) < n:
            raise pickle.UnpicklingError("pickle data was truncated")
        if n > 1:  # the empty and one-byte objects are shared singletons
            self._bytes_at[id(data)] = (data, at)
        self.append(data)

    def _load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        data = self.read(n)  # never bytearray(n) up front: n is the file's claim
        if len(data) < n:
            raise pickle.UnpicklingError("pickle data was truncated")
        self.append(bytearray(data))

    def _load_dict(self) -> None:
        items = self.pop_mark()
        for key in items[::2]:
            self._key(key)
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._key(key)
        target = self.stack[-1]
        if isinstance(target, StandIn):  # its class's __setitem__ runs
            self.touch(target, "SETITEM on it")
        target[key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if isinstance(target, StandIn):
            self.touch(target, "SETITEMS on it")
        for i in range(0, len(items), 2):
            self._key(items[i])
            target[items[i]] = items[i + 1]

    def _key(self, key: Any) -> None:
        """A dict key or set item, hashed: bounded (``check_key``), and an
        object's class ``__hash__`` and ``__eq__`` run on it."""
        values.check_key(key)
        if isinstance(key, (StandIn, tuple, frozenset)):  # a tuple hashes its items
            self.touch_hashed(key, "hashed as a dict key or set item")

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        for item in items:
            self._key(item)
        self.append(frozenset(items))

    # -- calls: what the pickle does with each global (ckptool.read.pickle) --

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self.call(self.stack[-1], args)

    def _load_newobj(self) -> None:
        self._created(self.stack[-2], self.stack[-1])
        _BASE_NEWOBJ(self)  # type: ignore[arg-type]

    def _load_newobj_ex(self) -> None:
        self._created(self.stack[-3], self.stack[-2], self.stack[-1])
        _BASE_NEWOBJ_EX(self)  # type: ignore[arg-type]

    def _created(self, cls: Any, args: Any = (), kwargs: Any = None) -> None:
        """NEWOBJ: ``cls.__new__(cls, *args, **kwargs)``."""
        name = self.global_name(cls)
        if name is not None:
            self.new_with(name, args, kwargs, "NEWOBJ")

    def _load_inst(self) -> None:
        module = self.readline()[:-1].decode("ascii")
        name = self.readline()[:-1].decode("ascii")
        self._instantiate_modelled(self.find_class(module, name), self.pop_mark())

    def _load_obj(self) -> None:
        args = self.pop_mark()
        cls = args.pop(0)
        self._instantiate_modelled(cls, args)

    def _instantiate_modelled(self, klass: Any, args: list[Any]) -> None:
        """INST and OBJ: ``klass(*args)``, or ``klass.__new__(klass)`` for a
        class given no arguments (as ``pickle._Unpickler._instantiate``)."""
        if not args and isinstance(klass, type):
            self._created(klass)
            self.append(klass.__new__(klass))  # type: ignore[call-overload]
            return
        self.append(self.call(klass, tuple(args)))


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A global as Python 3 names it: protocol 0-2 files written by Python 2
    use old module names."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


_BASE_NEWOBJ = pickle._Unpickler.dispatch[pickle.NEWOBJ[0]]
_BASE_NEWOBJ_EX = pickle._Unpickler.dispatch[pickle.NEWOBJ_EX[0]]
SafeUnpickler.dispatch = _Dispatch(pickle._Unpickler.dispatch)
SafeUnpickler.dispatch.update({
    pickle.STOP[0]: SafeUnpickler._load_stop,
    pickle.FRAME[0]: SafeUnpickler._load_frame,
    pickle.SHORT_BINBYTES[0]: SafeUnpickler._load_short_binbytes,
    pickle.BINBYTES[0]: SafeUnpickler._load_binbytes,
    pickle.BINBYTES8[0]: SafeUnpickler._load_binbytes8,
    pickle.BYTEARRAY8[0]: SafeUnpickler._load_bytearray8,
    pickle.DICT[0]: SafeUnpickler._load_dict,
    pickle.SETITEM[0]: SafeUnpickler._load_setitem,
    pickle.SETITEMS[0]: SafeUnpickler._load_setitems,
    pickle.ADDITEMS[0]: SafeUnpickler._load_additems,
    pickle.FROZENSET[0]: SafeUnpickler._load_frozenset,
    pickle.BUILD[0]: SafeUnpickler._load_build,
    pickle.REDUCE[0]: SafeUnpickler._load_reduce,
    pickle.APPEND[0]: SafeUnpickler._load_append,
    pickle.APPENDS[0]: SafeUnpickler._load_appends,
    pickle.NEWOBJ[0]: SafeUnpickler._load_newobj,
    pickle.NEWOBJ_EX[0]: SafeUnpickler._load_newobj_ex,
    pickle.INST[0]: SafeUnpickler._load_inst,
    pickle.OBJ[0]: SafeUnpickler._load_obj,
    pickle.BINPUT[0]: SafeUnpickler._load_binput,
    pickle.LONG_BINPUT[0]: SafeUnpickler._load_long_binput,
    pickle.BINGET[0]: SafeUnpickler._load_binget,
    pickle.LONG_BINGET[0]: SafeUnpickler._load_long_binget,
})
_OBSERVED_DISPATCH = observe.observed_dispatch(SafeUnpickler.dispatch)
