"""Models with the keys, shapes and ties of the transformers classes of
``tests/fixtures/frameworks/ecosystem/`` (T5, BART, Whisper, OPT, Gemma,
RoBERTa, tied Qwen2; ``roberta_base``: a ``RobertaModel``, no head), as
the real library recorded them in ``expected_ecosystem.json``: each group of
names aliased in memory is one parameter, and each model has a
``tie_weights()``, as a transformers model does (``from_pretrained`` calls
it). ``plain_t5`` is the same model without it: a model whose constructor
alone ties the names. No transformers needed:

    ckptool diagnose tests/fixtures/frameworks/ecosystem/t5 --model tests/tied_nets.py:t5
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

EXPECTED = Path(__file__).resolve().parent / "fixtures" / "frameworks" / "expected_ecosystem.json"


class Plain(nn.Module):
    """Its constructor ties the names; nothing ties them again."""


class TransformersLike(Plain):
    def tie_weights(self) -> None:
        """transformers' ``from_pretrained`` ties the names again after loading."""


def build(name: str, cls: type[nn.Module] = TransformersLike) -> nn.Module:
    """The model of ``ecosystem/<name>`` as the library recorded it."""
    facts = json.loads(EXPECTED.read_text())[name]
    named = type(facts["model_class"], (cls,), {})  # said as the real class is
    return module(facts["model_state_dict"], facts.get("aliased_in_memory", []), named)


def module(shapes: dict[str, list[int]], groups: list[list[str]],
           cls: type[nn.Module] = TransformersLike) -> nn.Module:
    """A ``cls`` whose ``state_dict()`` has these keys and shapes, each of
    ``groups`` one parameter under every name of it."""
    root = cls()
    made: dict[str, nn.Parameter] = {}
    twin = {k: group[0] for group in groups for k in group}
    for key, shape in shapes.items():
        *path, leaf = key.split(".")
        node: nn.Module = root
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        first = twin.get(key, key)
        if first not in made:
            made[first] = nn.Parameter(torch.zeros(tuple(shape)))
        node.register_parameter(leaf, made[first])
    return root


def t5() -> nn.Module:
    return build("t5")


def bart() -> nn.Module:
    return build("bart")


def whisper() -> nn.Module:
    return build("whisper")


def opt() -> nn.Module:
    return build("opt")


def gemma() -> nn.Module:
    return build("gemma")


def roberta() -> nn.Module:
    return build("roberta")


def qwen2_tied() -> nn.Module:
    return build("qwen2_tied")


def roberta_base() -> nn.Module:
    return build("roberta_base")


def plain_t5() -> nn.Module:
    return build("t5", Plain)
