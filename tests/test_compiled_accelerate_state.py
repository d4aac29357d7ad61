"""accelerate's save_state of a torch.compile'd model keeps '_orig_mod.' in
every name, and Accelerator.load_state loads the folder as it is into the
model compiled as when it was saved (the real library's results are in
expected_ecosystem.json: stripped, load_state fails). So diagnose offers
no strip for the folder, a note says why, and explain of an error loading
it says the same; a bare model takes the weights through
ckptool.load_state_dict.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import tied_nets
import torch
from conftest import CliResult
from safetensors.torch import load_file

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.explain.run import explain, with_checkpoint
from ckptool.check.finding import INFO
from ckptool.check.gpus.machine import assumed

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"
FOLDER = FRAMEWORKS / "ecosystem" / "accelerate_compiled"
FACTS = json.loads((FRAMEWORKS / "expected_ecosystem.json").read_text())["accelerate_compiled"]
CPU = assumed(0)
TIE = ["lm_head.weight", "model.embed_tokens.weight"]  # the tiny llama ties its head


def compiled() -> torch.nn.Module:
    """The model accelerate prepared: torch.compile's names, '_orig_mod.' first."""
    return tied_nets.module(FACTS["model_state_dict"], [["_orig_mod." + n for n in TIE]])


def bare() -> torch.nn.Module:
    return tied_nets.module({k.removeprefix("_orig_mod."): v for k, v in
                             FACTS["model_state_dict"].items()}, [TIE])


def test_the_library_loads_it_as_written_and_not_stripped() -> None:
    """What the fixture script recorded from Accelerator.load_state."""
    assert FACTS["compiled"].startswith("torch.compile(model) before accelerator.prepare")
    said = FACTS["load_state"]
    assert said["as_written_into_compiled"] == "ok"
    assert said["orig_mod_stripped_into_compiled"].startswith("RuntimeError")


@pytest.mark.parametrize("path", [FOLDER, FOLDER / "model.safetensors"])
def test_diagnose_offers_no_strip_and_says_why(path: Path) -> None:
    d = diagnose(ckptool.open(path), CPU)
    assert "key-prefix" not in [f.code for f in d.findings]
    assert d.fix_command is None and all(f.fix is None for f in d.findings)
    [note] = d.notes
    assert (note.code, note.severity) == ("framework-prefix", INFO)
    assert "Accelerator.load_state loads them as they are" in note.message
    assert "ckptool.load_state_dict(path, model=model)" in (note.snippet or "")


def test_the_cli_prints_no_fix_command(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("diagnose", str(FOLDER))
    assert err == "" and "info    framework-prefix" in out
    assert "--strip" not in out and "fix everything" not in out
    # what is left is accelerate_state's: 'model.' with no config to say whose
    assert code == 1 and "warning ambiguous-prefix" in out
    code, out, _ = run_cli("diagnose", str(FOLDER), "--json")
    data = json.loads(out)
    assert code == data["exit_code"] == 1
    assert [n["code"] for n in data["notes"]] == ["framework-prefix"]
    assert [f["code"] for f in data["findings"]] == ["ambiguous-prefix"]
    assert data["fix_command"] is None


def test_a_bare_model_takes_the_weights_as_the_note_says() -> None:
    model = bare()
    sd = ckptool.load_state_dict(FOLDER, model=model)
    assert not model.load_state_dict(sd).missing_keys
    stored = load_file(FOLDER / "model.safetensors")
    assert all(torch.equal(sd[k.removeprefix("_orig_mod.")], v) for k, v in stored.items())


def test_explain_of_a_bare_models_error_says_load_state_loads_it() -> None:
    """The error a bare model gives, explained with the folder: the strip
    writes a copy for that bare model, and the note says what load_state does."""
    with pytest.raises(RuntimeError) as raised:
        bare().load_state_dict(load_file(FOLDER / "model.safetensors"))
    exp = with_checkpoint(explain(f"RuntimeError: {raised.value}"), ckptool.open(FOLDER), None,
                          CPU)
    assert exp.diagnosis is not None and exp.diagnosis.keys is not None
    assert exp.diagnosis.keys.rewrite.strip == "_orig_mod."
    assert any("Accelerator.load_state loads it as it is" in n and "does not read" in n
               for n in exp.notes)


def test_explain_of_a_stripped_folder_restores_it(tmp_path: Path,
                                                  run_cli: Callable[..., CliResult]) -> None:
    """A folder stripped by hand fails in the compiled model: explain's
    command, run as printed and put in place, gives the names accelerate wrote."""
    folder = tmp_path / "state"
    shutil.copytree(FOLDER, folder)
    stripped = tmp_path / "stripped.safetensors"
    assert run_cli("fix", str(folder / "model.safetensors"), "--strip-prefix", "_orig_mod.",
                   "-o", str(stripped), "-q")[0] == 0
    stripped.replace(folder / "model.safetensors")
    with pytest.raises(RuntimeError) as raised:
        compiled().load_state_dict(load_file(folder / "model.safetensors"))
    exp = with_checkpoint(explain(f"RuntimeError: {raised.value}"), ckptool.open(folder), None,
                          CPU)
    assert any("put the copy in its place" in n for n in exp.notes)
    assert exp.fix_command is not None and "--add-prefix _orig_mod." in exp.fix_command
    code, _, _ = run_cli(*shlex.split(exp.fix_command)[1:], "-q")
    assert code == 0
    assert exp.diagnosis is not None and exp.diagnosis.fix_output is not None
    Path(exp.diagnosis.fix_output).replace(folder / "model.safetensors")
    again, before = load_file(folder / "model.safetensors"), load_file(FOLDER / "model.safetensors")
    assert again.keys() == before.keys()
    assert all(torch.equal(again[k], v) for k, v in before.items())
