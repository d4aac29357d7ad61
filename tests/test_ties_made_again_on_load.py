"""A tie the model makes again as it loads is no problem, and the folder
line says "tied input and output embeddings" only of a model that has an
output embedding tied to its input one.

The folders were written by transformers 5.25 (``ecosystem/``, see
``make_ecosystem.py``) and 4.57 (``t5_457_bin/``, ``bert/``); the models
are ``tests/tied_nets.py``'s imitations of the transformers classes (keys,
shapes and ties as the library recorded them), so no transformers is needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import tied_nets
import torch
from conftest import CliResult

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.finding import INFO, WARNING
from ckptool.check.gpus.machine import assumed
from ckptool.check.modelspec import module_keys
from ckptool.describe import framework_line

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"
ECOSYSTEM = FRAMEWORKS / "ecosystem"
EXPECTED = json.loads((FRAMEWORKS / "expected_ecosystem.json").read_text())
TIED = ("t5", "bart", "whisper", "opt", "gemma", "roberta", "qwen2_tied")
CPU = assumed(0)
LABEL = "tied input and output embeddings"


@pytest.mark.parametrize("name", TIED)
def test_a_good_tied_folder_has_no_finding_and_one_note(name: str) -> None:
    """save_pretrained leaves out the names the model ties (recorded by the
    library as not stored); from_pretrained ties them again."""
    model: Callable[[], torch.nn.Module] = getattr(tied_nets, name)
    d = diagnose(ckptool.open(ECOSYSTEM / name), CPU, module_keys(model()))
    assert d.findings == [] and d.exit_code == 0 and d.fix_command is None
    [note] = d.notes
    assert (note.code, note.severity) == ("tied-keys", INFO)
    assert set(note.keys) == set(EXPECTED[name]["model_not_stored"])
    assert "ties them again as it loads" in note.message
    assert note.fix is None and "ckptool.load_state_dict(path, model=model)" in (note.snippet or "")


@pytest.mark.parametrize("name", TIED)
def test_the_snippet_it_gives_loads_strictly(name: str) -> None:
    """ckptool.load_state_dict(path, model=model) gives every tied name, so a
    strict load_state_dict takes it, the tied names holding their twin's values."""
    model = getattr(tied_nets, name)()
    sd = ckptool.load_state_dict(ECOSYSTEM / name, model=model)
    assert not model.load_state_dict(sd).missing_keys
    stored = ckptool.load_state_dict(ECOSYSTEM / name)
    for group in EXPECTED[name]["aliased_in_memory"]:
        kept = next(k for k in group if k in stored)
        assert all(torch.equal(sd[k], stored[kept]) for k in group)


def test_a_model_whose_constructor_alone_ties_still_warns() -> None:
    """Without tie_weights (a plain nn.Module), plain strict loading fails:
    still a warning, with strict=False."""
    d = diagnose(ckptool.open(ECOSYSTEM / "t5"), CPU, module_keys(tied_nets.plain_t5()))
    assert [(f.code, f.severity) for f in d.findings] == [("tied-keys", WARNING)]
    assert d.notes == [] and d.exit_code == 1
    assert "strict=False" in (d.findings[0].snippet or "")


def test_a_model_without_a_head_has_nothing_tied() -> None:
    d = diagnose(ckptool.open(ECOSYSTEM / "roberta_base"), CPU,
                 module_keys(tied_nets.roberta_base()))
    assert d.findings == [] and d.notes == []


def test_the_cli_says_the_note_and_exits_0(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("diagnose", str(ECOSYSTEM / "t5"), "--model",
                             f"{tied_nets.__file__}:t5")
    assert (code, err) == (0, "")
    assert "info    tied-keys" in out and "warning" not in out
    assert "no problems found: from_pretrained loads it and ties the names above again" in out
    code, out, _ = run_cli("diagnose", str(ECOSYSTEM / "whisper"), "--model",
                           f"{tied_nets.__file__}:whisper", "--json")
    data = json.loads(out)
    assert code == 0 and data["exit_code"] == 0 and data["findings"] == []
    assert [(n["code"], n["severity"], n["keys"]) for n in data["notes"]] == [
        ("tied-keys", "info", ["proj_out.weight"])]


@pytest.mark.parametrize(("folder", "tied"), [
    ("ecosystem/t5", True), ("ecosystem/roberta", True), ("ecosystem/qwen2_tied", True),
    ("ecosystem/roberta_base", None),  # RobertaModel: config says True, no head to tie
    ("ecosystem/base_llama_seqcls", None),  # a classifier: no output embedding
    ("ecosystem/st_dense_normalize", None),  # BertModel under sentence-transformers
    ("llama_untied", False),
    ("bert", True),  # transformers 4.57 left tie_word_embeddings out: its default, True
    ("t5_457_bin", True),  # the same, a .bin holding every tied name
])
def test_the_tied_label_is_said_of_a_tied_head_only(folder: str, tied: bool | None) -> None:
    fw = ckptool.open(FRAMEWORKS / folder).framework
    assert fw is not None and fw.tie_word_embeddings is tied
    assert (LABEL in framework_line(fw)) is bool(tied)


def test_a_457_config_leaves_the_tie_out() -> None:
    """What the label is read from: transformers 4.57 wrote no
    tie_word_embeddings, and the .bin keeps the four tied names on one storage."""
    config = json.loads((FRAMEWORKS / "t5_457_bin" / "config.json").read_text())
    assert "tie_word_embeddings" not in config and config["transformers_version"] == "4.57.6"
    ckpt = ckptool.open(FRAMEWORKS / "t5_457_bin")
    names = {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
             "lm_head.weight"}
    assert len({ckpt.state_dict()[n].storage for n in names}) == 1
