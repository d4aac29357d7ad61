"""``convert`` of a model read from a framework's folder into ``--format hf``
or ``hf-bin`` writes the files that framework loads beside the weights: a
sentence-transformers model whole (``modules.json``, every module's folder
with its config and weights), custom code, the tokenizer, processor
configs, a chat template, an ``onnx/`` folder, and files ckptool knows no
role for (named in a note). What resuming training reads, the model's
other forms and other checkpoints are not copied, each named with why.
One process or many write the same folder.

The folders under ``fixtures/frameworks/`` were written by the real
libraries; ``SentenceTransformer(OUT).encode`` and
``from_pretrained(OUT, trust_remote_code=True)`` on these outputs are checked
against the inputs with the libraries themselves (see the fixtures'
README.md), not here.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import on_thread_ranks

import ckptool
from ckptool.cli import main
from ckptool.errors import CkptoolError
from ckptool.write.convert.run import convert as convert_one
from ckptool.write.distributed.run import convert as convert_rank

HERE = Path(__file__).parent / "fixtures" / "frameworks"
ST_FOLDERS = [HERE / "sentence_transformers", HERE / "ecosystem" / "st_dense_normalize"]
REMOTE = HERE / "ecosystem" / "remote_code"


def convert(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    code = main(["convert", *args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out else {}, err


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def same_tensors(a: Path, b: Path) -> bool:
    x, y = ckptool.load_state_dict(a), ckptool.load_state_dict(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("src", ST_FOLDERS, ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", ["hf", "hf-bin"])
def test_a_sentence_transformers_model_is_written_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], src: Path, fmt: str) -> None:
    """modules.json and every module's folder (config and weights) beside
    the transformer: SentenceTransformer(OUT) builds every module."""
    out = tmp_path / "out"
    code, report, err = convert(str(src), str(out), "--format", fmt, capsys=capsys)
    assert code == 0, err
    modules = json.loads((src / "modules.json").read_text())
    have, want = tree(out), tree(src)
    for name in ("modules.json", "sentence_bert_config.json",
                 "config_sentence_transformers.json", "config.json"):
        assert have[name] == want[name]
    for module in modules[1:]:  # Pooling, Dense (and Normalize): byte for byte
        files = {n: b for n, b in want.items() if n.startswith(module["path"] + "/")}
        assert files and all(have[n] == b for n, b in files.items()), module
        assert module["path"] + "/" in " ".join(report["files"])
    assert same_tensors(src, out)
    dense = next(c for c in ckptool.open(out).framework.companions
                 if c.path == "2_Dense/model.safetensors")
    assert dense.format == "safetensors"
    assert "2_Dense/ (2 files)" in report["notes"][0]


def test_custom_code_tokenizer_processor_and_onnx_are_copied(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, report, err = convert(str(REMOTE), str(out), capsys=capsys)
    assert code == 0, err
    want = {n: b for n, b in tree(REMOTE).items() if n != "model.safetensors"}
    have = tree(out)
    assert {n: have[n] for n in want} == want  # every one, byte for byte
    for name in ("modeling_tiny.py", "configuration_tiny.py", "sentencepiece.bpe.model",
                 "processor_config.json", "preprocessor_config.json", "chat_template.jinja",
                 "generation_config.json", "onnx/model.onnx"):
        assert name in want
    code_note = next(n for n in report["notes"] if "trust_remote_code=True" in n)
    assert code_note.startswith("configuration_tiny.py, modeling_tiny.py: custom code")
    assert same_tensors(REMOTE, out)


def test_a_model_file_named_directly_takes_its_folder_along(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, report, err = convert(str(REMOTE / "model.safetensors"), str(out), capsys=capsys)
    assert code == 0, err
    assert {"modeling_tiny.py", "onnx/model.onnx", "config.json"} <= set(report["files"])


@pytest.fixture
def crowded(tmp_path: Path) -> Path:
    """A transformers folder with everything beside the model: unknown
    files and folders, training state, another form of the model, another
    checkpoint, a Trainer checkpoint-N/, a hidden folder."""
    folder = tmp_path / "crowded"
    shutil.copytree(HERE / "llama_tied", folder)
    (folder / "notes.txt").write_text("how it was trained\n")
    (folder / "extra").mkdir()
    (folder / "extra" / "labels.csv").write_text("a,b\n")
    shutil.copy(HERE / "trainer_checkpoint" / "checkpoint-2" / "optimizer.pt", folder)
    shutil.copy(HERE / "trainer_checkpoint" / "checkpoint-2" / "trainer_state.json", folder)
    shutil.copy(HERE / "llama_tied_bin" / "pytorch_model.bin", folder)
    torch.save({"w": torch.ones(2)}, folder / "ema.pt")
    shutil.copytree(HERE / "trainer_checkpoint" / "checkpoint-2", folder / "checkpoint-2")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download.lock").write_text("")
    return folder


def test_unknown_files_are_copied_and_named(crowded: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, report, err = convert(str(crowded), str(tmp_path / "out"), capsys=capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "notes.txt").read_text() == "how it was trained\n"
    assert (tmp_path / "out" / "extra" / "labels.csv").read_text() == "a,b\n"
    assert ("copied extra/ (1 file), notes.txt too, as they are: ckptool knows no role for "
            "them") in report["notes"]


def test_what_is_not_the_model_is_left_and_said_why(crowded: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, report, err = convert(str(crowded), str(tmp_path / "out"), "--format", "hf-bin",
                                capsys=capsys)
    assert code == 0, err
    assert set(os.listdir(tmp_path / "out")) == {
        "pytorch_model.bin", "config.json", "generation_config.json", "notes.txt", "extra"}
    notes = "\n".join(report["notes"])
    assert "not copied: optimizer.pt, trainer_state.json (training state" in notes
    # the .bin written is the converted model.safetensors, not the input's .bin
    assert "not copied: pytorch_model.bin (the model's weights in another form" in notes
    assert "not copied: checkpoint-2/ (a Trainer checkpoint of its own)" in notes
    assert "ema.pt (checkpoints or pickles that are not the model converted" in notes
    assert "not copied: .cache/ (a repository's or a download's records)" in notes
    assert same_tensors(crowded / "model.safetensors", tmp_path / "out")


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo never run",))


def test_a_module_weight_that_runs_code_is_never_copied(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A module's pickle naming os.system: convert refuses the folder; with
    --salvage the output leaves that file out and says so."""
    folder = tmp_path / "st"
    shutil.copytree(ST_FOLDERS[0], folder)
    (folder / "2_Dense" / "model.safetensors").unlink()
    torch.save({"linear.weight": torch.ones(8, 16), "boom": Boom()},
               folder / "2_Dense" / "pytorch_model.bin")
    code, _, err = convert(str(folder), str(tmp_path / "out"), capsys=capsys)
    assert code == 3 and "2_Dense/pytorch_model.bin: posix.system" in err
    code, report, err = convert(str(folder), str(tmp_path / "out"), "--salvage", capsys=capsys)
    assert code == 0, err
    assert not (tmp_path / "out" / "2_Dense" / "pytorch_model.bin").exists()
    assert (tmp_path / "out" / "2_Dense" / "config.json").exists()
    assert any(n.startswith("not copied: 2_Dense/pytorch_model.bin (pickles that name globals")
               for n in report["notes"])


@pytest.mark.parametrize(("out", "fmt", "said"), [
    ("st.pt", None, "one file holds the transformer only"),
    ("st_dcp", "dcp", "a DCP checkpoint holds the transformer only")])
def test_an_output_without_the_modules_names_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str, fmt: str | None,
        said: str) -> None:
    src = ST_FOLDERS[1] / "model.safetensors"
    code, report, err = convert(str(src), str(tmp_path / out),
                                *(["--format", fmt] if fmt else []), capsys=capsys)
    assert code == 0, err
    assert (f"{said}: the sentence-transformers modules 1_Pooling/, 2_Dense/, 3_Normalize/ are "
            "not in it, so SentenceTransformer would not load this model; `--format hf` writes "
            "the whole model folder") in report["notes"]


@pytest.mark.parametrize("src", [ST_FOLDERS[1], REMOTE], ids=lambda p: p.name)
def test_many_ranks_write_the_same_folder(tmp_path: Path, src: Path) -> None:
    one = convert_one(str(src), str(tmp_path / "one"), fmt="hf", dtype="bfloat16")
    said: list[CkptoolError] = []
    results = on_thread_ranks(3, lambda w: convert_rank(
        w, str(src), str(tmp_path / "many"), say=said.append, fmt="hf", dtype="bfloat16"),
        (CkptoolError, OSError))
    assert not said and all(r is None for r in results[1:]), (said, results)
    assert tree(tmp_path / "one") == tree(tmp_path / "many")
    assert (results[0].files, results[0].notes) == (one.files, one.notes)


def test_the_cli_writes_it_too(tmp_path: Path, run_cli: Any) -> None:
    result: CliResult = run_cli("convert", str(ST_FOLDERS[1]), str(tmp_path / "out"))
    assert result[0] == 0, result[2]
    assert "3_Normalize/ (1 file)" in result[1].replace("\n", " ")
