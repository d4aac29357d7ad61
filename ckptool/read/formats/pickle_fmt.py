"""Plain pickles (``pickle.dump`` of a dict of arrays, configs...).

Read with the same safe unpickler as torch files, with no persistent ids.
Tensors pickled this way carry their storage as an embedded legacy torch
file (``torch.storage._load_from_bytes``); those bytes are parsed in memory
by the legacy reader, so their location tags are still reported.
"""

from __future__ import annotations

import re
from typing import Any

from ckptool.read import unpickler
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.torch_legacy import read_bytes
from ckptool.read.seen import GlobalsSeen

PICKLE = "pickle"
# protocol 0/1 opening with a GLOBAL: "cmodule\nname\n" (how classic exploits start)
_GLOBAL_FIRST = re.compile(rb"c[A-Za-z_][\w.]*\n[A-Za-z_][\w.]*\n")


def sniff(head: bytes, tail: bytes) -> bool:
    if head[:1] == b"\x80":
        return len(head) > 1 and 2 <= head[1] <= 5
    # protocol 0/1: opens with MARK, an empty dict or list, or a global;
    # ends with STOP
    return (head[:1] in (b"(", b"}", b"]") or bool(_GLOBAL_FIRST.match(head))) and (
        tail.endswith(b"."))


def read(path: str) -> RawRead:
    seen = GlobalsSeen()
    embedded: dict[str, Any] = {}
    with open(path, "rb") as f:
        obj = unpickler.load(f, None, seen, embedded, read_bytes)
    return RawRead(PICKLE, obj, embedded, seen)
