"""The DCP read and convert's plan at scale (issue 35, item 18) take their
shortcuts without changing a result: ``Chunk.plain`` is ``Chunk(...)`` in
every way, the cheap proof that chunks tile a tensor never accepts what the
full check refuses, and a plan reads the state dict once."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from pathlib import Path

import pytest

import ckptool
from ckptool.model import Checkpoint, Chunk
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import dcp_metadata
from ckptool.read.layouts.dcp import _tiles
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.plan import TORCH

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multifile"


@pytest.mark.parametrize("args", [
    ("__1_0.distcp", (128, 0), (128, 512), 12345, 262144, 1, ()),
    ("sub/__0_3.distcp", (), (), 0, 0, None, ("stream.zstd/1",)),
])
def test_plain_chunk_is_the_constructed_chunk(args: tuple) -> None:
    made, plain = Chunk(*args), Chunk.plain(*args)
    assert type(plain) is Chunk
    assert plain == made and hash(plain) == hash(made) and repr(plain) == repr(made)
    assert dataclasses.astuple(plain) == dataclasses.astuple(made)
    assert plain.__dict__ == made.__dict__  # every field, the defaults included
    assert {plain, made} == {made}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.rank = 2  # type: ignore[misc]
    assert dataclasses.replace(plain, raw=True) == dataclasses.replace(made, raw=True)


def _layouts() -> list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """Tensors of up to 2 dimensions and boxes of them: tilings (in order and
    not), gaps, overlaps, boxes outside, empty boxes."""
    out = []
    for shape in [(), (0,), (4,), (4, 3), (2, 0), (3, 2)]:
        spans = [[(o, n) for o in range(d + 2) for n in range(d + 2) if o + n <= d + 1]
                 for d in shape]
        shapes = [tuple(zip(*c, strict=True)) if c else ((), ())
                  for c in itertools.product(*spans)]
        boxes = [(tuple(o), tuple(s)) for o, s in shapes]
        for count in (1, 2, 3):
            for picked in itertools.islice(itertools.product(boxes, repeat=count), 4000):
                out.append((shape, list(picked)))
    return out


def test_the_cheap_tiling_proof_never_accepts_what_the_full_check_refuses() -> None:
    accepted = 0
    for shape, boxes in _layouts():
        if _tiles(shape, [(o, s, None) for o, s in boxes]):
            accepted += 1
            assert dcp_metadata.check_cover(shape, boxes) is None, (shape, boxes)
    assert accepted > 20  # it does prove the common layouts


@pytest.mark.parametrize("shape,boxes,tiles", [
    ((1024, 64), [((128 * i, 0), (128, 64)) for i in range(8)], True),  # row-sharded
    ((8, 6), [((0, 0), (8, 3)), ((0, 3), (8, 3))], True),  # column-sharded
    ((8, 6), [((0, 0), (8, 6))], True),  # whole
    ((8, 6), [((0, 3), (8, 3)), ((0, 0), (8, 3))], False),  # out of order: the full check
    ((8, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6)), ((8, 0), (0, 6))], True),  # an empty slab
    ((8, 6), [((0, 0), (4, 6)), ((3, 0), (5, 6))], False),  # overlap
    ((8, 6), [((0, 0), (4, 6)), ((5, 0), (3, 6))], False),  # gap
    ((8, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6)), ((8, 0), (1, 6))], False),  # outside
    ((8, 6), [((0, 0), (4, 3)), ((4, 0), (4, 3))], False),  # half of each row
    ((8, 6), [], False),
])
def test_the_tiling_proof_on_dcp_layouts(shape: tuple[int, ...], boxes: list, tiles: bool
                                          ) -> None:
    assert _tiles(shape, [(o, s, None) for o, s in boxes]) is tiles
    if tiles:
        assert dcp_metadata.check_cover(shape, boxes) is None


@pytest.mark.parametrize("into", [SAFETENSORS, TORCH])
def test_a_plan_reads_the_state_dict_once(into: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_4ranks", src)
    ckpt = ckptool.open(src)
    expected = convert_plan.plan(ckpt, into)
    calls = []
    real = Checkpoint.state_dict

    def counted(self: Checkpoint) -> dict:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(Checkpoint, "state_dict", counted)
    written = convert_plan.plan(ckpt, into)
    assert len(calls) == 1
    assert written == expected and written.tensors  # the same plan
