"""A pickle reader that never imports or calls anything the file names.

``SafeUnpickler.find_class`` resolves each global to one of: a safe torch
rebuild function (``ckptool.read.tensors``), an inert value (``ckptool.read.values``),
or a ``StandIn`` class for that dotted name. Every global is recorded with
its ``ckptool.read.policy`` verdict, so callers can report unsafe ones.
Persistent ids (torch storages) go to a callback given by the format reader,
which turns them into ``StorageRef``s without reading any tensor byte.

It runs on the pure-Python unpickler so that the opcodes which reach past
the file's own objects are ours too, not only ``find_class``:

- ``EXT1/2/4`` look a code up by name, never in ``copyreg``'s cache of live
  objects (which a plain ``pickle.loads`` in the same process fills);
- ``BUILD`` sets state only on objects this read made for the file
  (``constructors.BUILDABLE``): never on a class or function we hand out, which
  every later read shares, nor on a tensor or storage record already checked;
- every dict key and set item is checked before it is hashed
  (``values.check_key``): the C unpickler hashes a 100k-deep tuple key
  straight into a stack overflow, a crash no ``except`` catches.

After a load, ``check_tree`` refuses trees nested deeper than ``MAX_DEPTH``
and integers too long to print, so what follows (walk, render, JSON) stays
bounded.

``observe(callback)`` lets a reader see a state dict while it is read: after
each ``SETITEMS``/``SETITEM``/``DICT`` that adds keys to a dict, the callback
gets the dict's path of keys from the root and the pairs just added, when the
stack says where that dict sits (see ``SafeUnpickler._path``). It costs nothing
when no observer is set: observing reads use their own dispatch table.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import contextvars
import copyreg
import gc
import io
import pickle
import struct
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import IO, Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read import constructors, policy, values
from ckptool.read.resolve import resolve_global
from ckptool.read.treecheck import HINT, check_tree

PersistentLoader = Callable[[tuple[Any, ...]], Any]

MAX_GLOBALS = 10_000  # distinct globals one file may name: each becomes a class
MAX_EMBEDDED_DEPTH = 2  # legacy files inside storages inside legacy files...


_U32 = struct.Struct("<I").unpack

_embedded_depth = contextvars.ContextVar("ckptool_embedded_depth", default=0)

# (path of str keys from the root to a dict, [(key, value) just added to it])
Observer = Callable[[tuple[str, ...], list[tuple[Any, Any]]], None]
BATCHSIZE = 1000  # pairs per SETITEMS that pickle's Pickler (C and Python) writes
MAX_OBSERVED_DEPTH = 32  # deeper dicts are not reported (bounds each report's cost)
# what REDUCE and NEWOBJ call: a pair after one may be its arguments, not dict items
_CALLABLES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class _Observation:
    def __init__(self, callback: Observer, values: tuple[type, ...] | None) -> None:
        self.callback = callback
        self.values = values
        self.claimed = False  # by the first object pickle read in its scope


_observer: contextvars.ContextVar[_Observation | None] = contextvars.ContextVar(
    "ckptool_observer", default=None)


@contextlib.contextmanager
def observe(callback: Observer, values: tuple[type, ...] | None = None) -> Iterator[None]:
    """Report dict entries to ``callback(path, pairs)`` while a pickle is read.

    With ``values``, only batches holding a value of one of those types are
    reported (all of their pairs); the others cost no path search.

    Only the first ``load`` in this scope that reads an object pickle (one
    given a persistent loader or an embedded-storage table: the root pickle
    of a torch zip, legacy or plain-pickle file) reports; legacy header
    pickles, TorchScript constants and embedded legacy files never do.

    ``path`` is the tuple of str keys from the pickle's root to the dict
    that grew; a batch is left out when the stack does not say where its dict
    sits (inside a list, a tuple, a BUILD state, call arguments, under a
    non-str key, a dict taken from the memo...). ``_path`` reads the stack
    as ``pickle``'s Pickler (torch.save's) lays dicts out and refuses what
    does not fit, but no forward reader can be certain: pickle is postfix,
    and an opcode still to come may wrap what the stack holds. TUPLE1-3 come
    after their items, so a dict that becomes an item of a tuple of at most
    3 items (``torch.save((sd, opt))``, ``{"a": (x, "k", sd)}``) is reported
    where it sat on the stack, not where the finished read puts it; a
    hand-written pickle can also set a reported key again, or change a
    reported tensor record, later. Reports are a preview; the finished read
    is the truth. The callback runs on the reading thread and must only read
    what it is given; what it raises propagates out of the read as is.
    """
    token = _observer.set(_Observation(callback, values))
    try:
        yield
    finally:
        _observer.reset(token)


class GlobalsSeen:
    """Every global a file named, with its verdict and how often."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.verdicts: dict[str, policy.Verdict] = {}

    def add(self, dotted: str, verdict: policy.Verdict) -> None:
        self.counts[dotted] += 1
        self.verdicts.setdefault(dotted, verdict)

    def unsafe(self) -> list[str]:
        return sorted(n for n, v in self.verdicts.items() if v.category == policy.UNSAFE)


def _memo_miss(index: int) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"memo value not found at index {index}")


class _ObserverFailed(Exception):
    """Carries what an observer raised past ``load``'s net for malformed files."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _Done(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class _Dispatch(dict[int, Any]):
    def __missing__(self, key: int) -> Any:
        raise pickle.UnpicklingError(f"invalid load key, {bytes([key])!r}")


class SafeUnpickler(pickle._Unpickler):
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
                 seen: GlobalsSeen, embedded: dict[str, Any] | None = None) -> None:
        super().__init__(file)
        # straight from the stream: frames only group opcodes, so reading
        # through them is the same bytes without a Python call per read
        self.read = file.read
        self.readline = file.readline
        self._persistent = persistent
        self.seen = seen
        # storages of tensors pickled with plain pickle, keyed by storage id
        self.embedded = embedded if embedded is not None else {}
        self._dispatch = self.dispatch
        self._observer: Observer | None = None
        watch = _observer.get()
        if watch is not None and not watch.claimed and (
                persistent is not None or embedded is not None):
            watch.claimed = True
            self._observer = watch.callback
            self._wanted: tuple[type, ...] | None = watch.values
            self._from_memo: set[int] = set()  # ids of dicts pushed again from the memo
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

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise CorruptCheckpointError("pickle names a global that is not a string", HINT)
        # protocol 0-2 files written by Python 2 use old module names
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        dotted = f"{module}.{name}"
        verdict = policy.classify(module, name)
        self._record(dotted, verdict)
        if dotted == "torch.storage._load_from_bytes":
            return self._load_from_bytes
        return resolve_global(module, name, verdict)

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
        self._record(dotted, policy.Verdict(
            policy.UNSAFE, "an extension code: the loading process's copyreg registry "
            "decides which global it is"))
        self.append(values.standin_class(dotted, policy.UNSAFE))

    def _load_from_bytes(self, data: Any) -> Any:
        """A storage pickled with plain pickle: an embedded legacy torch file."""
        from ckptool.read.formats import torch_legacy  # the format imports this module

        if not isinstance(data, bytes):
            raise CorruptCheckpointError("embedded storage is not bytes", HINT)
        depth = _embedded_depth.get()
        if depth >= MAX_EMBEDDED_DEPTH:
            raise CorruptCheckpointError("embedded torch files nest too deeply", HINT)
        token = _embedded_depth.set(depth + 1)
        unobserved = _observer.set(None)  # its keys are not the outer file's
        try:
            raw = torch_legacy.read_bytes(data, f"embedded{len(self.embedded)}/")
        finally:
            _observer.reset(unobserved)
            _embedded_depth.reset(token)
        self.embedded.update(raw.storages)
        for name, count in raw.seen.counts.items():
            self.seen.counts[name] += count
            self.seen.verdicts.setdefault(name, raw.seen.verdicts[name])
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
            raise _memo_miss(index) from None

    def _load_stop(self) -> None:
        raise _Done(self.stack.pop())

    def _load_frame(self) -> None:
        self.read(8)  # frame length: the opcodes inside are read as they come

    def _load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        data = self.read(n)  # never bytearray(n) up front: n is the file's claim
        if len(data) < n:
            raise pickle.UnpicklingError("pickle data was truncated")
        self.append(bytearray(data))

    def _load_dict(self) -> None:
        items = self.pop_mark()
        for key in items[::2]:
            values.check_key(key)
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        values.check_key(key)
        self.stack[-1][key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            values.check_key(items[i])
            target[items[i]] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()
        for item in items:
            values.check_key(item)
        target = self.stack[-1]
        if isinstance(target, set):
            target.update(items)
        else:
            for item in items:
                target.add(item)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        for item in items:
            values.check_key(item)
        self.append(frozenset(items))

    def _load_build(self) -> None:
        inst = self.stack[-2]
        if not isinstance(inst, constructors.BUILDABLE):
            raise pickle.UnpicklingError(
                f"pickle sets state on {values.brief(inst)}, which it did not create")
        _BASE_BUILD(self)  # type: ignore[arg-type]

    # -- observed reads only (``observe``): the same opcodes, then a report --

    def _observed_setitems(self) -> None:
        items = self.stack  # the marked run that SETITEMS pops
        meta = self.metastack
        target = meta[-1][-1] if meta and meta[-1] else None
        size = len(target) if isinstance(target, dict) else -1
        self._load_setitems()
        if size >= 0:
            self._added(target, items, size)

    def _observed_setitem(self) -> None:
        stack = self.stack
        target = stack[-3] if len(stack) >= 3 else None
        size = len(target) if isinstance(target, dict) else -1
        pair = stack[-2:]
        self._load_setitem()
        if size >= 0:
            self._added(target, pair, size)

    def _observed_dict(self) -> None:
        items = self.stack
        self._load_dict()
        if items:
            self._added(self.stack[-1], items, 0)

    # a dict pushed a second time sits where it was first made, not (only)
    # here: keys added to it later cannot be placed from the stack. Memo gets
    # are frequent in a torch pickle, hence one Python call each.

    def _observed_binget(self) -> None:
        self._observed_push(self.read(1)[0])

    def _observed_long_binget(self) -> None:
        self._observed_push(_U32(self.read(4))[0])

    def _observed_push(self, index: int) -> None:
        try:
            obj = self.memo[index]
        except KeyError:
            raise _memo_miss(index) from None
        self.append(obj)
        if isinstance(obj, dict):
            self._from_memo.add(id(obj))

    def _observed_get(self) -> None:
        _BASE_GET(self)  # type: ignore[arg-type]
        self._note_pushed_again()

    def _observed_dup(self) -> None:
        _BASE_DUP(self)  # type: ignore[arg-type]
        self._note_pushed_again()

    def _note_pushed_again(self) -> None:
        obj = self.stack[-1]
        if isinstance(obj, dict):
            self._from_memo.add(id(obj))

    def _added(self, target: Any, items: list[Any], size: int) -> None:
        """``items`` (key, value, key, value...) were just set on ``target``, now stack[-1]."""
        if self._observer is None:
            return
        if len(target) - size != len(items) // 2:
            # a key set twice: pickle's Pickler never does that, and an earlier
            # report may now be stale, so nothing more is reported from this read
            self._observer = None
            return
        wanted = self._wanted
        if wanted is not None:
            for value in items[1::2]:
                if isinstance(value, wanted):
                    break
            else:
                return
        path = self._path()
        if path is not None:
            try:
                self._observer(path, list(zip(items[::2], items[1::2], strict=True)))
            except Exception as exc:  # our own code failing: not a bad file
                raise _ObserverFailed(exc) from exc

    def _path(self) -> tuple[str, ...] | None:
        """Keys from the root to the dict on top of the stack, or None if unsure.

        Walking down from the top, each dict must be a value whose str key
        sits just below it, held either by a single ``SETITEM`` still to
        come on the dict two slots down, or by a ``SETITEMS`` batch still to
        come on the dict just below the MARK this run of pairs starts at. The
        Pickler writes a single SETITEM, or starts a new batch, only on a dict
        holding a multiple of BATCHSIZE items; where both readings (or
        neither) fit, the answer is None, as it is when the slot before the
        key holds a class or function (the pair may be what REDUCE or NEWOBJ
        will call it with). The root is the first slot of the bottom level.
        """
        levels = self.metastack
        i = len(levels)
        level = self.stack
        p = len(level) - 1
        node = level[p]
        from_memo = self._from_memo
        path: list[str] = []
        while True:
            if not isinstance(node, dict) or id(node) in from_memo:
                return None
            if p == 0:
                if i == 0:
                    break
                return None  # first slot after a MARK: a key's slot, never a value's
            key = level[p - 1]
            prev = level[p - 2] if p >= 2 else None
            if type(key) is not str or isinstance(prev, _CALLABLES) or (
                    len(path) >= MAX_OBSERVED_DEPTH):
                return None
            single = isinstance(prev, dict) and len(prev) % BATCHSIZE == 0
            owner = levels[i - 1][-1] if i and p % 2 == 1 and levels[i - 1] else None
            batch = isinstance(owner, dict) and len(owner) % BATCHSIZE == 0
            if single == batch:
                return None
            path.append(key)
            if single:
                node, p = prev, p - 2
            else:
                i -= 1
                level = levels[i]
                node, p = owner, len(level) - 1
        path.reverse()
        return tuple(path)


_BASE_BUILD = pickle._Unpickler.dispatch[pickle.BUILD[0]]
_BASE_GET = pickle._Unpickler.dispatch[pickle.GET[0]]
_BASE_DUP = pickle._Unpickler.dispatch[pickle.DUP[0]]
SafeUnpickler.dispatch = _Dispatch(pickle._Unpickler.dispatch)
SafeUnpickler.dispatch.update({
    pickle.STOP[0]: SafeUnpickler._load_stop,
    pickle.FRAME[0]: SafeUnpickler._load_frame,
    pickle.BYTEARRAY8[0]: SafeUnpickler._load_bytearray8,
    pickle.DICT[0]: SafeUnpickler._load_dict,
    pickle.SETITEM[0]: SafeUnpickler._load_setitem,
    pickle.SETITEMS[0]: SafeUnpickler._load_setitems,
    pickle.ADDITEMS[0]: SafeUnpickler._load_additems,
    pickle.FROZENSET[0]: SafeUnpickler._load_frozenset,
    pickle.BUILD[0]: SafeUnpickler._load_build,
    pickle.BINPUT[0]: SafeUnpickler._load_binput,
    pickle.LONG_BINPUT[0]: SafeUnpickler._load_long_binput,
    pickle.BINGET[0]: SafeUnpickler._load_binget,
    pickle.LONG_BINGET[0]: SafeUnpickler._load_long_binget,
})
_OBSERVED_DISPATCH = _Dispatch(SafeUnpickler.dispatch)
_OBSERVED_DISPATCH.update({
    pickle.SETITEMS[0]: SafeUnpickler._observed_setitems,
    pickle.SETITEM[0]: SafeUnpickler._observed_setitem,
    pickle.DICT[0]: SafeUnpickler._observed_dict,
    pickle.GET[0]: SafeUnpickler._observed_get,
    pickle.BINGET[0]: SafeUnpickler._observed_binget,
    pickle.LONG_BINGET[0]: SafeUnpickler._observed_long_binget,
    pickle.DUP[0]: SafeUnpickler._observed_dup,
})


def load(data: bytes | IO[bytes], persistent: PersistentLoader | None,
         seen: GlobalsSeen, embedded: dict[str, Any] | None = None) -> Any:
    """Unpickle one object from ``data`` safely; format errors become CorruptCheckpointError."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    # unpickling makes many small objects and no cycles worth collecting:
    # the collector's passes over them cost more than the read itself
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        obj = SafeUnpickler(stream, persistent, seen, embedded).load()
        check_tree(obj)
        return obj
    except CorruptCheckpointError:
        raise
    except _ObserverFailed as failed:
        raise failed.error from None
    except RecursionError as exc:
        raise CorruptCheckpointError("pickle nests too deeply to read", HINT) from exc
    except MemoryError as exc:
        raise CorruptCheckpointError("pickle asks for more memory than it could hold",
                                     HINT) from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, LookupError,
            AttributeError, ArithmeticError, struct.error) as exc:
        # any of these is a malformed or truncated stream, or a hostile one
        # trying to use an inert stand-in in a way real data never does
        text = str(exc) or type(exc).__name__
        raise CorruptCheckpointError(f"cannot read pickle: {text[:200]}", HINT) from exc
    finally:
        if gc_was_enabled:
            gc.enable()
