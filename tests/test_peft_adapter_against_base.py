"""A PEFT adapter compared with the model it adapts: each module it targets
must exist there with the shapes its weights need; a good adapter is no
problem (PEFT loads it: ``PeftModel.from_pretrained``), never "all keys
missing, try strict=False" nor ``--strip-module``. Against the model
``get_peft_model`` returns, ``load_state_dict`` names the keys as PEFT does.

Real adapters written by peft 0.21 (tests/fixtures/frameworks/ecosystem/:
LoRA with ``modules_to_save=["score"]`` on a sequence classifier, IA3 on a
causal LM; ``peft_lora`` of the first round); the models have the real
classes' keys and shapes (``framework_nets``).
"""

from __future__ import annotations

import json
from pathlib import Path

import framework_nets
import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.gpus.machine import Machine
from ckptool.check.loading import StateDictMismatch
from ckptool.check.modelspec import module_keys
from ckptool.cli import main
from ckptool.errors import UsageError

CPU = Machine((), False, None, "none", "")
ECOSYSTEM = framework_nets.ECOSYSTEM
NETS = Path(framework_nets.__file__)
CASES = [("peft_modules_to_save", "base_llama_seqcls"), ("peft_ia3", "base_llama")]


@pytest.mark.parametrize(("adapter", "base"), CASES)
def test_an_adapter_fits_its_base(adapter: str, base: str) -> None:
    d = diagnose(ckptool.open(str(ECOSYSTEM / adapter)), CPU,
                 module_keys(getattr(framework_nets, base)()))
    assert d.findings == [] and d.exit_code == 0
    assert d.adapter is not None and d.adapter.fits and d.adapter.modules
    assert d.fix_command is None


def test_modules_to_save_are_named_as_saved_whole() -> None:
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_modules_to_save")), CPU,
                 module_keys(framework_nets.base_llama_seqcls()))
    assert d.adapter is not None and d.adapter.saved == ["score"]
    assert {m.rpartition(".")[2] for m in d.adapter.modules} == {"q_proj", "v_proj"}


@pytest.mark.parametrize(("adapter", "base"), CASES)
def test_the_cli_says_peft_loads_it(adapter: str, base: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["diagnose", str(ECOSYSTEM / adapter), "--model", f"{NETS}:{base}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PeftModel.from_pretrained" in out
    for bad in ("--strip", "strict=False", "ckptool fix", "missing"):
        assert bad not in out


def test_an_adapter_for_another_base_is_named() -> None:
    """modules_to_save=["score"] against a causal LM: it has no score."""
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_modules_to_save")), CPU,
                 module_keys(framework_nets.base_llama()))
    assert [f.code for f in d.findings] == ["adapter-mismatch"]
    assert "score.weight" in d.findings[0].message and d.exit_code == 1


def test_a_base_of_another_width_is_named() -> None:
    shapes = {k: [8 if n == 16 else n for n in v]
              for k, v in framework_nets.recorded("base_llama").items()}
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_ia3")), CPU,
                 module_keys(framework_nets.module_of(shapes)))
    assert [f.code for f in d.findings] == ["adapter-mismatch"]


def test_a_target_module_the_base_lacks_is_named() -> None:
    shapes = {k: v for k, v in framework_nets.recorded("base_llama").items()
              if "k_proj" not in k}
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_ia3")), CPU,
                 module_keys(framework_nets.module_of(shapes)))
    assert d.findings and "k_proj" in d.findings[0].message


def test_load_state_dict_names_keys_as_the_wrapped_model_does() -> None:
    stored = load_file(str(ECOSYSTEM / "peft_modules_to_save" / "adapter_model.safetensors"))
    wrapped = framework_nets.module_of(framework_nets.peft_wrapped(
        framework_nets.stored("base_llama_seqcls"),
        {k: tuple(v.shape) for k, v in stored.items()}))
    sd = ckptool.load_state_dict(ECOSYSTEM / "peft_modules_to_save", model=wrapped)
    result = wrapped.load_state_dict(sd, strict=False)
    assert result.unexpected_keys == []
    assert len(sd) == len(stored)
    assert torch.equal(sd["base_model.model.score.modules_to_save.default.weight"],
                       stored["base_model.model.score.weight"])
    lora = "base_model.model.model.layers.0.self_attn.q_proj.lora_A"
    assert torch.equal(sd[f"{lora}.default.weight"], stored[f"{lora}.weight"])


def test_load_state_dict_refuses_the_unwrapped_base_with_the_loader() -> None:
    with pytest.raises(UsageError) as caught:
        ckptool.load_state_dict(ECOSYSTEM / "peft_ia3", model=framework_nets.base_llama())
    assert "PeftModel.from_pretrained" in caught.value.hint


def test_load_state_dict_refuses_an_adapter_that_does_not_fit() -> None:
    with pytest.raises(StateDictMismatch):
        ckptool.load_state_dict(ECOSYSTEM / "peft_modules_to_save",
                                model=framework_nets.base_llama())


def test_a_peft_wrapped_model_is_recognised() -> None:
    stored = load_file(str(ECOSYSTEM / "peft_ia3" / "adapter_model.safetensors"))
    wrapped = framework_nets.module_of(framework_nets.peft_wrapped(
        framework_nets.stored("base_llama"), {k: tuple(v.shape) for k, v in stored.items()}))
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_ia3")), CPU, module_keys(wrapped))
    assert d.findings == [] and d.adapter is not None
    assert d.adapter.wrapped == "default" and d.adapter.fits


# -- every PEFT kind (ecosystem/peft_kinds/, written by make_peft_kinds.py) ------

KINDS_JSON = json.loads((ECOSYSTEM.parent / "expected_peft_kinds.json").read_text())
KINDS = sorted(k for k in KINDS_JSON if k != "versions")


def _wide() -> dict[str, list[int]]:
    """base_llama with hidden size 32 instead of 16 (and each width derived from it)."""
    return {k: [n * 2 if n in (16, 32, 8) else n for n in v]
            for k, v in framework_nets.recorded("base_llama").items()}


@pytest.mark.parametrize("kind", KINDS)
def test_each_peft_kind_fits_its_base(kind: str) -> None:
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_kinds" / kind)), CPU,
                 module_keys(framework_nets.base_llama()))
    assert d.findings == [] and d.adapter is not None and d.adapter.fits, d.adapter


@pytest.mark.parametrize("kind", KINDS)
def test_each_peft_kind_against_a_wider_base_is_named(kind: str) -> None:
    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_kinds" / kind)), CPU,
                 module_keys(framework_nets.module_of(_wide())))
    assert [f.code for f in d.findings] == ["adapter-mismatch"], kind


@pytest.mark.parametrize("kind", KINDS)
def test_each_peft_kind_gets_the_wrapped_models_names(kind: str) -> None:
    wrapped = KINDS_JSON[kind]["wrapped_state_dict"]
    folder = ECOSYSTEM / "peft_kinds" / kind
    stored = load_file(str(folder / "adapter_model.safetensors"))
    sd = ckptool.load_state_dict(folder, model=framework_nets.module_of(wrapped))
    assert len(sd) == len(stored)
    for name, tensor in sd.items():
        assert list(tensor.shape) == wrapped[name], name
        assert name not in framework_nets.recorded("base_llama")  # never a base weight
    assert sorted(t.sum().item() for t in sd.values()) == \
        sorted(t.sum().item() for t in stored.values())


def test_the_browsers_findings_pane_says_peft_loads_it() -> None:
    from ckptool.tui.findings import findings

    d = diagnose(ckptool.open(str(ECOSYSTEM / "peft_ia3")), CPU,
                 module_keys(framework_nets.base_llama()))
    text = findings(d).plain
    assert "adapter" in text and "PeftModel.from_pretrained" in text
