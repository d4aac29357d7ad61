"""A PEFT adapter against the model it adapts: does every module it
targets exist there, with the shapes its weights need?

An adapter file holds only the adapter's weights, under PEFT's names
without the adapter's name (``base_model.model.<module>.lora_A.weight``,
``<module>.ia3_l``; a ``modules_to_save`` module as its plain
``<module>.weight``). Against the base model those are never "missing
keys": each names a module of the base and a part PEFT adds to it.
``PeftModel.from_pretrained(base, folder)`` loads it; against a model PEFT
already wraps (``get_peft_model``), whose keys carry the adapter's name
(``lora_A.default.weight``, ``score.modules_to_save.default.weight``),
PEFT's ``set_peft_model_state_dict`` inserts that name, and ``wrapped``
names the keys the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptool.check.reconcile import MaybeShape

STORED_PREFIX = "base_model.model."
# the parts PEFT adds to a module: (part, what its shape must agree with:
# "out" the module weight's dim 0, "in" its dim 1; "" nothing checked)
PARTS = {
    "lora_A": "in", "lora_B": "out", "lora_embedding_A": "", "lora_embedding_B": "",
    "lora_magnitude_vector": "out", "ia3_l": "", "hada_w1_a": "", "hada_w1_b": "",
    "hada_w2_a": "", "hada_w2_b": "", "hada_t1": "", "hada_t2": "", "lokr_w1": "",
    "lokr_w1_a": "", "lokr_w1_b": "", "lokr_w2": "", "lokr_w2_a": "", "lokr_w2_b": "",
    "lokr_t2": "", "oft_r": "", "oft_s": "", "boft_R": "", "boft_s": "", "vera_lambda_b": "out",
    "vera_lambda_d": "", "fourierft_spectrum": "", "ln_tuning_layers": "",
}
NAMED = re.compile(r"\.(" + "|".join(PARTS) + r")\.([^.]+)(?=\.|$)")
WRAPPED_SAVED = re.compile(r"\.modules_to_save\.([^.]+)\.")


@dataclass
class AdapterMatch:
    """What an adapter's keys say against a model."""

    modules: list[str] = field(default_factory=list)  # base modules the adapter changes
    saved: list[str] = field(default_factory=list)  # modules_to_save: whole modules replaced
    problems: list[str] = field(default_factory=list)  # one line each
    wrapped: str | None = None  # the adapter name, where the model is PEFT-wrapped
    names: dict[str, str] = field(default_factory=dict)  # file key -> model key (wrapped)

    @property
    def fits(self) -> bool:
        return not self.problems and bool(self.modules or self.saved)


def adapter_name(expected: Mapping[str, MaybeShape]) -> str | None:
    """The adapter a PEFT-wrapped model's keys carry (``default``); None for
    a model no adapter wraps."""
    found: dict[str, int] = {}
    for key in expected:
        m = NAMED.search(key) or WRAPPED_SAVED.search(key)
        if m is not None:
            name = m.group(m.lastindex or 1)
            found[name] = found.get(name, 0) + 1
    if not found:
        return None
    return "default" if "default" in found else max(found, key=lambda n: found[n])


def match(shapes: Mapping[str, MaybeShape], expected: Mapping[str, MaybeShape]) -> AdapterMatch:
    """Each key of an adapter file (``shapes``) against a model's keys."""
    wrapped = adapter_name(expected)
    out = AdapterMatch(wrapped=wrapped)
    base = {_unwrapped(k, wrapped): v for k, v in expected.items()} if wrapped else dict(expected)
    for key, shape in shapes.items():
        name = key.removeprefix(STORED_PREFIX)
        part = next((p for p in name.split(".") if p in PARTS), None)
        if part is None:  # a whole module saved (modules_to_save), or a trainable token
            _saved(out, key, name, shape, base, expected, wrapped)
            continue
        module = name[:name.index(f".{part}")] if f".{part}" in name else ""
        weight = base.get(f"{module}.weight") if module else None
        if module and f"{module}.weight" not in base:
            out.problems.append(f"{key}: the model has no module {module} "
                                f"(no {module}.weight)")
            continue
        if module not in out.modules:
            out.modules.append(module)
        check = PARTS[part]
        if part == "ia3_l" and shape is not None and len(shape) == 2:
            # (out, 1) scales the module's output; (1, in) its input (feed-forward)
            check = "in" if shape[0] == 1 and shape[1] != 1 else "out"
        if check and shape is not None and weight is not None and len(weight) >= 2:
            dim = 0 if check == "out" else 1
            if len(shape) < 2 and check == "out":
                got = shape[0] if shape else None
            else:
                got = shape[dim] if len(shape) > dim else None
            if got is not None and got != weight[dim]:
                side = "out_features" if check == "out" else "in_features"
                out.problems.append(f"{key}: {part} has {got} where {module} has "
                                    f"{side} {weight[dim]} ({_shape(shape)} against the "
                                    f"module's {_shape(weight)})")
                continue
        if wrapped:
            out.names[key] = _wrapped_part(STORED_PREFIX + name, part, wrapped)
    return out


def _saved(out: AdapterMatch, key: str, name: str, shape: MaybeShape,
           base: Mapping[str, MaybeShape], expected: Mapping[str, MaybeShape],
           wrapped: str | None) -> None:
    if name not in base and STORED_PREFIX + name not in base:
        out.problems.append(f"{key}: the model has no {name} (a module the adapter saves whole)")
        return
    want = base.get(name, base.get(STORED_PREFIX + name))
    if shape is not None and want is not None and shape != want:
        out.problems.append(f"{key}: {_shape(shape)} where the model's {name} is {_shape(want)}")
        return
    module = name.rpartition(".")[0]
    if module not in out.saved:
        out.saved.append(module)
    if wrapped:
        head, _, leaf = name.rpartition(".")
        target = f"{STORED_PREFIX}{head}.modules_to_save.{wrapped}.{leaf}"
        out.names[key] = target if target in expected else STORED_PREFIX + name


def _unwrapped(key: str, adapter: str) -> str:
    """A PEFT-wrapped model's key as the base model names it (adapter parts
    kept, without the adapter's name)."""
    key = key.removeprefix(STORED_PREFIX)
    key = key.replace(".base_layer.", ".")
    key = re.sub(rf"\.modules_to_save\.{re.escape(adapter)}\.", ".", key)
    key = key.replace(".original_module.", ".")
    return re.sub(rf"\.({'|'.join(PARTS)})\.{re.escape(adapter)}(?=\.|$)", r".\1", key)


def _wrapped_part(key: str, part: str, adapter: str) -> str:
    """``...q_proj.lora_A.weight`` as PEFT names it in the wrapped model:
    ``...q_proj.lora_A.<adapter>.weight`` (``ia3_l`` -> ``ia3_l.<adapter>``)."""
    head, sep, tail = key.partition(f".{part}")
    return f"{head}.{part}.{adapter}{tail}" if sep else key


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def describe(match: AdapterMatch, path: str) -> str:
    """One line: what the adapter changes in the model, and how it loads."""
    leaves = sorted({m.rpartition(".")[2] for m in match.modules})
    parts = []
    if match.modules:
        parts.append(f"{len(match.modules)} module{'s' if len(match.modules) != 1 else ''} "
                     f"adapted ({', '.join(leaves[:6])})")
    if match.saved:
        parts.append(f"saved whole: {', '.join(match.saved[:4])}")
    what = "; ".join(parts) or "no adapter weights"
    if match.wrapped is not None:
        return (f"{what}; the model is PEFT-wrapped (adapter {match.wrapped!r}): "
                "ckptool.load_state_dict(path, model=...) names the keys as it does "
                "(load with strict=False: an adapter holds no base weights)")
    return f"{what}; load it with PeftModel.from_pretrained(model, {path!r})"


def as_dict(match: AdapterMatch) -> dict[str, object]:
    return {"fits": match.fits, "modules": match.modules, "saved_whole": match.saved,
            "problems": match.problems, "wrapped_adapter": match.wrapped}
