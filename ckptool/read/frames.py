"""Protocol 4 and 5 ``FRAME``\\ s: each must end where an opcode ends.

A frame only groups opcodes for buffered reading, and ``torch.save``
(protocol 2) writes none. CPython's C unpickler, which ``torch.load`` and
``pickle.load`` use, reads through a frame's end as if it were not there,
while the pure-Python unpickler refuses to; a frame that ends inside an
opcode's argument is how a pickle shows one reader a different program
than another. ckptool reads opcodes as the C unpickler does, and refuses
any frame whose end does not fall on an opcode boundary (or its STOP).
``bodies`` finds the frames that follow one another from a pickle's start
(the C unpickler's fast path, ``fastrecords``, reads their contents).
"""

from __future__ import annotations

import pickletools
import struct

from ckptool.errors import RefusedPickleError

HINT = ("torch.save and pickle never write such a frame: the file was made to show "
        "different readers different things; do not load it with torch")


class FrameError(RefusedPickleError):
    """A frame that does not end on an opcode boundary."""


def check(content: bytes, declared: int) -> None:
    """Refuse a frame of ``declared`` bytes whose ``content`` (as many of
    them as the stream holds) does not end on an opcode boundary."""
    if len(content) < declared:
        raise FrameError(
            f"a pickle frame claims {declared} bytes, but only {len(content)} follow", HINT)
    try:  # a STOP appended: reached only when the frame ends where an opcode ends
        for op, _, _ in pickletools.genops(content + b"."):
            if op.name == "STOP":
                return
    except ValueError as exc:
        raise FrameError(
            f"a pickle frame ends inside an opcode ({str(exc)[:80]})", HINT) from exc


def bodies(data: bytes, start: int) -> tuple[int, list[tuple[int, int]]] | None:
    """The protocol and the frames (start and end of each one's contents) of
    the pickle at ``start``: ``[]`` when it has none; None where a frame
    claims more than follows."""
    at, proto = start, 0
    if data[at:at + 1] == b"\x80" and len(data) > at + 1:
        proto, at = data[at + 1], at + 2
    found = []
    while data[at:at + 1] == b"\x95":
        if at + 9 > len(data):
            return None
        (length,) = struct.unpack_from("<Q", data, at + 1)
        if length > len(data) - at - 9:
            return None
        found.append((at + 9, at + 9 + length))
        at += 9 + length
    return proto, found
