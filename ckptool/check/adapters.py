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
# the parts PEFT adds to a module, and what the part's shape must agree
# with: "out" the module weight's dim 0, "in" its dim 1, "same" its whole
# shape; "" nothing checked here (LoKr's factors are checked together)
PARTS = {
    "lora_A": "in", "lora_B": "out", "lora_E": "", "lora_embedding_A": "",
    "lora_embedding_B": "", "lora_magnitude_vector": "out", "ia3_l": "",
    "hada_w1_a": "out", "hada_w1_b": "in", "hada_w2_a": "out", "hada_w2_b": "in",
    "hada_t1": "", "hada_t2": "", "lokr_w1": "", "lokr_w1_a": "", "lokr_w1_b": "",
    "lokr_w2": "", "lokr_w2_a": "", "lokr_w2_b": "", "lokr_t2": "", "oft_r": "", "oft_R": "",
    "oft_s": "", "boft_R": "", "boft_s": "", "vera_lambda_b": "out", "vera_lambda_d": "",
    "fourierft_spectrum": "", "ln_tuning_layers": "same", "trainable_tokens_delta": "in",
    "base_layer": "same",
}
# keys of an adapter that name no module of the base: VeRA's shared
# projections (base_model.vera_A), prompt learning's virtual tokens
SHARED = re.compile(r"^(base_model\.vera_[AB]|prompt_embeddings)$")
NAMED = re.compile(r"\.(" + "|".join(p for p in PARTS if p != "base_layer")
                   + r")\.([^.]+)(?=\.|$)")
WRAPPED_SAVED = re.compile(r"\.modules_to_save\.([^.]+)\.|^prompt_encoder\.([^.]+)\.")


@dataclass
class AdapterMatch:
    """What an adapter's keys say against a model."""

    modules: list[str] = field(default_factory=list)  # base modules the adapter changes
    saved: list[str] = field(default_factory=list)  # modules_to_save: whole modules replaced
    problems: list[str] = field(default_factory=list)  # one line each
    shared: list[str] = field(default_factory=list)  # keys of no module (prompt tokens, VeRA's)
    wrapped: str | None = None  # the adapter name, where the model is PEFT-wrapped
    names: dict[str, str] = field(default_factory=dict)  # file key -> model key (wrapped)

    @property
    def fits(self) -> bool:
        return not self.problems and bool(self.modules or self.saved or self.shared)


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


def match(shapes: Mapping[str, MaybeShape], expected: Mapping[str, MaybeShape],
          peft_type: str | None = None) -> AdapterMatch:
    """Each key of an adapter file (``shapes``) against a model's keys
    (``peft_type``: adapter_config.json's)."""
    wrapped = adapter_name(expected)
    out = AdapterMatch(wrapped=wrapped)
    base = {_unwrapped(k, wrapped): v for k, v in expected.items()} if wrapped else dict(expected)
    modules = {k.rpartition(".")[0] for k in base}
    for key, shape in shapes.items():
        name = key.removeprefix(STORED_PREFIX)
        part = next((p for p in name.split(".") if p in PARTS), None)
        if part is None and SHARED.match(key):
            out.shared.append(key)
            problem = _prompt(shape, base, peft_type) if key == "prompt_embeddings" else None
            if problem is not None:
                out.problems.append(problem)
                continue
            _name_wrapped(out, key, expected)
            continue
        if part is None:  # a whole module saved (modules_to_save), or a trainable token
            _saved(out, key, name, shape, base, expected, wrapped)
            continue
        module = name[:name.index(f".{part}")] if f".{part}" in name else ""
        module = module.removesuffix(".token_adapter")
        if module and module not in modules and not any(m.startswith(module + ".")
                                                        for m in modules):
            out.problems.append(f"{key}: the model has no module {module}")
            continue
        if module not in out.modules:
            out.modules.append(module)
        problem = _part_shape(key, part, module, shape, base.get(f"{module}.weight"))
        if problem is not None:
            out.problems.append(problem)
            continue
        _name_wrapped(out, key, expected)
    out.problems += _lokr(shapes, base)
    return out


def _part_shape(key: str, part: str, module: str, shape: MaybeShape,
                weight: MaybeShape) -> str | None:
    """Why ``part`` (of ``shape``) does not fit ``module``'s ``weight``; None if it does."""
    check = PARTS[part]
    if part == "ia3_l" and shape is not None and len(shape) == 2:
        # (out, 1) scales the module's output; (1, in) its input (feed-forward)
        check = "in" if shape[0] == 1 and shape[1] != 1 else "out"
    if not check or shape is None or weight is None:
        if part in ("lora_embedding_A", "lora_embedding_B") and shape is not None \
                and weight is not None and len(shape) == 2 and len(weight) == 2:
            # A: (r, num_embeddings), B: (embedding_dim, r) of an Embedding's (num, dim)
            have, want = (shape[1], weight[0]) if part.endswith("A") else (shape[0], weight[1])
            if have != want:
                return (f"{key}: {part} has {have} where {module} has "
                        f"{'num_embeddings' if part.endswith('A') else 'embedding_dim'} {want}")
        if part == "oft_R" and shape is not None and weight is not None and len(shape) == 2 \
                and len(weight) >= 2:
            # (blocks, b(b-1)/2): the blocks' skew-symmetric halves tile the in-features
            size = round((1 + (1 + 8 * shape[1]) ** 0.5) / 2)
            if size * (size - 1) // 2 == shape[1] and shape[0] * size != weight[1]:
                return (f"{key}: oft_R's {shape[0]} blocks of {size} cover "
                        f"{shape[0] * size} where {module} has in_features {weight[1]}")
        if part == "boft_R" and shape is not None and weight is not None and len(shape) == 4 \
                and len(weight) >= 2 and shape[1] * shape[3] != weight[1]:
            # (factors, blocks, block size, block size): the blocks tile the in-features
            return (f"{key}: boft_R's {shape[1]} blocks of {shape[3]} cover "
                    f"{shape[1] * shape[3]} where {module} has in_features {weight[1]}")
        return None
    if check == "same":
        return None if shape == weight else (
            f"{key}: {_shape(shape)} where the model's {module}.weight is {_shape(weight)}")
    if len(weight) < 2:
        return None
    dim = 0 if check == "out" else 1
    got = shape[0] if len(shape) == 1 and check == "out" else \
        shape[dim] if len(shape) > dim else None
    if got is None or got == weight[dim]:
        return None
    side = "out_features" if check == "out" else "in_features"
    return (f"{key}: {part} has {got} where {module} has {side} {weight[dim]} "
            f"({_shape(shape)} against the module's {_shape(weight)})")


EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings|shared)"
                       r"\.weight$")


def _prompt(shape: MaybeShape, base: Mapping[str, MaybeShape],
            peft_type: str | None) -> str | None:
    """Prompt learning's virtual tokens against the model's input embedding:
    each token has the embedding's width (prefix tuning: a multiple of it,
    a key and a value per layer)."""
    width = next((w[1] for k, w in base.items() if EMBEDDING.search(k) and w is not None
                  and len(w) == 2), None)
    if shape is None or len(shape) != 2 or width is None or shape[1] == width:
        return None
    if peft_type == "PREFIX_TUNING" and shape[1] % width == 0:
        return None
    return (f"prompt_embeddings: {shape[0]} virtual tokens of width {shape[1]} where the "
            f"model's input embedding has width {width}")


def _lokr(shapes: Mapping[str, MaybeShape], base: Mapping[str, MaybeShape]) -> list[str]:
    """LoKr's factors against their module: the Kronecker product of w1
    (or w1_a @ w1_b) and w2 (or w2_a @ w2_b) has the module weight's shape."""
    factors: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = re.match(r"(?:base_model\.model\.)?(.*)\.(lokr_w[12](?:_[ab])?)$", key)
        if m is not None and shape is not None and len(shape) == 2:
            factors.setdefault(m.group(1), {})[m.group(2)] = shape
    out = []
    for module, f in factors.items():
        weight = base.get(f"{module}.weight")
        sides = [f.get(w) or ((f[f"{w}_a"][0], f[f"{w}_b"][1]) if f"{w}_a" in f and f"{w}_b" in f
                              else None) for w in ("lokr_w1", "lokr_w2")]
        if weight is None or len(weight) != 2 or sides[0] is None or sides[1] is None:
            continue
        made = (sides[0][0] * sides[1][0], sides[0][1] * sides[1][1])
        if made != weight:
            out.append(f"{module}: LoKr's factors make {_shape(made)} where the module's "
                       f"weight is {_shape(weight)}")
    return out


def _name_wrapped(out: AdapterMatch, key: str, expected: Mapping[str, MaybeShape]) -> None:
    """``key`` as the PEFT-wrapped model names it: the adapter's name put
    after the part (``lora_A.default.weight``, ``ia3_l.default``, DoRA's
    ``lora_magnitude_vector.default.weight``), where the model has it."""
    adapter = out.wrapped
    if adapter is None:
        return
    if key == "prompt_embeddings":
        out.names[key] = f"prompt_encoder.{adapter}.embedding.weight"
        return
    parts = key.split(".")
    tries = [key] + [".".join([*parts[:i], adapter, *parts[i:]])
                     for i in range(len(parts), 0, -1)]
    for name in tries:
        for candidate in (name, f"{name}.weight"):
            if candidate in expected:
                out.names[key] = candidate
                return
    out.problems.append(f"{key}: the PEFT-wrapped model has no place for it "
                        f"(adapter {adapter!r})")


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
    if match.shared:
        parts.append(f"besides: {', '.join(match.shared[:3])}")
    what = "; ".join(parts) or "no adapter weights"
    if not match.fits:
        return f"{what}; it does not fit (see below)"
    if match.wrapped is not None:
        return (f"{what}; the model is PEFT-wrapped (adapter {match.wrapped!r}): "
                "ckptool.load_state_dict(path, model=...) names the keys as it does "
                "(load with strict=False: an adapter holds no base weights)")
    return f"{what}; load it with PeftModel.from_pretrained(model, {path!r})"


def as_dict(match: AdapterMatch) -> dict[str, object]:
    return {"fits": match.fits, "modules": match.modules, "saved_whole": match.saved,
            "problems": match.problems, "wrapped_adapter": match.wrapped}
