"""Protocol 4 and 5 ``FRAME``\\ s: each must end where an opcode ends.

A frame only groups opcodes for buffered reading, and ``torch.save``
(protocol 2) writes none. CPython's C unpickler, which ``torch.load`` and
``pickle.load`` use, reads through a frame's end as if it were not there,
while the pure-Python unpickler refuses to; a frame that ends inside an
opcode's argument is how a pickle shows one reader a different program
than another. ckptool reads opcodes as the C unpickler does, and refuses
any frame whose end does not fall on an opcode boundary (or its STOP).
"""

from __future__ import annotations

import pickletools

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
