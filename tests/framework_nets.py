"""Models with exactly the keys and shapes a framework's model class has,
recorded by the real library in ``tests/fixtures/frameworks/expected_ecosystem.json``
(transformers' ``model.state_dict()``) or read from a real base model's
files: the tests compare checkpoints with them without importing
transformers or PEFT. ``diagnose --model tests/framework_nets.py:mixtral``
names one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import tied_nets
from torch import nn

ECOSYSTEM = Path(__file__).resolve().parent / "fixtures" / "frameworks" / "ecosystem"
EXPECTED = ECOSYSTEM.parent / "expected_ecosystem.json"


def module_of(shapes: dict[str, list[int]] | dict[str, tuple[int, ...]]) -> nn.Module:
    """An ``nn.Module`` whose ``state_dict()`` has these keys and shapes
    (zero-filled parameters in nested modules, none tied)."""
    return tied_nets.module(dict(shapes), [], nn.Module)


def recorded(name: str) -> dict[str, list[int]]:
    """The keys and shapes of the transformers model class of ``ecosystem/<name>``."""
    return dict(json.loads(EXPECTED.read_text())[name]["model_state_dict"])


def stored(folder: str) -> dict[str, tuple[int, ...]]:
    """The keys and shapes stored in a real folder's weights (read by ckptool)."""
    import ckptool

    ckpt = ckptool.open(str(ECOSYSTEM / folder))
    return {name: t.shape for name, t in ckpt.state_dict().items()}


def peft_wrapped(base: dict[str, tuple[int, ...]], adapter: dict[str, tuple[int, ...]],
                 name: str = "default") -> dict[str, tuple[int, ...]]:
    """The keys of ``get_peft_model(base)``: the base's under ``base_model.model.``,
    a targeted module's weight as ``base_layer``, the adapter's parts with
    the adapter's name, a module saved whole as ``original_module`` and
    ``modules_to_save.<name>``."""
    targets = {re.sub(r"\.(lora_[AB]|ia3_l)(\..*)?$", "", k.removeprefix("base_model.model."))
               for k in adapter}
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in base.items():
        module, _, leaf = key.rpartition(".")
        if module in targets:
            out[f"base_model.model.{module}.base_layer.{leaf}"] = shape
        elif f"base_model.model.{key}" in adapter:  # saved whole
            out[f"base_model.model.{module}.original_module.{leaf}"] = shape
            out[f"base_model.model.{module}.modules_to_save.{name}.{leaf}"] = shape
        else:
            out[f"base_model.model.{key}"] = shape
    for key, shape in adapter.items():
        m = re.match(r"(.*)\.(lora_[AB]|ia3_l)(\.weight)?$", key)
        if m is not None:
            out[f"{m.group(1)}.{m.group(2)}.{name}{m.group(3) or ''}"] = shape
    return out


def mixtral() -> nn.Module:
    return module_of(recorded("mixtral"))


def qwen2_moe() -> nn.Module:
    return module_of(recorded("qwen2_moe"))


def llava() -> nn.Module:
    return module_of(recorded("llava"))


def vit() -> nn.Module:
    return module_of(recorded("vit"))


def base_llama() -> nn.Module:
    return module_of(recorded("base_llama"))


def base_llama_seqcls() -> nn.Module:
    return module_of(recorded("base_llama_seqcls"))
