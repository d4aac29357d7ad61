"""Plain pickles (``pickle.dump`` of a dict of arrays, configs...).

Read with the same safe unpickler as torch files, with no persistent ids.
Tensors pickled this way carry their storage as an embedded legacy torch
file (``torch.storage._load_from_bytes``); those bytes are parsed in memory
by the legacy reader, so their location tags are still reported. The pickle
is read from the file itself, so each storage's record is the offset in the
file where its bytes lie as they are (protocol 3 and later write ``bytes``
verbatim): tensor values are read in place, as from a legacy file. Protocols
0 to 2 spell bytes as text: those storages have no record.

A file may hold several pickles back to back (``pickle.dump`` called twice;
a payload placed after a harmless first object): every one is read, and
what follows the first is reported. Protocols 0 and 1 have no header: a
file is taken for one when its first opcodes parse as a pickle's.
"""

from __future__ import annotations

import pickletools
import re
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs, pickles
from ckptool.read.formats import torch_legacy
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.torch_legacy import read_bytes
from ckptool.read.seen import GlobalsSeen

PICKLE = "pickle"
# a pickle without a PROTO header may open with any opcode: pickle.load
# never checks that a protocol 0 stream uses protocol 0 opcodes only
_NAME = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
_OLD_FIRST = frozenset(op.code.encode("latin-1")[0] for op in pickletools.opcodes) - {0x80}


def sniff(head: bytes, tail: bytes) -> bool:
    if head[:1] == b"\x80":
        return len(head) > 1 and head[1] <= 5  # PROTO 0 and 1 too: pickle reads them
    return bool(head) and head[0] in _OLD_FIRST and _parses(head)


def _parses(head: bytes) -> bool:
    """Whether the first bytes read as the start of a pickle: unpickled
    (safely, by the same reader) they make an object, or run out before
    their STOP, with every opcode before that one making sense (a text file
    fails early: an unknown opcode, a memo slot never set, a mark missing)."""
    if not _names_read_as_names(head):
        return False
    try:
        pickles.load(head, None, GlobalsSeen(), read_embedded=read_bytes)
    except CorruptCheckpointError as exc:
        cause = exc.__cause__
        return isinstance(cause, EOFError) or "truncated" in str(cause) or (
            "external data" in exc.message)  # a persistent id: what torch files hold
    return True


def _names_read_as_names(head: bytes) -> bool:
    """The first opcode parses, and the module and name of each GLOBAL or
    INST opcode are dotted Python names (``config: 3`` opens with the GLOBAL
    opcode ``c`` too)."""
    count = 0
    try:
        for opcode, arg, _ in pickletools.genops(head):
            count += 1
            if opcode.name in ("GLOBAL", "INST") and not all(
                    _NAME.fullmatch(part) for part in str(arg).split(" ", 1)):
                return False
    except ValueError:
        pass  # the head ends inside an opcode, or the rest is not a pickle's
    return count > 0


def read(path: str) -> RawRead:
    seen = GlobalsSeen()
    embedded: dict[str, Any] = {}
    seen.part = "the pickle"
    with fs.open_binary(path) as f, seen.naming_unsafe():
        obj = pickles.load(f, None, seen, embedded, read_bytes)
        if type(obj) is int and obj == torch_legacy.MAGIC:
            # torch.load takes any file that is not an archive for a legacy
            # one and checks its first pickle's value, not its bytes: this
            # pickle is a legacy file's magic number, written another way
            f.seek(0)
            return torch_legacy.read_stream(f, fs.size_of(f))
        trailing = pickles.scan_rest(f, fs.size_of(f), seen, "the pickle",
                                       read_bytes)
    return RawRead(PICKLE, obj, embedded, seen, warnings=[trailing] if trailing else [])
