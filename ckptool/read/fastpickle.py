"""The fast way through a torch pickle: the C unpickler, where a scan shows
the pickle is one it reads as safely as ckptool's own.

``ckptool.read.pickle.unpickler`` (pure Python, every opcode ours) stays the reader
of record. ``load`` tries this path first for an object pickle (one with
storages) and returns ``None`` whenever it cannot vouch for the result;
the caller then reads the pickle the ordinary way, from its start, and
that read's result or error is the one that counts. A state dict or an
optimizer state of 100,000 tensors reads several times faster this way.

Why the C unpickler is as safe here as the pure one (each point is tested
in ``tests/test_fastpickle.py``):

1. **A grammar, checked first.** Before anything is unpickled, one regular
   expression (run in C) reads the pickle up to its ``STOP`` as a sequence
   of the opcodes torch's pickler (protocol 2) writes for a state dict:
   tensors and parameters in the exact shape of ``torch.save``'s rebuild
   calls, containers, numbers, strings and memo traffic. There is no
   ``EXT1/2/4`` (so ``copyreg``'s cache of live objects is never
   consulted), no ``INST``/``OBJ``/``NEWOBJ``, no sets, no ``DUP``, no
   out-of-band buffer, no text opcode but ``GLOBAL``. Anything else, or
   anything in another order, means the ordinary read.
2. **Bounded hashing.** The pure unpickler checks each dict key before it
   hashes it (``values.check_key``): a tuple nested 100,000 deep overflows
   the C stack, and one holding the same sub-tuple twice at each level
   costs 2**depth. The grammar makes both impossible: a tuple is either
   built of literal numbers and strings only (no memo fetch among its
   items), or is a storage id that ``persistent_load`` checks (strings, a
   storage type, an int) before any other opcode runs, or is the argument
   tuple of a tensor or parameter rebuild (holding an ``OrderedDict``, so
   never hashable). No tuple holds another but those arguments, and there
   are no sets or frozensets.
3. **The memo.** The C unpickler keeps its memo as an array as long as
   twice the largest index stored, and zeroes it: the grammar admits
   ``LONG_BINPUT`` indices only below a limit tied to the pickle's size
   (``memo_bits``), so the memo costs at most 16 bytes per byte of pickle.
4. **Globals.** ``find_class`` resolves a name exactly as the ordinary read
   does (``resolve.resolve_global``) and lets through only torch's tensor
   rebuilds, its storage types and ``OrderedDict``. A function is handed
   to the pickle inside a ``_Global`` made for this read: not a class,
   refusing state; a storage type as the ``StorageType`` the ordinary read
   makes, new for each name and refusing state. Any other name means the
   ordinary read; globals are recorded only once this path has succeeded,
   so none is ever counted twice.
5. **BUILD** sets state only on what is on the stack: containers this read
   made (``OrderedDict._metadata`` is set this way), ``_Global``s (they
   refuse), ckptool's tensor and storage records (``tensors.StorageType``,
   ``StorageRef`` and ``TensorRecord`` define a ``__setstate__`` that
   refuses), or immutable builtins (no attributes to set).
6. **Leaks.** A ``_Global`` that ends up in the tree (a global used as a
   value, not called) would differ from what the ordinary read gives:
   once the unpickler is gone, each must be referenced by nothing but this
   module, or the read goes the ordinary way.

``check_tree`` bounds the finished tree as after any read.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Callable
from functools import cache
from typing import IO, Any

from ckptool.read import constructors, observe, resolve, tensors
from ckptool.read.pickle import policy
from ckptool.read.pickle.unpickler import python3_name

PersistentLoader = Callable[[tuple[Any, ...]], Any]
Named = list[tuple[str, policy.Verdict]]

FAST_REBUILDERS = ("torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2",
                   "torch._utils._rebuild_parameter")
MIN_MEMO_BITS = 16
READ_AHEAD = 1 << 16


def counted(width: int, longest: int, byte: bytes = b"[\x00-\xff]") -> bytes:
    """Any length under ``longest`` in ``width`` little-endian bytes, then that many
    bytes (``byte``: a pattern of any one byte; ``.`` where the caller compiles
    with DOTALL)."""
    pad = b"\x00" * (width - 1)
    return b"(?:" + b"|".join(
        re.escape(bytes([n]) + pad) + (byte + b"{%d}" % n if n else b"")
        for n in range(longest)) + b")"


def below(bits: int, byte: bytes = b"[\x00-\xff]") -> bytes:
    """A 4-byte little-endian index below ``2**bits`` (16 <= bits <= 32;
    ``byte`` as for ``counted``)."""
    full, rest = divmod(bits, 8)
    top = b"[\x00-" + re.escape(bytes([(1 << rest) - 1])) + b"]" if rest else b""
    zeros = b"\x00" * (4 - full - (1 if rest else 0))
    return byte * full + top + re.escape(zeros)


@cache
def grammar(memo_bits: int) -> re.Pattern[bytes]:
    """What this path reads, up to (not including) STOP (points 1-3).

    Built to compile fast (it is compiled in every process that reads a
    pickle): ``.`` under DOTALL for any byte, and a sub-pattern repeated
    side by side written once with a count (``X{2}`` is ``XX``: sre
    compiles the body once and, none of these matching the empty string,
    backtracks through it exactly as through the copies). A change here
    must keep what it matches: ``tests/test_fastpickle_grammar_unchanged.py``
    runs it beside the grammar as first written."""
    b = b"."  # any byte (DOTALL)
    put = b"(?:q" + b + b"|r" + below(memo_bits, b) + b")?"
    get = b"(?:h" + b + b"|j" + b + b"{4})"
    integer = b"(?:K" + b + b"|M" + b + b"{2}|J" + b + b"{4}|\x8a" + counted(1, 10, b) + b")"
    number = b"(?:" + integer + put + b"|G" + b + b"{8}" + put + b"|[\x88\x89N])"
    # a tuple holds numbers only: 1-3 pushed right before TUPLE1-3, or all since its MARK
    numbers = (b"(?:" + number + b"(?:\x85" + put + b"|" + number + b"(?:\x86" + put + b"|"
               + number + b"\x87" + put + b")?)?)")
    flat = (b"(?:(?:\\)|" + number + b"\x85|" + number + b"{2}\x86|" + number + b"{3}\x87"
            b"|\\(" + number + b"*t)" + put + b")")
    string = b"X" + counted(4, 256, b) + put  # BINUNICODE
    short = b"X" + counted(4, 64, b) + put
    glob = b"c[^\n]*\n[^\n]*\n" + put  # GLOBAL: module and name lines
    callee = b"(?:" + get + b"|" + glob + b")"
    text = b"(?:" + get + b"|" + short + b")"  # a string, or one fetched from the memo
    storage_id = (b"\\(" + text + b"(?:" + get + b"|" + glob + b")" + text + b"{2}" + integer
                  + b"t" + put + b"Q")
    hooks = callee + b"\\)R" + put
    tensor = (callee + b"\\(" + storage_id + integer + flat + b"{2}[\x88\x89]" + hooks
              + b"t" + put + b"R" + put)
    parameter = callee + tensor + b"[\x88\x89]" + hooks + b"\x87" + put + b"R" + put
    # MARK, EMPTY_LIST/DICT, LIST, DICT, APPEND(S), SETITEM(S), POP, POP_MARK,
    # REDUCE, BINPERSID, BUILD; PROTO and FRAME
    single = b"[(\\]}ldaesu01RQb]|\x80" + b + b"|\x95" + b + b"{8}"
    tokens = (parameter, tensor, b"\\(" + number + b"*t" + put, b"\\)" + put, numbers,
              string, put[:-1], get, glob, single)
    return re.compile(b"(?:" + b"|".join(tokens) + b")*+", re.DOTALL)


def memo_bits(size: int) -> int:
    """Bits of the largest memo index a pickle of ``size`` bytes may store:
    up to its size (the memo then costs at most 16 bytes a byte), and
    never fewer than 16."""
    bits = MIN_MEMO_BITS
    while bits < 32 and (1 << (bits + 1)) <= size:
        bits += 1
    return bits


def scan(data: bytes, start: int = 0) -> int | None:
    """Where the pickle at ``start`` has its STOP opcode, if the grammar
    reads every opcode before it; None otherwise."""
    found = grammar(memo_bits(len(data) - start)).match(data, start)
    end = found.end() if found else start
    return end if end < len(data) and data[end] == ord(".") else None


class _Global(functools.partial):
    """A global function as this path hands it to the pickle: made for one
    read, called as the function itself (``partial``'s call, in C), never a
    class, refusing state."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("pickle sets state on a global")


def _fast_target(value: Any) -> bool:
    """Whether a resolved global is one this path lets through (point 4)."""
    return (isinstance(value, tensors.StorageType)
            or value is _ORDERED_DICT
            or any(value is tensors.REBUILDERS[name] for name in FAST_REBUILDERS))


_ORDERED_DICT = constructors.safe_callable("collections.OrderedDict")


class _NotFast(Exception):
    """A global this path does not let through."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], persistent: PersistentLoader,
                 handed: list[_Global], named: Named) -> None:
        super().__init__(file)
        self._persistent = persistent
        self._handed = handed
        self._named = named

    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        verdict = policy.classify(module, name)
        value = resolve.resolve_global(module, name, verdict)
        if verdict.category == policy.UNSAFE or not _fast_target(value):
            raise _NotFast(f"{module}.{name}")
        self._named.append((f"{module}.{name}", verdict))
        if isinstance(value, tensors.StorageType):
            return value  # made for this read, as the ordinary read makes it; refuses state
        # ordered_dict checks the keys of the pairs it is given: here the only
        # tuples a call can take are literal numbers (point 2), so no pairs,
        # and OrderedDict itself answers as ordered_dict does
        wrapped = _Global(OrderedDict if value is _ORDERED_DICT else value)
        self._handed.append(wrapped)
        return wrapped

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple:
            raise _NotFast("a persistent id that is not a tuple")
        return self._persistent(pid)


def load(stream: io.BytesIO, persistent: PersistentLoader) -> tuple[Any, Named] | None:
    """The object the pickle at ``stream``'s position holds and the globals
    it named (in order), read by the C unpickler; or None, ``stream`` left
    where it was, when this path cannot vouch for them."""
    if sys.implementation.name != "cpython" or resolve.is_faithful() or observe.pending():
        return None
    start = stream.tell()
    data = stream.getvalue()
    stop = scan(data, start)
    if stop is None:
        return None
    handed: list[_Global] = []
    named: Named = []
    try:
        # buffered: the C unpickler then reads ahead (peek) instead of calling
        # read() for each opcode
        source = io.BytesIO(data)
        source.seek(start)
        obj = _Unpickler(io.BufferedReader(source, READ_AHEAD), persistent, handed,
                         named).load()
    except Exception:  # any failure at all: the ordinary read decides
        return None
    if _leaked(handed):
        return None
    stream.seek(stop + 1)
    return obj, named


def _leaked(handed: list[_Global]) -> bool:
    """Whether anything but ``handed`` still holds one of its globals (point 6)."""
    return any(sys.getrefcount(g) > _UNHELD for g in handed)


_UNHELD = max(sys.getrefcount(g) for g in [_Global(print)])  # the list's, the loop's, the call's
