"""Seeing a state dict while its pickle is read: ``observe(callback)``.

After each ``SETITEMS``/``SETITEM``/``DICT`` that adds keys to a dict, the
callback gets the dict's path of keys from the root and the pairs just
added, when the stack says where that dict sits (``Observing._path``). The
browser uses it to show the first screenful of a 100,000-tensor file long
before the read ends.

``Observing`` holds the observed opcodes; ``ckptool.read.pickle.unpickler`` mixes
them into its unpickler and switches to their dispatch table only for a
read that is observed, so an unobserved read costs nothing extra.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import types
from collections.abc import Callable, Iterator
from typing import Any

# (path of str keys from the root to a dict, [(key, value) just added to it])
Observer = Callable[[tuple[str, ...], list[tuple[Any, Any]]], None]
BATCHSIZE = 1000  # pairs per SETITEMS that pickle's Pickler (C and Python) writes
MAX_OBSERVED_DEPTH = 32  # deeper dicts are not reported (bounds each report's cost)
# what REDUCE and NEWOBJ call: a pair after one may be its arguments, not dict items
_CALLABLES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class Observation:
    def __init__(self, callback: Observer, values: tuple[type, ...] | None) -> None:
        self.callback = callback
        self.values = values
        self.claimed = False  # by the first object pickle read in its scope


_observer: contextvars.ContextVar[Observation | None] = contextvars.ContextVar(
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
    token = _observer.set(Observation(callback, values))
    try:
        yield
    finally:
        _observer.reset(token)


def claim(object_pickle: bool) -> Observation | None:
    """The observation an unpickler should report to, if any: only the first
    object pickle read in an ``observe`` scope gets it."""
    watch = _observer.get()
    if watch is None or watch.claimed or not object_pickle:
        return None
    watch.claimed = True
    return watch


def pending() -> bool:
    """Whether the next object pickle read here is to report (``claim``)."""
    watch = _observer.get()
    return watch is not None and not watch.claimed


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """No reports from reads in this block (an embedded file's keys are not
    the outer file's)."""
    token = _observer.set(None)
    try:
        yield
    finally:
        _observer.reset(token)


class ObserverFailed(Exception):
    """Carries what an observer raised past ``load``'s net for malformed files."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def memo_miss(index: int) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"memo value not found at index {index}")


class Observing:
    """The observed opcodes: the unpickler's own, then a report. Mixed into
    ``SafeUnpickler``, whose state and base opcodes they use."""

    # the unpickler's, declared for mypy
    stack: list[Any]
    metastack: list[list[Any]]
    memo: dict[int, Any]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    _load_setitems: Callable[[], None]
    _load_setitem: Callable[[], None]
    _load_dict: Callable[[], None]
    _observer: Observer | None
    _wanted: tuple[type, ...] | None
    _from_memo: set[int]  # ids of dicts pushed again from the memo

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
        self._observed_push(int.from_bytes(self.read(4), "little"))

    def _observed_push(self, index: int) -> None:
        try:
            obj = self.memo[index]
        except KeyError:
            raise memo_miss(index) from None
        self.append(obj)
        if isinstance(obj, dict):
            self._from_memo.add(id(obj))

    def _observed_get(self) -> None:
        _BASE_GET(self)
        self._note_pushed_again()

    def _observed_dup(self) -> None:
        _BASE_DUP(self)
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
                raise ObserverFailed(exc) from exc

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


_BASE_GET: Any = pickle._Unpickler.dispatch[pickle.GET[0]]
_BASE_DUP: Any = pickle._Unpickler.dispatch[pickle.DUP[0]]


def observed_dispatch(base: dict[int, Any]) -> dict[int, Any]:
    """``base`` (the unpickler's dispatch table) with the observed opcodes."""
    table = type(base)(base)
    table.update({
        pickle.SETITEMS[0]: Observing._observed_setitems,
        pickle.SETITEM[0]: Observing._observed_setitem,
        pickle.DICT[0]: Observing._observed_dict,
        pickle.GET[0]: Observing._observed_get,
        pickle.BINGET[0]: Observing._observed_binget,
        pickle.LONG_BINGET[0]: Observing._observed_long_binget,
        pickle.DUP[0]: Observing._observed_dup,
    })
    return table
