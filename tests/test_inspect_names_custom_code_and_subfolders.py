"""``inspect`` of a framework folder names what the framework needs beside
the model: the custom code a config's ``auto_map`` names (run by
``from_pretrained(..., trust_remote_code=True)``, never by ckptool), the
tokenizer's, processor's and chat template's files by role, and every
folder inside (an ONNX export, a sentence-transformers module, a folder of
checkpoints of its own). A Python file is only named and copied: neither
``inspect`` nor ``convert`` imports or runs it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptool.cli import main
from ckptool.read.layouts import contents, framework

HERE = Path(__file__).parent / "fixtures" / "frameworks"
REMOTE = HERE / "ecosystem" / "remote_code"


def inspect(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def flat(text: str) -> str:
    """The summary's second column, its wrapped lines joined."""
    return " ".join(line[12:].strip() for line in text.splitlines())


@pytest.mark.parametrize(("name", "role"), [
    ("sentencepiece.bpe.model", "tokenizer"), ("processor_config.json", "processor config"),
    ("preprocessor_config.json", "preprocessor config"), ("chat_template.jinja", "chat template"),
    ("generation_config.json", "generation config"),
    ("modeling_tiny.py", "custom code (trust_remote_code=True runs it)"),
    ("configuration_tiny.py", "custom code (trust_remote_code=True runs it)"),
    ("train.py", "Python file (ckptool never runs it)"), ("model.onnx", "ONNX model"),
    ("tf_model.h5", "the model for another framework (TensorFlow, Flax, Rust)"),
])
def test_the_files_a_framework_needs_have_roles(name: str, role: str) -> None:
    assert framework.role_of(name) == role


def test_a_folder_with_custom_code_says_what_trust_remote_code_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = flat(inspect(str(REMOTE), "--limit", "1", capsys=capsys))
    assert ("configuration_tiny.py, modeling_tiny.py: custom code that auto_map names "
            "(config.json: AutoConfig, AutoModelForCausalLM); from_pretrained(..., "
            "trust_remote_code=True) imports and runs it (ckptool never does)") in text
    assert "onnx/ · 1 file · 11 B · ONNX export" in text
    assert "sentencepiece.bpe.model · 10 B · tokenizer" in text
    assert "processor_config.json · 552 B · processor config" in text


def test_the_json_names_each_files_role(capsys: pytest.CaptureFixture[str]) -> None:
    roles = {c["path"]: c["role"] for c in json.loads(inspect(
        str(REMOTE), "--json", capsys=capsys))["framework"]["companions"]}
    assert roles["modeling_tiny.py"] == "custom code (trust_remote_code=True runs it)"
    assert roles["chat_template.jinja"] == "chat template"


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A model whose auto_map names code in another repository, a file the
    folder lacks, and a tokenizer's (slow, fast) pair; and a .py file that
    would leave a mark if it were ever imported."""
    folder = tmp_path / "elsewhere"
    shutil.copytree(HERE / "llama_tied", folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "org/tiny-code--configuration_tiny.TinyConfig",
                          "AutoModel": "modeling_gone.TinyModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}}))
    mark = tmp_path / "imported"
    (folder / "tokenization_tiny.py").write_text(
        f"open({str(mark)!r}, 'w').write('ran')\nraise SystemExit(9)\n")
    return folder


def test_code_elsewhere_and_code_missing_are_named(
        elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = contents.remote_code(str(elsewhere))
    assert [(c.auto, c.file, c.repo, c.present) for c in code] == [
        ("AutoConfig", None, "org/tiny-code", True),
        ("AutoModel", "modeling_gone.py", None, False),
        ("AutoTokenizer", "tokenization_tiny.py", None, True)]
    text = flat(inspect(str(elsewhere), "--limit", "1", capsys=capsys))
    assert ("tokenization_tiny.py: custom code that auto_map names (tokenizer_config.json: "
            "AutoTokenizer)") in text
    assert ("modeling_gone.py: named by auto_map (config.json: AutoModel) but not in the "
            "folder: trust_remote_code=True fails without it") in text
    assert ("auto_map names code in org/tiny-code (config.json: AutoConfig): "
            "from_pretrained(..., trust_remote_code=True) downloads and runs it") in text


def test_python_files_are_copied_never_run(elsewhere: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    inspect(str(elsewhere), capsys=capsys)
    assert main(["diagnose", str(elsewhere)]) in (0, 1)
    capsys.readouterr()
    assert main(["convert", str(elsewhere), str(tmp_path / "out"), "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "imported").exists()
    assert (tmp_path / "out" / "tokenization_tiny.py").read_bytes() == \
        (elsewhere / "tokenization_tiny.py").read_bytes()
    assert any(n.startswith("modeling_gone.py: named by auto_map") for n in report["notes"])


def test_subfolders_say_what_they_are(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(HERE / "peft_lora", folder)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"onnx")
    (folder / "logs").mkdir()
    (folder / "logs" / "events.out").write_bytes(b"1234")
    found = {s.name: (s.role, len(s.files), s.size) for s in contents.subfolders(str(folder))}
    assert found["onnx"] == ("ONNX export", 1, 4)
    assert found["logs"] == ("folder", 1, 4)
    assert found["base"][0] == "holds checkpoint files of its own"


def test_the_json_names_the_code_and_the_folders(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(inspect(str(REMOTE), "--json", capsys=capsys))
    code = {(c["auto"], c["file"], c["present"]) for c in data["remote_code"]}
    assert ("AutoModelForCausalLM", "modeling_tiny.py", True) in code
    assert ("AutoConfig", "configuration_tiny.py", True) in code
    assert [(s["name"], s["role"]) for s in data["subfolders"]] == [("onnx", "ONNX export")]
