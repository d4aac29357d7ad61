"""The fast way through a pickle of plain records (dataclasses as ``copyreg``
pickles them: ``NEWOBJ`` of the class, then ``BUILD`` of its state): the C
unpickler, where a grammar shows the pickle is one it reads as safely as
ckptool's own.

``torch.distributed.checkpoint``'s ``.metadata`` is one: millions of records
at 1,000 ranks. The caller (``layouts.dcp_fast``) names the globals it may
use; ``read`` returns the tree, or None whenever it cannot vouch for it, and
the caller reads the file the ordinary way (``ckptool.read.pickle``): that
read's result or error is the one that counts. Why this read is as safe
(each point is tested in ``tests/test_fastrecords.py``):

1. **A grammar, checked first** (one regular expression, run in C): no
   ``EXT`` (``copyreg``'s cache), ``INST``/``OBJ``/``NEWOBJ_EX``, persistent
   ids, sets, bytes, ``POP``/``DUP``; ``NEWOBJ`` only of no arguments;
   ``REDUCE`` only of literal numbers or strings (or of a tuple holding a
   tuple of them). A tuple of other values is built only of the words that
   push them, never of a tuple on the stack, and only in two places: handed
   at once to ``BUILD`` (a record's state), or in the dict under the
   format's ``tuple_key``.
2. **Frames** are read through, as the C unpickler reads them, and each must
   end where an opcode ends (``frames``): the C unpickler reads the frames'
   contents with a marker (a global named by a random nonce) where each one
   starts, and must read every marker as an opcode.
3. **Bounded hashing.** A dict key may come from the memo, and hashing a
   tuple nested 100,000 deep crashes the C stack. A tuple of literals is one
   or two deep; one of values under ``tuple_key`` is memoized as a float
   instead (a float no file can write here), so the memo holds none; one
   handed to ``BUILD`` must hold plain values. So no tuple is more than three
   deep, or holds more than ``MAX_ITEMS`` (``MAX_MARKED`` for a state).
4. **The memo**: ``LONG_BINPUT`` indices are bounded by the pickle's size
   (``fastpickle.memo_bits``), so it costs at most 16 bytes a byte.
5. **Globals.** ``find_class`` hands out only what the table names, each
   made for this read: a class of records (slots, no ``__dict__``, not
   callable, a ``__setstate__`` that takes a dict, or for a tuple record a
   tuple of plain values), ``torch.Size`` (C's ``itemgetter(slice(None))``:
   a tuple as it is, never a deeper one), a dtype, or a function of literal
   arguments returning an inert value. None has a ``__dict__`` a ``BUILD``
   could fill; ``BUILD`` on anything but a record fails. Anything else, or
   any failure, and the ordinary read decides.
6. **The same record of what the pickle does** as the ordinary read (but
   the byte each use is at): each global named (in order), each class made
   (``NEWOBJ``) and given state (``BUILD``), each function called. Where the
   ordinary read looks at what a ``BUILD`` sets (a callable a later call may
   reach), the caller checks each record of the tree field by field, and
   that every record given state is in the tree (``Loaded.built``).
"""

from __future__ import annotations

import gc
import io
import operator
import pickle
import re
import secrets
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from ckptool import dtypes
from ckptool.read import frames, observe, resolve
from ckptool.read.fastpickle import READ_AHEAD, below, counted, memo_bits
from ckptool.read.pickle import policy
from ckptool.read.pickle.unpickler import python3_name
from ckptool.read.seen import GlobalsSeen

MAX_ITEMS = 64  # items of a tuple of literals, or under tuple_key
MAX_MARKED = 192  # words between a state tuple's MARK and its TUPLE
TRAP = b"G\x7f\xf8\x00\x00\x00\x00\x0f\xad"  # BINFLOAT of a NaN: what a trapped slot holds
FRAME_NAME = "frame"

# what a global of the table becomes
RECORD, TUPLE_RECORD, SIZE, CONSTANT, CALLED = (
    "record", "tuple-record", "size", "constant", "called")


@cache
def grammar(bits: int, tuple_key: bytes) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """The whole pickle (after PROTO, its STOP included), with the span of
    ``tuple_key``'s dict as group ``tuples``; and the words of that span one
    by one (a tuple's put as group ``put``). Memo puts are MEMOIZE (protocol
    4 and 5: ``bits`` 0) or BINPUT and LONG_BINPUT below ``2**bits``. Each
    word is told by its first byte, the most frequent first, so the scan
    seldom reads a byte twice."""
    b = b"."  # (DOTALL)
    p = b"\x94?" if not bits else b"(?:q" + b + b"|r" + below(bits) + b")?"
    get = b"(?:h" + b + b"|j" + b + b"{4})" + p
    integer = b"(?:K" + b + b"|M" + b + b"{2}|J" + b + b"{4}|\x8a" + counted(1, 9) + b")"
    string = b"\x8c" + counted(1, 256) + p  # SHORT_BINUNICODE (longer: the ordinary read)
    call = b"(?:\x85" + p + b")?R" + p  # REDUCE of (what was just built), or of (it,)
    literal = b"(?:" + integer + b"|" + string + b"|[N\x88\x89])"
    numbers = (integer + b"(?:(?:\x85|" + integer + b"(?:\x86|" + integer + b"\x87))" + p
               + b"(?:" + call + b")?)?")
    key = re.escape(bytes([len(tuple_key)]) + tuple_key)
    values = [get, numbers, b"\\)(?:\x81" + p + b"|" + call + b")?",
              b"\x8c(?!" + key + b")" + counted(1, 256) + p + b"(?:\x85" + p + b"R" + p + b")?",
              b"[N\x88\x89]", b"\x93" + p, b"c[^\n]*\n[^\n]*\n" + p]
    containers = [b"[}\\]]" + p + b"\\(?", b"[usae]\\(?", b"b"]
    value = b"(?:" + b"|".join(values) + b")"
    marked = (b"\\((?:" + literal + b"{0,%d}+t" % MAX_ITEMS + p + b"(?:" + call + b")?|"
              + value + b"{0,%d}+t" % MAX_MARKED + p + b"b)")
    # a record of a flat state (a chunk, a storage index or record), most of
    # such a file, as one word: the same words, matched without alternatives
    short = b"(?:h.|j.{4})"
    size = short + b"\x94?" + integer + b"(?:" + integer + b"\x86|\x85)\x94\x85\x94R\x94"
    field = short + b"(?:" + size + b"|" + short + b"\x94?|" + integer + b")"
    lane = [short + b"\\)\x81\x94\\}\x94\\((?:" + field + b")++ub"] if not bits else []
    words = b"(?:" + b"|".join(lane + values[:3] + containers + values[3:] + [marked]) + b")*+"
    simple = b"(?:" + get + b"|" + string + b"|" + integer + b")"
    tup = (b"(?:" + simple + b"(?:\x85|" + simple + b"(?:\x86|" + simple + b"\x87))|\\("
           + simple + b"{0,%d}+t)" % MAX_ITEMS)
    tuples = b"}" + p + b"\\(?(?:[us]\\(?|" + tup + p + b"|" + simple + b")*+"
    whole = (words + b"(?:\x8c" + key + p + b"(?:(?P<tuples>" + tuples + b")|N)" + words
             + b")?\\.")
    each = b"(?:}" + p + b"\\(?|[us]\\(?|" + tup + b"(?P<put>" + p + b")|" + simple + b")"
    return re.compile(whole, re.DOTALL), re.compile(each, re.DOTALL)


class NotFast(Exception):
    """Something this path does not read; the ordinary read decides."""


# -- what the globals become -----------------------------------------------------

class _RecordMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotFast(f"{cls.__name__} called")  # only NEWOBJ makes a record


class Record(metaclass=_RecordMeta):
    """One record of the pickle: its class's dotted name and what BUILD gave it."""

    __slots__ = ("state",)
    qualname: ClassVar[str] = "?"
    state: Any


class Dtype(str):
    """``torch.<dtype>`` as this read hands it out: its canonical name."""

    __slots__ = ()


class Constant(str):
    """What ``torch.serialization._get_layout(name)`` makes: the name."""

    __slots__ = ()


class Made:
    """What a modelled call made (an enum member, a path): inert."""

    __slots__ = ("args", "name")

    def __init__(self, name: str, args: tuple[Any, ...]) -> None:
        self.name, self.args = name, args


class _Function:
    """A global function as this read hands it out: no ``__dict__``, no state."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __setstate__(self, state: Any) -> None:
        raise NotFast("BUILD on a global")


PLAIN = frozenset({str, int, bool, type(None), Dtype, Constant, Made})


def _constant(name: Any) -> Constant:
    if type(name) is not str:
        raise NotFast("a layout not named by a string")
    return Constant(name)


class _Read:
    """What one read handed out and recorded."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names
        self.nonce = secrets.token_hex(8)
        self.markers = 0
        self.named: list[tuple[str, policy.Verdict]] = []
        self.objects: dict[str, Any] = {}
        self.uses: dict[str, set[str]] = {}
        self.builds: dict[str, list[int]] = {}

    def find(self, module: str, name: str) -> Any:
        if module == self.nonce and name == FRAME_NAME:
            self.markers += 1
            return None
        module, name = python3_name(module, name)
        dotted = f"{module}.{name}"
        kind = self.names.get(dotted)
        if kind is None and module == "torch" and dtypes.canonical(name) is not None:
            kind = "dtype"
        verdict = policy.classify(module, name)
        if kind is None or verdict.category == policy.UNSAFE:
            raise NotFast(dotted)
        self.named.append((dotted, verdict))
        found = self.objects.get(dotted)
        if found is None:
            found = self.objects[dotted] = self._make(dotted, name, kind)
        return found

    def _make(self, dotted: str, name: str, kind: str) -> Any:
        if kind in (RECORD, TUPLE_RECORD):
            return self._record_class(dotted, kind == TUPLE_RECORD)
        if kind == SIZE:
            return operator.itemgetter(slice(None))  # x[:]: a tuple as it is
        if kind == CONSTANT:
            return _Function(_constant)
        if kind == CALLED:
            return _Function(lambda *args: self._called(dotted, args))
        return Dtype(dtypes.canonical(name))

    def _called(self, dotted: str, args: tuple[Any, ...]) -> Made:
        if not all(type(a) in (str, int) for a in args):
            raise NotFast(f"{dotted} called on values that are not literals")
        self.uses.setdefault(dotted, set()).add(policy.CALLED)
        return Made(dotted, args)

    def _record_class(self, dotted: str, tuple_state: bool) -> _RecordMeta:
        uses, builds = self.uses, self.builds.setdefault(dotted, [0])

        def __new__(cls: type[Record]) -> Record:  # the first NEWOBJ of the class only:
            uses.setdefault(dotted, set()).add(policy.CREATED)
            del cls.__new__  # the others are object.__new__'s
            return object.__new__(cls)

        def __setstate__(self: Record, state: Any) -> None:
            if type(state) is not dict and not (
                    tuple_state and type(state) is tuple and PLAIN.issuperset(map(type, state))):
                raise NotFast(f"BUILD of {dotted} with {type(state).__name__}")
            self.state = state
            builds[0] += 1

        return _RecordMeta(dotted.rpartition(".")[2], (Record,), {
            "__slots__": (), "qualname": dotted, "__new__": __new__,
            "__setstate__": __setstate__})

    def record(self, seen: GlobalsSeen) -> None:
        """Into ``seen``, what the ordinary read would have recorded."""
        for dotted, verdict in self.named:
            seen.add(dotted, verdict)
        for dotted, count in self.builds.items():
            if count[0]:
                self.uses.setdefault(dotted, set()).add(policy.BUILT)
        for dotted, uses in self.uses.items():
            for use in sorted(uses):
                seen.use(dotted, use, _WHY[use])


_WHY = {policy.CREATED: "made by NEWOBJ (cls.__new__)",
        policy.BUILT: "its __setstate__ or __dict__ takes the file's state",
        policy.CALLED: "called by the pickle"}


def is_record(obj: Any, qualname: str) -> bool:
    return isinstance(obj, Record) and type(obj).qualname == qualname


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedReader, read: _Read) -> None:
        super().__init__(file)
        self._read = read

    def find_class(self, module: str, name: str) -> Any:
        return self._read.find(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise NotFast("a persistent id")


# -- the read ---------------------------------------------------------------------

@dataclass
class Loaded:
    root: Any
    end: int  # where the pickle ends in the data (after its STOP)
    built: int  # records given state by BUILD
    classes: dict[str, _RecordMeta]  # the record classes handed out, by dotted name
    _read: _Read

    def record(self, seen: GlobalsSeen) -> None:
        """Into ``seen``, what the ordinary read would have recorded (once the
        caller has checked the tree)."""
        self._read.record(seen)


def read(data: bytes, start: int, names: Mapping[str, str], tuple_key: str) -> Loaded | None:
    """The tree of the pickle at ``start``, read by the C unpickler; or None
    when this path cannot vouch for it. ``names``: what each global the format
    may name becomes; tuples of values may sit in the dict under ``tuple_key``."""
    if sys.implementation.name != "cpython" or resolve.is_faithful() or observe.pending():
        return None
    found = frames.bodies(data, start)
    if found is None:
        return None
    proto, bodies = found
    view = memoryview(data)
    if bodies:  # the frames' contents, which must hold the whole pickle
        program: bytes | memoryview = b"".join(view[s:e] for s, e in bodies)
    else:
        program = view[start + (2 if proto else 0):]
    # protocol 4 and 5 memoize with MEMOIZE (a file that does not: the ordinary read)
    whole, each = grammar(0 if proto >= 4 else memo_bits(len(program)), tuple_key.encode())
    matched = whole.match(program)
    if matched is None or (bodies and matched.end() != len(program)):
        return None
    if not all(_opcodes().fullmatch(view, s, e) for s, e in bodies):
        return None  # a frame ends inside an opcode: C would read the marker as its bytes
    traps = _traps(program, *matched.span("tuples"), each)
    if traps is None:
        return None
    state = _Read(names)
    stream = _stream(program, matched.end(), bodies, traps, proto, state.nonce)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of small objects, no cycles worth collecting
    try:
        root = _Unpickler(io.BufferedReader(io.BytesIO(stream), READ_AHEAD), state).load()
    except Exception:  # any failure at all: the ordinary read decides
        return None
    finally:
        if gc_was_enabled:
            gc.enable()
    if state.markers != len(bodies):
        return None  # a frame ends inside an opcode
    end = bodies[-1][1] if bodies else start + (2 if proto else 0) + matched.end()
    classes = {k: v for k, v in state.objects.items() if isinstance(v, _RecordMeta)}
    return Loaded(root, end, sum(c[0] for c in state.builds.values()), classes, state)


@cache
def _opcodes() -> re.Pattern[bytes]:
    """Whole opcodes of those the grammar admits, each told by its first
    byte: a frame the grammar read across must end where one does. (Each
    opcode's first byte picks its branch, so their order does not change what
    matches: the one-byte opcodes, most of a file, come first, a run of them
    in one step.)"""
    return re.compile(b"(?:[\x94\x85\x86\x87R)\x81N\x88\x89\x93}\\]usaeb(t.]++|[rjJ]....|[qhK]."
                      + b"|M..|\x8a" + counted(1, 9) + b"|\x8c" + counted(1, 256)
                      + b"|c[^\n]*\n[^\n]*\n)*+", re.DOTALL)


def _traps(program: bytes | memoryview, start: int, end: int,
           each: re.Pattern[bytes]) -> list[tuple[int, int]] | None:
    """The puts (start, end) right after a tuple in ``program[start:end]``,
    read word by word as the grammar read them; None if they do not follow
    one another to the end."""
    out: list[tuple[int, int]] = []
    if start < 0:
        return out
    at = start
    for word in each.finditer(program, start, end):
        if word.start() != at:
            return None
        at = word.end()
        if word.end("put") > word.start("put"):
            out.append(word.span("put"))
    return out if at == end else None


def _stream(program: bytes | memoryview, stop: int, bodies: list[tuple[int, int]],
            traps: list[tuple[int, int]], proto: int, nonce: str) -> bytes:
    """What the C unpickler reads: the program to its STOP, a marker where
    each frame starts (STACK_GLOBAL of the nonce, POP), each trapped put
    memoizing a float instead (BINFLOAT before it, POP after)."""
    marker = b"\x8c\x10" + nonce.encode() + b"\x8c\x05" + FRAME_NAME.encode() + b"\x930"
    cuts: list[tuple[int, int, bytes]] = []
    offset = 0
    for s, e in bodies:
        cuts.append((offset, 0, marker))
        offset += e - s
    for s, e in traps:
        cuts += [(s, 1, TRAP), (e, 2, b"0")]
    cuts.sort()
    out: list[bytes | memoryview] = [b"\x80" + bytes([proto])] if proto else []
    view, at = memoryview(program), 0
    for pos, _, insert in cuts:
        out += [view[at:pos], insert]
        at = pos
    out.append(view[at:stop])
    return b"".join(out)
