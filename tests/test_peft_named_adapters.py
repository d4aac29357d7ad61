"""PEFT's save_pretrained of a model with several adapters writes "default"
at the top and each other one in a subfolder named for it
(``ecosystem/peft_two_adapters/``: default and ``beta/``); without a
"default" the top holds none (``ecosystem/peft_only_named/``: ``alpha/``,
``beta/``). inspect lists every adapter, convert copies the others along
(or says that one file leaves them out), and a folder of named adapters
only is refused naming each. The folders and what the real PEFT loaded
from them are in expected_ecosystem.json (check_ecosystem.py loads them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.gpus.machine import assumed
from ckptool.errors import EXIT_BAD_INPUT, InputError

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"
TWO = FRAMEWORKS / "ecosystem" / "peft_two_adapters"
NAMED = FRAMEWORKS / "ecosystem" / "peft_only_named"
EXPECTED = json.loads((FRAMEWORKS / "expected_ecosystem.json").read_text())


def test_the_writer_put_them_where_we_read_them() -> None:
    assert set(EXPECTED["peft_two_adapters"]["adapters"]) == {"default", "beta"}
    assert "beta/adapter_model.safetensors" in EXPECTED["peft_two_adapters"]["files"]
    assert set(EXPECTED["peft_only_named"]["adapters"]) == {"alpha", "beta"}
    assert "adapter_config.json" not in EXPECTED["peft_only_named"]["files"]


def test_inspect_lists_every_adapter(run_cli: Callable[..., CliResult]) -> None:
    fw = ckptool.open(TWO).framework
    assert fw is not None and fw.kind == "peft"
    config = EXPECTED["peft_two_adapters"]["adapters"]["beta"]["adapter_config"]
    assert list(fw.adapters) == [
        {"name": "default", "peft_type": "LORA", "path": "adapter_model.safetensors",
         "r": EXPECTED["peft_two_adapters"]["adapters"]["default"]["adapter_config"]["r"]},
        {"name": "beta", "peft_type": config["peft_type"],
         "path": "beta/adapter_model.safetensors", "r": config["r"]}]
    code, out, err = run_cli("inspect", str(TWO))
    assert (code, err) == (0, "")
    assert "adapters    default · LORA r 4 · adapter_model.safetensors" in out
    assert "beta · LORA r 2 · beta/adapter_model.safetensors" in out
    assert "load_adapter(" in out and "adapter_name='beta'" in out
    code, out, _ = run_cli("inspect", str(TWO), "--json")
    assert [a["name"] for a in json.loads(out)["framework"]["adapters"]] == ["default", "beta"]


def test_a_named_adapter_reads_as_an_adapter() -> None:
    ckpt = ckptool.open(TWO / "beta")
    assert ckpt.framework is not None and ckpt.framework.kind == "peft"
    assert set(ckpt.state_dict()) == set(
        EXPECTED["peft_two_adapters"]["adapters"]["beta"]["get_peft_model_state_dict"])


def test_a_folder_of_named_adapters_only_names_each(run_cli: Callable[..., CliResult]) -> None:
    with pytest.raises(InputError) as raised:
        ckptool.open(NAMED)
    assert raised.value.exit_code == EXIT_BAD_INPUT  # as a folder holding two checkpoints
    assert "2 PEFT adapters in subfolders (alpha/, beta/) and none at its top" in \
        raised.value.message
    assert raised.value.hint == f"name one: ckptool inspect {NAMED}/alpha, or {NAMED}/beta"
    code, out, err = run_cli("diagnose", str(NAMED))
    assert code == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 2 and err.startswith("ckptool: error: ")
    assert "no checkpoint" not in err


def test_convert_copies_the_other_adapters(tmp_path: Path,
                                           run_cli: Callable[..., CliResult]) -> None:
    out_dir = tmp_path / "out"
    code, _, err = run_cli("convert", str(TWO), str(out_dir), "--format", "hf", "--dtype",
                           "bf16")
    assert code == 0, err
    for name in ("beta/adapter_config.json", "beta/adapter_model.safetensors"):
        assert (out_dir / name).read_bytes() == (TWO / name).read_bytes()  # as they are
    out = ckptool.open(out_dir)
    assert {t.dtype for t in out.tensors} == {"bfloat16"}
    assert out.framework is not None
    assert [a["name"] for a in out.framework.adapters] == ["default", "beta"]
    code, out_text, _ = run_cli("convert", str(TWO), str(tmp_path / "again"), "--format", "hf")
    assert "the other PEFT adapter beta/ is copied as it is, not converted" in \
        " ".join(out_text.split())


def test_one_file_says_what_it_leaves_out(tmp_path: Path,
                                          run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("convert", str(TWO), str(tmp_path / "one.pth"))
    assert code == 0, err
    said = " ".join(out.split())
    assert "one file holds the adapter read (default) only: the other PEFT adapter beta/" in said
    assert "is not converted" in said


def test_an_adapters_no_problems_line_names_peft_loaders(
        run_cli: Callable[..., CliResult]) -> None:
    d = diagnose(ckptool.open(TWO), assumed(0))
    assert d.findings == []
    code, out, _ = run_cli("diagnose", str(TWO))
    said = " ".join(out.split())
    assert code == 0
    assert f"PeftModel.from_pretrained(base_model, {TWO}) loads this adapter" in said
    assert "set_peft_model_state_dict(peft_model, sd)" in said
    assert "plain torch.load and load_state_dict will take" not in said
