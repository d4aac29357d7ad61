"""Plain pickles (``pickle.dump`` of a dict of arrays, configs...).

Read with the same safe unpickler as torch files, with no persistent ids.
Tensors pickled this way carry their storage as an embedded legacy torch
file (``torch.storage._load_from_bytes``); those bytes are parsed in memory
by the legacy reader, so their location tags are still reported.

A file may hold several pickles back to back (``pickle.dump`` called twice;
a payload placed after a harmless first object): every one is read, and
what follows the first is reported. Protocols 0 and 1 have no header: a
file is taken for one when its first opcodes parse as a pickle's.
"""

from __future__ import annotations

import os
import pickletools
from typing import Any

from ckptool.read import pickles
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.torch_legacy import read_bytes
from ckptool.read.seen import GlobalsSeen

PICKLE = "pickle"
# opcodes that no text file starts with, as a protocol 0/1 pickle may: MARK,
# GLOBAL, INT, LONG, STRING, UNICODE, FLOAT, NONE, EMPTY_LIST/DICT/TUPLE and
# the protocol 1 binary forms (BININT*, BINSTRING, SHORT_BINSTRING,
# BINUNICODE, BINFLOAT)
_OLD_FIRST = frozenset(b"(cILSVFN]})JKMTUXG")
_MIN_OPCODES = 3  # a head that parses this far (or to its STOP) is a pickle
_HEAD = 512  # bytes ckptool.read.formats looks at to recognise a file


def sniff(head: bytes, tail: bytes) -> bool:
    if head[:1] == b"\x80":
        return len(head) > 1 and 2 <= head[1] <= 5
    return bool(head) and head[0] in _OLD_FIRST and _parses(head)


def _parses(head: bytes) -> bool:
    """Whether the first bytes are a protocol 0/1 pickle's opcodes: at least a
    few of them, or a whole pickle, or as many as fit before a long argument
    that runs past the bytes looked at (a command string, say)."""
    count = 0
    try:
        for opcode, _, _ in pickletools.genops(head):
            count += 1
            if opcode.name == "STOP" or count >= _MIN_OPCODES:
                return True
    except (ValueError, UnicodeDecodeError) as exc:
        # an opcode it does not know; or the bytes looked at end inside one
        cut = any(w in str(exc) for w in ("no newline", "not enough data", "only"))
        return count >= 1 and cut and len(head) >= _HEAD
    return False


def read(path: str) -> RawRead:
    seen = GlobalsSeen()
    embedded: dict[str, Any] = {}
    seen.part = "the pickle"
    with open(path, "rb") as f, seen.naming_unsafe():
        obj = pickles.load(f, None, seen, embedded, read_bytes)
        trailing = pickles.scan_rest(f, os.fstat(f.fileno()).st_size, seen, "the pickle",
                                       read_bytes)
    return RawRead(PICKLE, obj, embedded, seen, warnings=[trailing] if trailing else [])
