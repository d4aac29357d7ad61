"""One rename rule as transformers 5 applies it at load time
(``core_model_loading.WeightTransform``), without transformers.

A rule has source patterns and target patterns. A key matches when one
source pattern, as a regular expression (``*.`` standing for any run of
names, a pattern ending in a letter or digit ending at a name boundary),
is found in it; the first match is replaced by the first target pattern.
A *renaming* only renames; a *converter* also says how the tensors of the
keys it gathers become the one the model holds (``stack``: the experts'
matrices, one per expert, stacked on a new first axis; ``cat1``: the
stacks of each source pattern, joined on axis 1, as ``gate_up_proj``;
``chunk0``: one tensor split on axis 0 into as many as there are targets,
as Dinov2's fused ``weights_in`` into ``gate_proj`` and ``up_proj``).

Every renaming applies in turn, then at most one converter: the order
``rename_source_key`` follows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OPS = ("stack", "cat1", "chunk0")


@dataclass(frozen=True)
class Rule:
    """A renaming (``ops`` empty) or a converter."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    ops: tuple[str, ...] = ()
    compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        branches = []
        # longest first, as transformers orders its branches
        for i, source in sorted(enumerate(self.sources), key=lambda item: -len(item[1])):
            pattern = source.replace("*.", r".*\.")
            if re.search(r"[a-zA-Z0-9]$", pattern):
                pattern += r"(?!\w)"
            branches.append(f"(?P<g{i}>{pattern})")
        object.__setattr__(self, "compiled", re.compile("|".join(branches)))

    @property
    def converts(self) -> bool:
        return bool(self.ops)

    def rename(self, key: str) -> tuple[str, str | None]:
        """(the renamed key, the source pattern that matched; None: no match)."""
        m = self.compiled.search(key)
        if m is None:
            return key, None
        group = next(name for name, value in m.groupdict().items() if value is not None)
        return key.replace(m.group(0), self.targets[0], 1), self.sources[int(group[1:])]


def rename(key: str, rules: Sequence[Rule]) -> tuple[str, Rule | None, str | None]:
    """``key`` as the loader names it: (name, the converter that gathers it
    or None, the converter's source pattern it matched)."""
    for rule in rules:
        if not rule.converts:
            key, _ = rule.rename(key)
    for rule in rules:
        if rule.converts:
            renamed, pattern = rule.rename(key)
            if pattern is not None:
                return renamed, rule, pattern
    return key, None, None


def make(rule: Rule, name: str, gathered: dict[str, list[torch.Tensor]]
         ) -> dict[str, torch.Tensor]:
    """What ``rule`` makes of the tensors gathered for ``name`` (its first
    target's name): one tensor, or (``chunk0``) one per target."""
    if "chunk0" in rule.ops:
        (pieces,) = gathered.values()
        if len(pieces) != 1 or pieces[0].shape[0] % len(rule.targets):
            raise ValueError(f"{name}: cannot split into {len(rule.targets)}")
        names = [name.replace(rule.targets[0], t, 1) for t in rule.targets]
        return dict(zip(names, pieces[0].chunk(len(rule.targets), 0), strict=True))
    return {name: merge(rule, gathered)}


def merge(rule: Rule, gathered: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """The one tensor ``rule`` makes of the tensors gathered per source
    pattern (each list in the loader's key order)."""
    import torch

    parts = [gathered[s] for s in rule.sources if s in gathered]
    if len(parts) != len(rule.sources):  # transformers' Concatenate fails on a missing part
        raise ValueError(f"{rule.targets[0]} needs {', '.join(rule.sources)}: "
                         f"{len(parts)} of {len(rule.sources)} found")
    made: list[torch.Tensor] = [torch.stack(p, 0) if "stack" in rule.ops else p[0]
                                for p in parts]
    if "cat1" in rule.ops:
        return torch.cat(made, 1)
    if len(made) != 1:
        raise ValueError(f"{rule.sources} gathered {len(made)} groups for one tensor")
    return made[0]


def natural(key: str) -> list[tuple[int, str, int]]:
    """The loader's key order (``dot_natural_key``): numbers as numbers,
    a name's trailing digits too (``shard_2`` before ``shard_11``)."""
    out = []
    for part in key.split("."):
        if part.isdigit():
            out.append((0, "", int(part)))
        else:
            text = part.rstrip("0123456789")
            out.append((1, text, int(part[len(text):]) if len(text) < len(part) else -1))
    return out
