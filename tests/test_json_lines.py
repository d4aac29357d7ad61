"""``inspect --json`` writes its tensor and storage lines as text
(``ckptool.cli.json_lines``): the same text as encoding their dicts."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptool
from ckptool.cli.common import dumps
from ckptool.cli.inspect import inspect_dict, inspect_json
from ckptool.model import StorageInfo, TensorInfo

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CASES = sorted(p for p in (ROOT / "samples").iterdir() if not p.name.startswith(("make_", ".")))
CASES += [FIXTURES / "deepspeed" / "z2_ws3", FIXTURES / "deepspeed" / "lightning_z3.ckpt"]
CASES += sorted(FIXTURES.glob("*.pth")) + sorted(FIXTURES.glob("*.ckpt"))
CASES += sorted(p for p in (FIXTURES / "multifile").iterdir() if not p.name.endswith(".py"))


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_lines_are_what_the_encoder_writes(path: Path) -> None:
    try:
        ckpt = ckptool.open(path)
    except ckptool.CkptoolError:
        pytest.skip("not a checkpoint ckptool reads")
    assert dumps(inspect_json(ckpt)) == dumps(inspect_dict(ckpt))
    assert dumps(inspect_json(ckpt, "weight")) == dumps(inspect_dict(ckpt, "weight"))


def test_odd_text_is_escaped_as_the_encoder_escapes_it() -> None:
    odd = 'a"b\\c\n\x00é😀\u2028/'
    t = TensorInfo(odd, (2, 0, 3), "float32", (3, 3, 1), 7, odd, None, 0, True, True,
                   subclass=odd)
    s = StorageInfo(odd, "float32", None, 0, None, (odd, "x"))
    ckpt = ckptool.open(ROOT / "samples" / "dataparallel_cuda2.pth")
    ckpt.tensors[:] = [t]
    ckpt.storages.clear()
    ckpt.storages[odd] = s
    assert dumps(inspect_json(ckpt)) == dumps(inspect_dict(ckpt))
