"""A folder transformers 5 wrote in the old key layout is right as it is:
``from_pretrained`` renames its keys at load (Mixtral's and Qwen2-MoE's
experts gathered into one tensor, Llava's ``language_model.*`` moved under
``model.``, ViT's ``encoder.layer`` renamed). Compared with the model, the
names are read as the library loads them; no fix and no ``strict=False``
hint is given for a load-time rename; ``load_state_dict(path, model=...)``
gives the model's names and the gathered tensors as transformers builds
them.

The folders are real (tests/fixtures/frameworks/ecosystem/, written by
transformers 5.25); the models have the keys and shapes the real classes
have (``framework_nets``): here transformers is not installed, so ckptool's
own table of 5.25's renames is what is read (its agreement with the real
library is checked by ``fixtures/frameworks/check_rename_table.py``).
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
from ckptool.check.loading import StateDictMismatch, StateDictMismatchWarning
from ckptool.check.loadnames import from_table, rules
from ckptool.check.modelspec import module_keys
from ckptool.cli import main

CPU = Machine((), False, None, "none", "")
ECOSYSTEM = framework_nets.ECOSYSTEM
EXPECTED = json.loads(framework_nets.EXPECTED.read_text())
RENAMING = ["mixtral", "qwen2_moe", "llava", "vit"]


@pytest.mark.parametrize("name", RENAMING)
def test_a_good_folder_has_no_problem_against_its_model(name: str) -> None:
    ckpt = ckptool.open(str(ECOSYSTEM / name))
    d = diagnose(ckpt, CPU, module_keys(getattr(framework_nets, name)()))
    assert d.findings == [] and d.exit_code == 0
    assert d.keys is not None and d.keys.clean and d.keys.rewrite.empty
    assert d.fix_command is None
    assert d.load_note is not None and "transformers 5.25.0" in d.load_note


@pytest.mark.parametrize("name", RENAMING)
def test_the_cli_prints_no_fix_and_no_strict_false(name: str, capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    code = main(["diagnose", str(ECOSYSTEM / name), "--model",
                 f"{Path(framework_nets.__file__)}:{name}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ckptool fix" not in out and "strict=False" not in out and "--add-prefix" not in out
    assert "at load" in out and "renamed" in out


@pytest.mark.parametrize("name", RENAMING)
def test_load_state_dict_gives_the_models_names_and_tensors(name: str) -> None:
    net = getattr(framework_nets, name)()
    sd = ckptool.load_state_dict(ECOSYSTEM / name, model=net)
    net.load_state_dict(sd, strict=True)
    stored = load_file(str(ECOSYSTEM / name / "model.safetensors"))
    facts = EXPECTED[name]
    for new, old in facts["renamed_at_load"].items():
        if old in stored and new in sd:  # recorded as {old: new}
            assert torch.equal(sd[new], stored[old])
    for old, new in facts["renamed_at_load"].items():
        if old in stored and new in sd:
            assert torch.equal(sd[new], stored[old])
    for target, sources in facts["merged_at_load"].items():
        # transformers' order: each pattern's experts stacked, the stacks joined on axis 1
        groups: dict[str, list[torch.Tensor]] = {}
        for s in sources:
            groups.setdefault(s.rsplit(".", 2)[-2], []).append(stored[s])
        want = torch.cat([torch.stack(g) for g in groups.values()], 1) \
            if len(groups) > 1 else torch.stack(next(iter(groups.values())))
        assert torch.equal(sd[target], want), target


def test_the_table_is_asked_only_where_it_fits_the_model() -> None:
    """A model with the old names (a port of the old class) is compared as saved."""
    ckpt = ckptool.open(str(ECOSYSTEM / "mixtral"))
    old = framework_nets.module_of(framework_nets.stored("mixtral"))
    d = diagnose(ckpt, CPU, module_keys(old))
    assert d.findings == [] and d.load_names is None and d.load_note is None


def test_a_real_difference_beside_the_renames_is_still_found() -> None:
    shapes = framework_nets.recorded("mixtral")
    shapes = {k: v for k, v in shapes.items() if not k.endswith("norm.weight")}
    shapes["model.extra.weight"] = [2, 2]
    d = diagnose(ckptool.open(str(ECOSYSTEM / "mixtral")), CPU,
                 module_keys(framework_nets.module_of(shapes)))
    codes = {f.code for f in d.findings}
    assert {"missing-keys", "unexpected-keys"} <= codes
    assert d.keys is not None and d.keys.missing == ["model.extra.weight"]
    assert all("block_sparse_moe" not in k for k in d.keys.unexpected)


def test_rules_rename_as_transformers_does() -> None:
    names = from_table("llava")
    assert names is not None
    assert names.rename("language_model.lm_head.weight")[0] == "lm_head.weight"
    assert names.rename("language_model.model.norm.weight")[0] == \
        "model.language_model.norm.weight"
    # anchored: a key that only contains the pattern is left alone
    assert names.rename("model.language_model.norm.weight")[0] == \
        "model.language_model.norm.weight"
    moe = from_table("qwen3_moe")
    assert moe is not None
    name, rule, pattern = moe.rename("model.layers.2.mlp.experts.11.up_proj.weight")
    assert name == "model.layers.2.mlp.experts.gate_up_proj" and rule is not None
    assert pattern == "mlp.experts.*.up_proj.weight"
    # a name boundary: the shared expert is not an expert of the list
    assert moe.rename("model.layers.2.mlp.shared_expert.up_proj.weight")[1] is None
    assert from_table("llama") is None


def test_experts_are_gathered_in_numeric_order() -> None:
    keys = [f"m.experts.{i}.w1.weight" for i in (10, 2, 1)]
    assert sorted(keys, key=rules.natural) == [
        "m.experts.1.w1.weight", "m.experts.2.w1.weight", "m.experts.10.w1.weight"]


def _mixtral_copy(tmp_path: Path, change: str) -> Path:
    """The real Mixtral folder with its experts damaged: one expert of layer 0
    left out, one matrix transposed, or every w3 left out."""
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / change
    shutil.copytree(ECOSYSTEM / "mixtral", out)
    sd = load_file(str(out / "model.safetensors"))
    prefix = "model.layers.0.block_sparse_moe.experts"
    if change == "missing_expert":
        sd = {k: v for k, v in sd.items() if not k.startswith(f"{prefix}.3.")}
    elif change == "transposed":
        sd[f"{prefix}.1.w1.weight"] = sd[f"{prefix}.1.w1.weight"].t().contiguous()
    else:
        sd = {k: v for k, v in sd.items() if not k.endswith(".w3.weight")}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("change", ["missing_expert", "transposed", "no_w3"])
def test_gathered_experts_are_checked_as_the_library_builds_them(tmp_path: Path,
                                                                 change: str) -> None:
    folder = _mixtral_copy(tmp_path, change)
    net = framework_nets.mixtral()
    d = diagnose(ckptool.open(str(folder)), CPU, module_keys(net))
    assert d.exit_code == 1
    assert {f.code for f in d.findings} & {"shape-mismatch", "missing-keys"}
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert d.keys is not None
    assert gate_up in d.keys.missing or gate_up in {k for k, _, _ in d.keys.mismatched}
    with pytest.raises(StateDictMismatch):
        ckptool.load_state_dict(folder, model=net)
    with pytest.warns(StateDictMismatchWarning):
        sd = ckptool.load_state_dict(folder, model=net, strict=False)
    assert gate_up not in sd  # never a tensor of the wrong shape
    net.load_state_dict(sd, strict=False)


def test_a_split_makes_one_tensor_per_target() -> None:
    """Dinov2's fused weights_in, split on axis 0 into gate_proj and up_proj."""
    names = from_table("dinov2")
    assert names is not None
    key = "dinov2.encoder.layer.0.mlp.weights_in.weight"
    loaded = names.loaded([key], {})
    (entry,) = loaded.values()
    assert entry.name == "dinov2.encoder.layer.0.mlp.gate_proj.weight"
    assert entry.also == ("dinov2.encoder.layer.0.mlp.up_proj.weight",)
    fused = torch.arange(12.0).reshape(6, 2)
    made = names.make(entry.converter, entry.name, {entry.patterns[0]: [fused]})
    assert torch.equal(made[entry.name], fused[:3]) and torch.equal(made[entry.also[0]], fused[3:])
    assert names.shapes({key: (6, 2)}, {}) == {entry.name: (3, 2), entry.also[0]: (3, 2)}


def test_a_multimodal_base_class_folder_has_its_own_renames() -> None:
    names = from_table("llava", "LlavaModel")
    assert names is not None
    assert names.rename("language_model.model.norm.weight")[0] == "language_model.norm.weight"


def test_the_browsers_findings_pane_says_it_too() -> None:
    from ckptool.tui.findings import findings

    d = diagnose(ckptool.open(str(ECOSYSTEM / "mixtral")), CPU,
                 module_keys(framework_nets.mixtral()))
    text = findings(d).plain
    assert "at load" in text and "transformers 5.25.0 renames the keys" in text
    assert "strict=False" not in text and "ckptool fix" not in text
