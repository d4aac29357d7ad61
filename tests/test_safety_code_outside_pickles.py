"""Code that runs while loading but is no pickle: a TorchScript archive's
``__setstate__`` methods, and every record a ``.pt2`` archive has
``torch.export.load`` unpickle (every program's pickled weights and
constants, the legacy ``data/weights/<program>.pt`` it prefers, sample
inputs it falls back to ``weights_only=False`` for).

Each archive is written by torch itself and changed the way an attacker
would; the control tests load it with torch in a subprocess and see the
canary appear. ckptool names what runs (which method calls which op), never
runs it, and writes nothing from it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import ckptool
from ckptool.cli import main
from tests.test_malicious import call, g, pkl, s
from tests.test_safety_containers import zip_injected
from tests.test_safety_corpus import CORPUS

PT2 = Path(__file__).parent / "fixtures" / "safety_benign" / "exported.pt2"


def _script_module(canary: Path, path: Path) -> str:
    """A scripted module whose __setstate__ opens a file with torch.from_file."""
    return f'''
class Evil(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.ones(2)

    def forward(self, x):
        return x + self.w

    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:
        return (self.w, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
        self.w = torch.from_file({str(canary)!r}, True, 4)
        self.training = state[1]

torch.jit.script(Evil()).save({str(path)!r})
'''


def _script_class(canary: Path, path: Path) -> str:
    """A script class held by a module, whose own __setstate__ runs on load,
    through a helper method."""
    return f'''
@torch.jit.script
class Holder:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def __getstate__(self) -> torch.Tensor:
        return self.t

    def __setstate__(self, t: torch.Tensor) -> None:
        self.t = self.fresh(t)

    def fresh(self, t: torch.Tensor) -> torch.Tensor:
        return torch.from_file({str(canary)!r}, True, 4)

class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.h = Holder(torch.ones(2))

    def forward(self, x):
        return x + self.h.t

torch.jit.script(Outer()).save({str(path)!r})
'''


SCRIPTS = {"module_setstate": _script_module, "script_class_setstate": _script_class}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each archive (and its canary), scripted by torch in one subprocess
    (TorchScript compiles classes from a file's source)."""
    work = tmp_path_factory.mktemp("scripted")
    made = {name: (work / f"{name}.pt", work / f"{name}.CANARY") for name in SCRIPTS}
    module = work / "make.py"
    module.write_text("import torch\nfrom typing import Tuple\n" + "".join(
        SCRIPTS[name](canary, path) for name, (path, canary) in made.items()))
    subprocess.run([sys.executable, str(module)], check=True, timeout=180)
    return made


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_torchscript_setstate_is_judged(name: str, tmp_path: Path,
                                        scripted: dict[str, tuple[Path, Path]]) -> None:
    path, canary = scripted[name]
    ckpt = ckptool.open(path)
    assert "torch.from_file" in ckpt.unsafe_globals
    glob = next(x for x in ckpt.globals if x.name == "torch.from_file")
    assert "__setstate__" in glob.reason and "code/" in glob.reason
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(out)]) == 3 and not out.exists()
    assert not canary.exists()


def _edit_code(path: Path, dst: Path, old: str, new: str) -> Path:
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(dst, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if "/code/" in info.filename and info.filename.endswith(".py"):
                data = data.decode().replace(old, new).encode()
            out.writestr(info.filename, data)
    return dst


@pytest.mark.parametrize(("old", "new", "named"), [
    # a local name bound to the op, as the serializer writes aliases
    ("self.w = torch.from_file(", "_f = torch.from_file\n    self.w = _f(", "torch.from_file"),
    # an op library outside aten: torch.ops.<library>
    ("self.w = torch.from_file(", "self.w = ops.mylib.run(", "torch.ops.mylib.run"),
    # code ckptool cannot parse is unknown, which fails closed
    ("return None", "return None)", "<code ckptool cannot parse>"),
])
def test_torchscript_code_edited_by_hand_is_still_judged(
        tmp_path: Path, old: str, new: str, named: str,
        scripted: dict[str, tuple[Path, Path]]) -> None:
    path = scripted["module_setstate"][0]
    edited = _edit_code(path, tmp_path / "edited.pt", old, new)
    unsafe = ckptool.open(edited).unsafe_globals
    assert named in unsafe
    if "ops.mylib" in new:
        assert "torch.from_file" not in unsafe  # the edit took


def _code(body: str) -> dict[str, bytes]:
    return {"a/code/__torch__.py": body.encode()}


@pytest.mark.parametrize(("source", "found"), [
    # pure tensor ops, the interpreter's primitives, the archive's own methods
    ("class M(Module):\n"
     "  def __setstate__(self: __torch__.M, s: Tuple[Tensor, bool]) -> NoneType:\n"
     "    self.w = torch.add((s)[0], 1)\n    _0 = ops.prim.unchecked_cast(Tensor, self.w)\n"
     "    self.helper()\n    return None\n"
     "  def helper(self: __torch__.M) -> NoneType:\n    _1 = torch.zeros([2])\n"
     "    return None\n", []),
    # an op reached through the archive's own method
    ("class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    self.helper()\n    return None\n"
     "  def helper(self: __torch__.M) -> NoneType:\n    _1 = torch.save(self, 'x')\n"
     "    return None\n", ["torch.save"]),
    # len(x) is x.__len__(): dunder methods run unnamed
    ("class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    _0 = len(self.h)\n    return None\n"
     "class H:\n  def __len__(self: __torch__.H) -> int:\n"
     "    _1 = torch.from_file('x', True, 4)\n    return 1\n", ["torch.from_file"]),
    # a script function by its qualified name
    ("def f(x: Tensor) -> Tensor:\n  return ops.mylib.run(x)\n"
     "class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    _0 = __torch__.f(s)\n    return None\n", ["torch.ops.mylib.run"]),
    # a local name is judged by what it holds, never as the builtin or
    # method it shadows: annotated, chained, named like an archive method
    ("class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    min : Any = torch.from_file\n    _0 = min('x', True, 4)\n    return None\n",
     ["torch.from_file"]),
    ("class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    forward = _q = torch.from_file\n    _0 = forward('x', True, 4)\n    return None\n"
     "  def forward(self: __torch__.M, x: Tensor) -> Tensor:\n    return x\n",
     ["torch.from_file"]),
    ("class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    m = ops.mylib\n    _0 = m.append(s)\n    return None\n", ["torch.ops.mylib.append"]),
    ("class M(Module):\n  def __setstate__(self: __torch__.M, s: Tensor) -> NoneType:\n"
     "    for f in s:\n      _0 = f(1)\n    return None\n", ["<a call through the local name f>"]),
    # code that is never run at load (forward) is not judged
    ("class M(Module):\n  def forward(self: __torch__.M, x: Tensor) -> Tensor:\n"
     "    return torch.from_file('x', True, 4)\n", []),
])
def test_what_a_setstate_calls(source: str, found: list[str]) -> None:
    from ckptool.read.pickle import torchscript

    assert [f.op for f in torchscript.judge(_code(source))] == found


# -- .pt2 -----------------------------------------------------------------------


def _pt2(dst: Path, extra: dict[str, bytes], replace: dict[str, bytes] | None = None) -> Path:
    replace = replace or {}
    with zipfile.ZipFile(PT2) as src, zipfile.ZipFile(dst, "w") as out:
        root = src.namelist()[0].split("/", 1)[0]
        for info in src.infolist():
            rel = info.filename.split("/", 1)[1]
            out.writestr(info.filename, replace.get(rel, src.read(info)))
        for rel, data in extra.items():
            out.writestr(f"{root}/{rel}", data)
    return dst


def _evil_zip(canary: Path, tmp: Path) -> bytes:
    clean, evil = tmp / "w.pt", tmp / "evil_w.pt"
    torch.save({"w": torch.ones(2)}, clean)
    zip_injected(CORPUS["os_system"].build(canary), clean, evil)
    return evil.read_bytes()


def _second_program(canary: Path, tmp: Path) -> Path:
    """A second program whose weights config pickles one weight: torch.load
    (weights_only=False) of a record ckptool once never looked at."""
    with zipfile.ZipFile(PT2) as z:
        root = z.namelist()[0].split("/", 1)[0]
        model = z.read(f"{root}/models/model.json")
        weights = json.loads(z.read(f"{root}/data/weights/model_weights_config.json"))
        consts = z.read(f"{root}/data/constants/model_constants_config.json")
        sample = z.read(f"{root}/data/sample_inputs/model.pt")
    first = next(iter(weights["config"]))
    weights["config"][first] = {**weights["config"][first], "path_name": "weight_evil",
                                "use_pickle": True}
    return _pt2(tmp / "two.pt2", {
        "models/other.json": model, "data/sample_inputs/other.pt": sample,
        "data/weights/other_weights_config.json": json.dumps(weights).encode(),
        "data/constants/other_constants_config.json": consts,
        "data/weights/weight_evil": _evil_zip(canary, tmp)})


PT2_ATTACKS = {
    "legacy_weights_torch_prefers": lambda c, t: _pt2(
        t / "legacy.pt2", {"data/weights/model.pt": _evil_zip(c, t)}),
    "sample_inputs_not_a_zip": lambda c, t: _pt2(
        t / "sample.pt2", {}, {"data/sample_inputs/model.pt": pkl(call(
            g("os", "system"), s(f"touch {c}")))}),
    "second_program_pickled_weight": _second_program,
}


@pytest.fixture(scope="module")
def pt2_attacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    made = {}
    for name, make in PT2_ATTACKS.items():
        work = tmp_path_factory.mktemp(name)
        # not named CANARY: test_malicious looks for those, which no read may make
        made[name] = (make(work / "RAN", work), work / "RAN")
    return made


@pytest.mark.parametrize("name", sorted(PT2_ATTACKS))
def test_every_record_torch_export_unpickles_is_judged(
        name: str, tmp_path: Path, pt2_attacks: dict[str, tuple[Path, Path]]) -> None:
    path, canary = pt2_attacks[name]
    assert "os.system" in ckptool.open(path).unsafe_globals
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(out)]) == 3 and not out.exists()
    assert not canary.exists()


CONTROL = """
import sys, torch
for kind, path in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        torch.jit.load(path) if kind == "jit" else torch.export.load(path)
    except Exception:
        pass  # many fail after they ran: only the canary counts
"""


def test_the_control_torch_runs_every_one(scripted: dict[str, tuple[Path, Path]],
                                          pt2_attacks: dict[str, tuple[Path, Path]]) -> None:
    """Every archive above runs its payload under torch's own loader (run
    last: the canaries it makes would fail the tests above)."""
    args = [a for path, _ in scripted.values() for a in ("jit", str(path))]
    args += [a for path, _ in pt2_attacks.values() for a in ("pt2", str(path))]
    subprocess.run([sys.executable, "-c", CONTROL, *args], check=True, timeout=300,
                   capture_output=True)
    ran = {name: canary.exists() for name, (_, canary) in {**scripted, **pt2_attacks}.items()}
    assert all(ran.values()), ran


def test_a_pt2_record_too_large_to_read_is_unsafe(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.read.formats import pt2

    monkeypatch.setattr(pt2, "MAX_SAMPLE", 16)
    ckpt = ckptool.open(PT2)
    assert ckpt.unsafe_globals == [pt2.UNREAD]
    assert "weights_only=False" in ckpt.globals[0].reason


def test_the_benign_archive_stays_clean() -> None:
    ckpt = ckptool.open(PT2)
    assert ckpt.unsafe_globals == [] and ckpt.tensors
    assert io.BytesIO  # the module's imports are all used
