"""What real code writes is not flagged: references are data, and what
loading calls is modelled (the other half of tests/test_safety_loader_model.py).

The files in tests/fixtures/safety_benign/ were written by the real writers
(tests/fixtures/make_safety_benign.py): a Lightning 2.6 checkpoint whose
``save_hyperparameters()`` holds ``nn.init`` functions and an activation,
generator states, encoder layers with ``F.gelu``, ``torch.tanh`` as a
value, datasets and their splits, ``torch.return_types``, a dynamically
quantized model, ``types.SimpleNamespace``, ``math`` functions, stdlib
arrays, ``zoneinfo``, numpy ``StringDType`` arrays, ``memmap`` slices and
random states, pandas frames, a TorchScript module and a ``torch.export``
archive. Each reads with no unsafe global, ``inspect`` exits 0 without an
UNSAFE line, and ``ckptool.load`` builds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptool
from ckptool.cli import main

BENIGN = Path(__file__).parent / "fixtures" / "safety_benign"
FILES = sorted(p.name for p in BENIGN.iterdir() if p.is_file())


def test_the_corpus_is_there() -> None:
    assert len(FILES) >= 17, FILES


@pytest.mark.parametrize("name", FILES)
def test_benign_files_are_clean(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = ckptool.open(BENIGN / name)
    assert ckpt.unsafe_globals == [], [(g.name, g.reason) for g in ckpt.globals
                                       if g.category == "unsafe"]
    assert main(["inspect", str(BENIGN / name)]) == 0
    out = capsys.readouterr().out
    assert "UNSAFE" not in out


@pytest.mark.parametrize("name", [n for n in FILES if n.endswith((".pt", ".ckpt"))
                                  and not n.startswith("torchscript")])
def test_benign_files_load(name: str) -> None:
    assert ckptool.load(BENIGN / name) is not None


def test_lightning_hparams_functions_are_references() -> None:
    """nn.init functions and F.gelu in save_hyperparameters(): stored values
    that nothing calls while loading; data, and said why."""
    ckpt = ckptool.open(BENIGN / "lightning_init_hparams.ckpt")
    globs = {g.name: g for g in ckpt.globals}
    for name in ("torch.nn.init.xavier_uniform_", "torch.nn.init.zeros_"):
        assert globs[name].category in ("data", "torch") and not globs[name].uses


def test_pandas_is_custom_and_says_why() -> None:
    """pandas objects unpickle through pandas' own code, which ckptool does
    not model: custom (loading imports pandas and runs it), never clean
    data, and never flagged as an attack (docs/safety.md)."""
    ckpt = ckptool.open(BENIGN / "pandas_frame.pt")
    helpers = [g for g in ckpt.globals if g.name.startswith("pandas") and
               g.name.rsplit(".", 1)[-1].startswith(("_new_", "_unpickle", "__pyx"))]
    assert helpers and all(g.category == "custom" and "pandas" in g.reason for g in helpers)


def test_a_pandas_function_that_is_no_unpickling_helper_is_a_call(tmp_path: Path) -> None:
    from tests.test_malicious import call, g, pkl, s

    path = tmp_path / "eval.pkl"
    path.write_bytes(pkl(call(g("pandas", "eval"), s("1 + 1"))))
    assert ckptool.open(path).unsafe_globals == ["pandas.eval"]


def test_torchscript_classes_are_the_archives_own() -> None:
    ckpt = ckptool.open(BENIGN / "torchscript_module.pt")
    script = [g for g in ckpt.globals if g.name.startswith("__torch__.")]
    assert script and all(g.category == "torch" and "code/" in g.reason for g in script)


FRAMEWORKS = Path(__file__).parent / "fixtures" / "frameworks"
# (ecosystem/: one folder per model; peft_only_named/ holds two adapters, named one by one)
FOLDERS = sorted([p for p in FRAMEWORKS.iterdir() if p.is_dir()
                  and p.name not in ("loader_choice", "ecosystem")]
                 + [p for p in (FRAMEWORKS / "ecosystem").iterdir() if p.is_dir()
                    and p.name not in ("peft_only_named", "peft_kinds")]
                 + list((FRAMEWORKS / "ecosystem" / "peft_kinds").iterdir())
                 + [FRAMEWORKS / "ecosystem" / "peft_only_named" / n for n in ("alpha", "beta")])


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_framework_folders_are_clean(folder: Path) -> None:
    """What transformers, the Trainer, accelerate, PEFT, diffusers and
    sentence-transformers wrote (tests/fixtures/frameworks/): no file of the
    folder, the model or beside it, is flagged."""
    from ckptool.write.flagged import flagged

    targets = [folder / sub for sub in ("checkpoint-2", "unet", "unet_bin")
               if (folder / sub).is_dir()] or [folder]
    for target in targets:
        assert flagged(ckptool.open(target)) == [], target


@pytest.mark.parametrize("name", [n for n in FILES if n.endswith((".pt", ".ckpt"))
                                  and not n.startswith("torchscript")])
def test_fix_rewrites_benign_files(name: str, tmp_path: Path) -> None:
    """fix reads a file faithfully (to write it back as it is): that read's
    verdict is the ordinary read's, so no benign file is refused."""
    out = tmp_path / "out.pt"
    ckptool.fix(str(BENIGN / name), ckptool.FixOptions(to="cpu"), str(out), force=True)
    assert ckptool.open(out).unsafe_globals == []
