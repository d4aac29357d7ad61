"""The names a library gives a checkpoint's keys when it loads them.

transformers 5 renames at load time: a Mixtral folder it wrote keeps each
expert's ``block_sparse_moe.experts.0.w1.weight``, and ``from_pretrained``
stacks them into the model's ``mlp.experts.gate_up_proj``; a Llava folder's
``language_model.model.*`` is loaded as ``model.language_model.*``. Such a
folder is right as it is: comparing its stored names with the model's
would advise a rename that breaks it.

``LoadNames`` says how one library names the keys: from the library's own
mapping where the model is its class (``live``: transformers' own
``get_model_conversion_mapping`` and ``rename_source_key``), else from
ckptool's table of one version's renames (``table``) for the family a
folder's ``config.json`` names. ``loaded`` gives, for a set of file keys,
each name the model is loaded under and the file keys it is made from, as
the loader gathers them; ``make`` builds a gathered tensor from its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptool.check.loadnames import rules, table

if TYPE_CHECKING:
    import torch

# (key) -> (its name after loading, the converter that gathers it or None, its pattern)
Renamer = Callable[[str], tuple[str, Any, "str | None"]]
# (converter, the loaded name, {pattern: [tensors in the loader's order]}) -> the tensor(s)
Maker = Callable[[Any, str, "dict[str, list[torch.Tensor]]"], "dict[str, torch.Tensor]"]


@dataclass
class Loaded:
    """One name the model is loaded under, and the file keys it is made from."""

    name: str
    sources: list[str]
    converter: Any = None  # None: one key, renamed (or not)
    patterns: list[str] = field(default_factory=list)  # each source's converter pattern
    also: tuple[str, ...] = ()  # further names one converter fills (a split)


@dataclass
class LoadNames:
    """How ``library`` names a checkpoint's keys when it loads them."""

    library: str  # "transformers 5.25.0"
    origin: str  # "its own conversion mapping" or "ckptool's table of transformers 5.25.0"
    rename: Renamer
    make: Maker
    base_prefix: str | None = None  # the library adds or strips it to fit the model
    fills: Callable[[Any, str], tuple[str, ...]] = lambda _c, _n: ()
    _memo: dict[str, tuple[str, Any, str | None]] = field(default_factory=dict, repr=False)
    _orders: dict[str, list[tuple[int, str, int]]] = field(default_factory=dict, repr=False)

    def loaded(self, keys: Iterable[str], expected: Mapping[str, Any]) -> dict[str, Loaded]:
        """Each name the model is loaded under, from ``keys``: the file's
        keys in the loader's order, each renamed, then (transformers'
        fall-back) kept as it is where only the original name is the model's."""
        out: dict[str, Loaded] = {}
        for key in sorted(keys, key=self._order):
            name, converter, pattern = self._renamed(key)
            name = self._fit_prefix(name, expected)
            if name not in expected and key in expected:
                name, converter, pattern = key, None, None
            if converter is None or pattern is None:
                out.setdefault(name, Loaded(name, [])).sources.append(key)
                continue
            entry = out.setdefault(name, Loaded(name, [], converter,
                                                also=self.fills(converter, name)))
            entry.sources.append(key)
            entry.patterns.append(pattern)
        return out

    def _renamed(self, key: str) -> tuple[str, Any, str | None]:
        """``rename(key)``, once per key: a comparison asks again for each
        rewrite it tries."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self.rename(key)
        return found

    def _order(self, key: str) -> list[tuple[int, str, int]]:
        found = self._orders.get(key)
        if found is None:
            found = self._orders[key] = rules.natural(key)
        return found

    def _fit_prefix(self, name: str, expected: Mapping[str, Any]) -> str:
        prefix = self.base_prefix
        if not prefix:
            return name
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in expected:
            return name[len(prefix) + 1:]
        if f"{prefix}.{name}" in expected:
            return f"{prefix}.{name}"
        return name

    def shapes(self, shapes: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
        """The names the model is loaded under, each with its shape: a file
        key's, or that of the tensor the library gathers from several keys,
        made as it makes it (on the meta device: no bytes). A gathered tensor
        the library cannot make of these keys (an expert's matrix missing
        from a pair) is left out: the model's name is then missing."""
        out: dict[str, Any] = {}
        for entry in self.loaded(shapes, expected).values():
            if entry.converter is None:
                out[entry.name] = shapes[entry.sources[0]]
            elif all(shapes[k] is not None for k in entry.sources):
                out.update(self.made_shapes(entry, shapes))
            else:
                out.update(dict.fromkeys((entry.name, *entry.also)))
        return out

    def made_shapes(self, entry: Loaded, shapes: Mapping[str, Any]) -> dict[str, Any]:
        """The shapes of what the library makes of ``entry``'s keys; empty
        where it cannot make them."""
        import torch

        parts: dict[str, list[torch.Tensor]] = {}
        for key, pattern in zip(entry.sources, entry.patterns, strict=True):
            parts.setdefault(pattern, []).append(torch.empty(shapes[key], device="meta"))
        try:
            made = self.make(entry.converter, entry.name, parts)
        except (RuntimeError, ValueError, IndexError, TypeError, KeyError, AssertionError):
            return {}  # the library fails the same way: the name stays empty
        return {name: tuple(t.shape) for name, t in made.items()}

    def renamed(self, loaded: Mapping[str, Loaded]) -> list[str]:
        """The file keys the library loads under another name."""
        return [k for entry in loaded.values() for k in entry.sources if k != entry.name]

    def describe(self, loaded: Mapping[str, Loaded], settled: bool = True) -> str | None:
        """One line: what the library renames at load, or None for nothing
        (``settled``: no other rewrite is needed)."""
        moved = self.renamed(loaded)
        if not moved:
            return None
        merged = [e for e in loaded.values() if e.converter is not None]
        parts = sum(len(e.sources) for e in merged)
        what = f"; {parts} of them gathered into {len(merged)} tensor" \
            f"{'s' if len(merged) != 1 else ''}" if merged else ""
        example = next(k for e in loaded.values() for k in e.sources if k != e.name)
        into = next(e.name for e in loaded.values() if example in e.sources)
        return (f"{len(moved)} key{'s' if len(moved) != 1 else ''} are renamed as {self.library}"
                f" loads them ({self.origin}){what}: e.g. {example} -> {into}"
                + ("; the folder is right as it is" if settled else
                   " (after the rewrite below)"))


def from_table(model_type: str | None, model_class: str | None = None) -> LoadNames | None:
    """ckptool's table of one transformers version's renames for a config's
    ``model_type`` (and architecture); None for a family it lists no renames for."""
    found = table.rules_for(model_type, model_class)
    if found is None:
        return None
    family, ruleset = found

    def rename(key: str) -> tuple[str, Any, str | None]:
        return rules.rename(key, ruleset)

    def make(converter: Any, name: str,
             gathered: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        return rules.make(converter, name, gathered)

    def fills(converter: Any, name: str) -> tuple[str, ...]:
        first, *others = converter.targets
        return tuple(name.replace(first, o, 1) for o in others if first in name)

    return LoadNames(table.VERSION, f"ckptool's table of {table.VERSION}'s renames, "
                     f"family {family}", rename, make, fills=fills)
