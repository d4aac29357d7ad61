"""Which of a folder's weight files a framework's loader reads, by the names
it looks for and in its order (only names are looked at here):

- transformers' ``from_pretrained`` (``_get_resolved_checkpoint_files``,
  4.57): the file its config.json names (``transformers_weights``), else
  ``model.safetensors``, ``model.safetensors.index.json``,
  ``pytorch_model.bin``, ``pytorch_model.bin.index.json``: a single file
  before its own index, safetensors before ``.bin``;
- diffusers' ``ModelMixin.from_pretrained`` (0.39):
  ``diffusion_pytorch_model.safetensors.index.json`` (its index first), then
  ``diffusion_pytorch_model.safetensors``, ``diffusion_pytorch_model.bin``;
  a ``.bin`` index only with ``use_safetensors=False``;
- PEFT's ``load_peft_weights``: ``adapter_model.safetensors``, then
  ``adapter_model.bin``.

A variant (``save_pretrained(..., variant="fp16")``: ``model.fp16.safetensors``,
``model.safetensors.index.fp16.json`` and its shards
``model.fp16-00001-of-00002.safetensors``; diffusers' legacy index name
``diffusion_pytorch_model.safetensors.fp16.index.json``, which it still
reads; ``model.fp16.safetensors.index.json``, which no loader reads, is
known as a variant too) is loaded only when asked for (``variant="fp16"``):
beside the plain model it is a companion, never the model read. A folder
holding the model only as one variant is read as that variant, with a note
saying the loader needs ``variant=``; several variants and no plain model:
``choose`` says which there are, and the caller asks for one to be named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

TRANSFORMERS, DIFFUSERS, PEFT = "transformers", "diffusers", "peft"
# each framework's file stem with the format it holds
STEMS = {("model", "safetensors"): TRANSFORMERS, ("pytorch_model", "bin"): TRANSFORMERS,
         ("diffusion_pytorch_model", "safetensors"): DIFFUSERS,
         ("diffusion_pytorch_model", "bin"): DIFFUSERS,
         ("adapter_model", "safetensors"): PEFT, ("adapter_model", "bin"): PEFT}
LOADER = {TRANSFORMERS: "transformers' from_pretrained", DIFFUSERS: "diffusers' from_pretrained",
          PEFT: "PEFT's from_pretrained"}
FILE, INDEX, SHARD = "file", "index", "shard"
FIXED = "fixed"  # `ckptool fix model.safetensors` writes model.fixed.safetensors beside it
_V = r"(?:\.(?P<variant>[^./\\]+?))"
_NAMES = (  # (kind, pattern): shards first (a shard's name ends like a variant's file)
    (SHARD, rf"^(?P<stem>[a-z_]+?){_V}?-\d{{5}}-of-\d{{5}}\.(?P<ext>safetensors|bin)$"),
    (INDEX, rf"^(?P<stem>[a-z_]+)\.(?P<ext>safetensors|bin)\.index{_V}?\.json$"),
    (INDEX, rf"^(?P<stem>[a-z_]+)\.(?P<ext>safetensors|bin){_V}\.index\.json$"),
    (INDEX, rf"^(?P<stem>[a-z_]+?){_V}\.(?P<ext>safetensors|bin)\.index\.json$"),
    (FILE, rf"^(?P<stem>[a-z_]+?){_V}?\.(?P<ext>safetensors|bin)$"),
)


@cache
def _names() -> tuple[tuple[str, re.Pattern[str]], ...]:
    """``_NAMES`` compiled, on first use (not by every run that imports this)."""
    return tuple((kind, re.compile(pattern)) for kind, pattern in _NAMES)


@dataclass(frozen=True)
class Weights:
    """What a file's name says: whose weights, in which form."""

    family: str  # TRANSFORMERS, DIFFUSERS, PEFT
    kind: str  # FILE, INDEX or SHARD
    ext: str  # "safetensors" or "bin"
    variant: str | None


def parse(name: str) -> Weights | None:
    """The framework weights ``name`` is, by its name; None for another name."""
    for kind, pattern in _names():
        m = pattern.match(name)
        if m is None:
            continue
        family = STEMS.get((m.group("stem"), m.group("ext")))
        if family is None or (family == PEFT and (kind != FILE or m.group("variant"))):
            return None
        return Weights(family, kind, m.group("ext"), m.group("variant"))
    return None


def order(family: str, variant: str | None) -> list[tuple[str, str | None]]:
    """The names ``family``'s loader looks for, in its order, each with what
    it must be told to take it (None: nothing)."""
    v = f".{variant}" if variant else ""
    if family == TRANSFORMERS:
        return [(f"model{v}.safetensors", None), (f"model.safetensors.index{v}.json", None),
                (f"pytorch_model{v}.bin", None), (f"pytorch_model.bin.index{v}.json", None)]
    if family == DIFFUSERS:
        stem = "diffusion_pytorch_model"
        legacy = [(f"{stem}.safetensors{v}.index.json", None)] if variant else []
        return [(f"{stem}.safetensors.index{v}.json", None), *legacy,
                (f"{stem}{v}.safetensors", None), (f"{stem}{v}.bin", None),
                (f"{stem}.bin.index{v}.json", "use_safetensors=False")]
    return [("adapter_model.safetensors", None), ("adapter_model.bin", None)]


@dataclass(frozen=True)
class Choice:
    """The weights a folder's loader reads."""

    family: str
    name: str | None  # a file or index; None where only variants are there, several
    needs: tuple[str, ...] = ()  # what the loader must be told ("variant='fp16'")
    variants: tuple[str, ...] = ()  # the variants the folder holds
    explicit: bool = False  # config.json's transformers_weights names it
    picks: tuple[str, ...] = ()  # name None: what the loader reads of each variant

    @property
    def index(self) -> bool:
        return bool(self.name and self.name.endswith(".json"))

    @property
    def loader(self) -> str:
        return LOADER[self.family]


def choose(names: list[str], explicit: str | None = None,
           peft: bool = False) -> Choice | None:
    """What a loader reads of the files ``names`` (those that are there):
    the one family whose names are there (PEFT's where ``peft``: an
    adapter_config.json says so); None for none, or several and no config
    to say which. ``explicit``: config.json's ``transformers_weights``."""
    present = set(names)
    parsed = [p for n in names if (p := parse(n)) is not None and p.kind != SHARD]
    families = {p.family for p in parsed}
    family = PEFT if peft and PEFT in families else next(iter(families)) \
        if len(families) == 1 else None
    if family is None:
        return None
    variants = tuple(sorted({p.variant for p in parsed if p.family == family and p.variant}))
    if family == TRANSFORMERS and explicit in present:
        return Choice(family, explicit, variants=variants, explicit=True)
    found = _first(family, None, present)
    if found is not None:
        return Choice(family, found[0], found[1], variants)
    each = {v: f for v in variants if (f := _first(family, v, present)) is not None}
    if len(each) == 1:
        (variant, (name, needs)), = each.items()
        return Choice(family, name, (f"variant={variant!r}", *needs), variants)
    return Choice(family, None, (), tuple(each), picks=tuple(
        name for name, _ in each.values())) if each else None


def _first(family: str, variant: str | None,
           present: set[str]) -> tuple[str, tuple[str, ...]] | None:
    for name, needs in order(family, variant):
        if name in present:
            return name, (needs,) if needs else ()
    return None


def role(name: str, chosen: str) -> str | None:
    """What the weights file ``name`` is beside ``chosen``, the one its
    framework's loader reads; None for a name that is no framework weights
    of that family."""
    p, c = parse(name), parse(chosen)
    if p is None or c is None or p.family != c.family or name == chosen:
        return None
    if p.variant == FIXED and p.kind == FILE:
        return f"ckptool fix's output ({LOADER[p.family]} loads it only with variant='fixed')"
    if p.variant != c.variant:
        what = f"variant {p.variant} of the model" if p.variant else \
            "the model without a variant"
        return what + {INDEX: " (its shard index)", SHARD: " (a shard)", FILE: ""}[p.kind]
    if p.kind == SHARD and c.kind == INDEX and p.ext == c.ext:
        return "a shard its index does not name (not read)"
    fmt = ".bin" if p.ext == "bin" else "safetensors"
    return {INDEX: f"the model's {fmt} shard index (not read: {chosen} is)",
            SHARD: f"a shard of the model as {fmt} (not read: {chosen} is)",
            FILE: f"the model as {fmt} too (not read: {chosen} is)"}[p.kind]


def notes(path: str, choice: Choice, names: list[str]) -> list[str]:
    """What to say of a folder whose ``choice`` is read: the same model in
    another form that the loader passes over, a variant read because there
    is nothing else, the file a config names."""
    assert choice.name is not None
    out = []
    if choice.explicit:
        out.append(f"{path}/config.json names {choice.name} (transformers_weights): "
                   "transformers loads it, so that is what is read")
    chosen = parse(choice.name)
    passed = [n for n in names if n != choice.name and (p := parse(n)) is not None
              and p.family == choice.family and p.kind != SHARD
              and chosen is not None and p.variant == chosen.variant]
    if passed:
        shards = any((p := parse(n)) is not None and p.kind == INDEX for n in passed)
        out.append(f"{path} also holds {', '.join(passed)}{' and its shards' if shards else ''}: "
                   f"{choice.loader} loads {choice.name} first, so that is what is read "
                   "(name another to read it)")
    if chosen is not None and chosen.variant and not choice.explicit:
        out.append(f"{path} holds the model only as variant {chosen.variant} "
                   f"({choice.name}): {choice.loader} loads it only when asked "
                   f"({', '.join(choice.needs)})")
    elif choice.needs:
        out.append(f"{choice.loader} loads {choice.name} only when asked "
                   f"({', '.join(choice.needs)})")
    return out


def several(path: str, choice: Choice) -> tuple[str, str]:
    """The error for a folder holding the model only as several variants
    (the loader reads one only when it is named), and the file to name."""
    plain = order(choice.family, None)[0][0]
    return (f"{path} holds the model only as variants ({', '.join(choice.variants)}) and no "
            f"plain {plain}: {choice.loader} loads one only when asked (variant=...), so "
            "ckptool cannot tell which one is the model", choice.picks[0])
