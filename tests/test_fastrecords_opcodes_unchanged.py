"""The check that each pickle frame ends where an opcode ends, before the C
unpickler reads a large ``.metadata`` (``fastrecords._opcodes``, a safety
boundary: a frame that ends inside an opcode shows the C unpickler a
program the grammar never read), matches exactly what it matched as first
written, though its branches are now ordered for speed: the pattern as it
was is kept here, and both run over random programs of whole opcodes cut at
every byte, over their random mutations, and over the frames of a torch
written ``.metadata``.
"""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path

import pytest

from ckptool.read import fastrecords, frames
from ckptool.read.fastpickle import counted

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multifile"

# -- the pattern as first written (ckptool 2026-12, before its branches were reordered)
FIRST = re.compile(b"(?:[qh].|[rj].{4}|K.|M.{2}|J.{4}|\x8a" + counted(1, 9) + b"|\x8c"
                   + counted(1, 256) + b"|c[^\n]*\n[^\n]*\n"
                   + b"|[\x94\x85\x86\x87R)\x81N\x88\x89\x93}\\]usaeb(t.])*+", re.DOTALL)

SINGLE = b"\x94\x85\x86\x87R)\x81N\x88\x89\x93}]usaeb(t."


def opcode(rng: random.Random) -> bytes:
    """One whole opcode of those the grammar admits, its argument random."""
    kind = rng.randrange(9)
    if kind < 3:
        return bytes([rng.choice(SINGLE)])
    if kind == 3:
        return bytes([rng.choice(b"qhK"), rng.randrange(256)])
    if kind == 4:
        return bytes([rng.choice(b"rjJ")]) + rng.randbytes(4)
    if kind == 5:
        return b"M" + rng.randbytes(2)
    if kind == 6:
        n = rng.randrange(9)
        return b"\x8a" + bytes([n]) + rng.randbytes(n)
    if kind == 7:
        n = rng.choice([0, 1, 5, 14, 40, 255])
        return b"\x8c" + bytes([n]) + rng.randbytes(n)
    return b"c" + rng.choice([b"torch", b"a.b", b""]) + b"\n" + rng.choice([b"Size", b""]) + b"\n"


def program(rng: random.Random, count: int) -> tuple[bytes, set[int]]:
    """Whole opcodes one after another, and the offsets where each ends."""
    out, ends = b"", {0}
    for _ in range(count):
        out += opcode(rng)
        ends.add(len(out))
    return out, ends


def test_whole_opcodes_match_and_a_cut_inside_one_does_not() -> None:
    rng = random.Random(18)
    now = fastrecords._opcodes()
    for _ in range(300):
        data, ends = program(rng, rng.randrange(1, 40))
        for cut in range(len(data) + 1):
            matched = now.fullmatch(data, 0, cut) is not None
            assert matched == (FIRST.fullmatch(data, 0, cut) is not None), (data, cut)
            if cut in ends:
                assert matched, (data, cut)


def test_mutated_programs_match_as_they_did() -> None:
    rng = random.Random(35)
    now = fastrecords._opcodes()
    for _ in range(3000):
        data, _ = program(rng, rng.randrange(1, 30))
        mutated = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(mutated) or 1)
            if mutated and rng.random() < 0.5:
                mutated[at] = rng.randrange(256)
            elif mutated and rng.random() < 0.5:
                del mutated[at]
            else:
                mutated.insert(at, rng.choice(SINGLE + b"\n\x00\xff"))
        blob = bytes(mutated)
        for start in (0, rng.randrange(len(blob) + 1)):
            for end in (len(blob), rng.randrange(start, len(blob) + 1)):
                assert ((now.fullmatch(blob, start, end) is None)
                        == (FIRST.fullmatch(blob, start, end) is None)), (blob, start, end)


@pytest.mark.parametrize("name", ["dcp_4ranks/.metadata", "dcp_2ranks_nocollectives/__0.metadata"])
def test_the_frames_of_torch_written_metadata_match_as_they_did(name: str) -> None:
    data = (FIXTURES / name).read_bytes()
    found = frames.bodies(data, 0)
    assert found is not None
    _, bodies = found
    assert bodies  # protocol 4 and 5 pickles are framed
    now = fastrecords._opcodes()
    view = memoryview(data)
    for s, e in bodies:
        for end in range(s, e + 1):  # every cut of the frame: at and inside its opcodes
            assert ((now.fullmatch(view, s, end) is None)
                    == (FIRST.fullmatch(view, s, end) is None)), (name, s, end)
        assert now.fullmatch(view, s, e) is not None


def test_a_frame_cut_inside_a_long_get_is_still_refused() -> None:
    body = b"}\x94j" + struct.pack("<I", 7) + b"."
    now = fastrecords._opcodes()
    assert now.fullmatch(body) is not None
    assert all(now.fullmatch(body, 0, cut) is None for cut in range(3, 7))
