"""A user's own mapping of a Megatron model's tensors (``convert --map
rules.toml``): for a model none of ``hfmap``'s maps fits, the names to write
and how each tensor is cut, in a small TOML file (or the same as JSON)::

    # each rule: the per-layer Megatron name it takes ({layer}, {expert}: numbers)
    [[rule]]
    from = "decoder.layers.{layer}.self_attention.linear_qkv.weight"
    split = "qkv"                       # Megatron's query groups: q, k, v
    to = ["model.layers.{layer}.attn.q.weight", "model.layers.{layer}.attn.k.weight",
          "model.layers.{layer}.attn.v.weight"]

    [[rule]]
    from = "decoder.layers.{layer}.mlp.linear_fc1.weight"
    split = "halves"                    # a SwiGLU weight: gate rows, then up rows
    to = ["model.layers.{layer}.mlp.gate.weight", "model.layers.{layer}.mlp.up.weight"]

    [[rule]]
    from = "embedding.word_embeddings.weight"
    to = "model.embed.weight"
    vocab = true                        # rows cut to the tokenizer's vocabulary

    [[rule]]
    from = "decoder.layers.{layer}.self_attention.core_attention.*"
    drop = true                         # written nowhere, said

    [config]                            # written as config.json, as it is
    model_type = "mine"

A ``split`` is ``qkv`` (sizes from ``args``: ``num_attention_heads``,
``num_query_groups``, ``kv_channels``; or ``heads``, ``groups``, ``head_dim``
in the rule), ``halves``, or ``chunks:N`` (N equal runs of rows); ``transpose
= true`` swaps a matrix's dimensions after the split. Rules are tried in
order; the first whose ``from`` matches a name takes it; a name no rule
matches is refused by name, as is a rule that matches nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ckptool.errors import UsageError
from ckptool.read import fs
from ckptool.read.derived import Derived
from ckptool.read.megatron import facts
from ckptool.read.megatron.hfmap.model import MAX_HEADS, qkv_runs

MAX_RULES_BYTES = 1 << 20
PLACEHOLDER = re.compile(r"\{(layer|expert)\}")
HINT = "see `ckptool convert --help` and docs/megatron.md for the rules file's form"


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    source: str  # as written
    to: tuple[str, ...]
    split: str | None
    transpose: bool
    vocab: bool
    drop: bool
    sizes: dict[str, int]


def load(path: str) -> tuple[list[Rule], dict[str, Any] | None]:
    """The rules and the config of the rules file ``path``."""
    try:
        with fs.open_binary(path) as f:
            data = f.read(MAX_RULES_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"--map {path}: cannot read it ({exc.strerror})",
                         "name a rules file (.toml or .json), or one of the maps") from exc
    if len(data) > MAX_RULES_BYTES:
        raise UsageError(f"--map {path} is over {MAX_RULES_BYTES >> 20} MiB", HINT)
    try:
        if path.endswith(".json"):
            doc = json.loads(data)
        else:
            try:
                import tomllib
            except ModuleNotFoundError as exc:  # Python 3.10: tomli, or JSON
                raise UsageError(f"--map {path}: reading TOML needs Python 3.11 or tomli",
                                 "pip install tomli, or write the rules as JSON "
                                 "(rules.json)") from exc
            doc = tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"--map {path} is not valid {'JSON' if path.endswith('.json') else 'TOML'}"
                         f": {str(exc).splitlines()[0][:120]}", HINT) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("rule"), list) or not doc["rule"]:
        raise UsageError(f"--map {path} has no [[rule]] entries", HINT)
    config = doc.get("config")
    if config is not None and not isinstance(config, dict):
        raise UsageError(f"--map {path}: [config] is not a table", HINT)
    try:
        json.dumps(config)
    except (TypeError, ValueError) as exc:  # a TOML date, say: config.json cannot say it
        raise UsageError(f"--map {path}: [config] holds a value JSON cannot hold ({exc})",
                         "write dates and times in [config] as strings") from exc
    return [_rule(path, i, r) for i, r in enumerate(doc["rule"])], config


def _rule(path: str, i: int, r: Any) -> Rule:
    where = f"--map {path}: rule {i + 1}"
    if not isinstance(r, dict) or not isinstance(r.get("from"), str) or not r["from"]:
        raise UsageError(f"{where} has no 'from' name", HINT)
    unknown = set(r) - {"from", "to", "split", "transpose", "vocab", "drop", "heads", "groups",
                        "head_dim"}
    if unknown:
        raise UsageError(f"{where} has unknown keys: {', '.join(sorted(unknown))}", HINT)
    to = r.get("to", [])
    to = [to] if isinstance(to, str) else to
    drop = r.get("drop") is True
    if not drop and (not isinstance(to, list) or not to or
                     not all(isinstance(t, str) and t for t in to)):
        raise UsageError(f"{where} ({r['from']}) names no 'to'", HINT)
    split = r.get("split")
    count = 1 if split is None else 3 if split == "qkv" else 2 if split == "halves" else (
        int(split[7:]) if isinstance(split, str) and re.fullmatch(r"chunks:[1-9]\d{0,5}", split)
        else None)
    if count is None:
        raise UsageError(f"{where}: split {split!r:.40} is none of qkv, halves, chunks:N "
                         "(N under a million)", HINT)
    if not drop and len(to) != count:
        raise UsageError(f"{where}: split {split or 'none'} makes {count} tensors, and 'to' "
                         f"names {len(to)}", HINT)
    vocab = r.get("vocab") is True
    if vocab and count != 1:
        raise UsageError(f"{where}: vocab = true cuts one tensor's rows: not with split "
                         f"{split}", "write the vocabulary's rule without a split")
    named = _placeholders(where, "from", r["from"])
    for t in to:
        extra = _placeholders(where, "to", t) - named
        if extra:
            raise UsageError(f"{where}: 'to' names {{{min(extra)}}}, and 'from' does not",
                             "name it in 'from' too, or leave it out of 'to'")
    sizes = {k: r[k] for k in ("heads", "groups", "head_dim") if isinstance(r.get(k), int)}
    pattern = re.escape(r["from"]).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(
        r"\{expert\}", r"(?P<expert>\d+)").replace(r"\*", ".*")
    return Rule(re.compile(pattern + "$"), r["from"], tuple(to), split,
                r.get("transpose") is True, vocab, drop, sizes)


def _placeholders(where: str, key: str, text: str) -> set[str]:
    """The placeholders ``text`` names; a brace of any other kind, or one
    named twice in 'from', refused."""
    found = PLACEHOLDER.findall(text)
    if "{" in PLACEHOLDER.sub("", text) or "}" in PLACEHOLDER.sub("", text):
        raise UsageError(f"{where}: {key} {text!r:.80} holds a brace other than {{layer}} and "
                         "{expert}", "the names' numbers are {layer} and {expert}, nothing else")
    twice = sorted({f for f in found if found.count(f) > 1})
    if key == "from" and twice:
        raise UsageError(f"{where}: 'from' names {{{twice[0]}}} twice",
                         "a number is taken once; 'to' may repeat it")
    return set(found)


def plan(path: str, shapes: dict[str, tuple[int, ...]], args: dict[str, Any]) -> tuple[
        list[Derived], dict[str, Any] | None, list[str]]:
    """The tensors the rules file ``path`` writes from a Megatron model's
    per-layer tensors (``shapes``), its config, and notes."""
    rules, config = load(path)
    used: set[int] = set()
    out: list[Derived] = []
    dropped: list[str] = []
    unplaced: list[str] = []
    for name, shape in shapes.items():
        found = next(((i, r, m) for i, r in enumerate(rules) if (m := r.pattern.match(name))),
                     None)
        if found is None:
            unplaced.append(name)
            continue
        i, rule, m = found
        used.add(i)
        if rule.drop:
            dropped.append(name)
            continue
        names = [_filled(t, m) for t in rule.to]
        for key, rows in zip(names, _rows(rule, name, shape, args), strict=True):
            out.append(Derived(key, name, (), rows, rule.transpose))
            out[-1].shape(shape)  # (checked now: before any byte is read)
    if unplaced:
        more = f" (and {len(unplaced) - 3} more)" if len(unplaced) > 3 else ""
        raise UsageError(f"--map {path}: no rule takes {', '.join(unplaced[:3])}{more}",
                         "add a rule for it, or one with drop = true")
    idle = [r.source for i, r in enumerate(rules) if i not in used]
    if idle:
        raise UsageError(f"--map {path}: rule for {idle[0]} matches no tensor of this model",
                         "check its name against `ckptool inspect` (per-layer names: "
                         "decoder.layers.{layer}....)")
    notes = [f"left out by the rules: {', '.join(dropped[:4])}"
             f"{' …' if len(dropped) > 4 else ''}"] if dropped else []
    return out, config, notes


def _filled(to: str, m: re.Match[str]) -> str:
    """``to`` with the numbers its rule's 'from' matched in place of
    ``{layer}`` and ``{expert}`` (each one 'from' names: checked on load)."""
    return PLACEHOLDER.sub(lambda p: m.group(p.group(1)), to)


def _rows(rule: Rule, name: str, shape: tuple[int, ...], args: dict[str, Any]) -> list[
        tuple[tuple[int, int], ...]]:
    """The rows each output of ``rule`` takes of ``name``."""
    n = shape[0] if shape else 0
    if rule.vocab:
        vocab = facts.true_vocab(args)
        if vocab is None or not 0 < vocab <= n:
            raise UsageError(f"{name}: vocab = true, but args do not say the tokenizer's "
                             f"vocabulary (at most {n} rows)",
                             "leave vocab out (the padding is kept)")
        return [((0, vocab),)]
    if rule.split is None:
        return [()]
    if rule.split == "qkv":
        heads = _size(rule.sizes.get("heads", args.get("num_attention_heads")))
        # (Megatron saves num_query_groups 1 without --group-query-attention too:
        # then every head is its own group)
        grouped = args.get("num_query_groups") if args.get("group_query_attention") else None
        groups = _size(rule.sizes.get("groups", grouped)) or heads
        d = _size(rule.sizes.get("head_dim", args.get("kv_channels")))
        if heads > MAX_HEADS:
            raise UsageError(f"{name}: a qkv of {heads} heads: more than ckptool splits "
                             f"({MAX_HEADS})", "give heads, groups and head_dim in the rule")
        if not (heads and groups and d) or heads % groups or \
                groups * (heads // groups + 2) * d != n:
            raise UsageError(f"{name} ({n} rows) is not a qkv of heads={heads}, "
                             f"groups={groups}, head_dim={d}",
                             "give heads, groups and head_dim in the rule")
        return [tuple(qkv_runs(groups, heads // groups, d, part)) for part in "qkv"]
    count = 2 if rule.split == "halves" else int(rule.split[7:])
    if n % count:
        raise UsageError(f"{name} has {n} rows: not {count} equal parts", HINT)
    step = n // count
    return [((k * step, (k + 1) * step),) for k in range(count)]


def _size(value: Any) -> int:
    """A positive size, or 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
