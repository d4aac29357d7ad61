"""State-dict keys against what a model expects: matched, missing,
unexpected and shape-mismatched keys, and the smallest prefix rewrite
(strip one prefix, add one) that makes the most keys match.

The rewrite is chosen among prefixes the keys actually carry: wrapper runs
(``module.``, ``_orig_mod.module.``, ``model.``, ``base_model.model.``...)
and the dotted prefix all keys share, on either side. It mirrors what
``ckptool fix --strip-prefix S --add-prefix A`` does to each key, so the
counts shown are the counts the fixed file will have. Pure: no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptool.read.prefixes import common_prefix, leading_wrappers

Shape = tuple[int, ...]
MaybeShape = Shape | None  # None: an extra-state entry, not a tensor
# the names a library loads file keys under, with their shapes (None: a
# tensor it gathers from several keys, whose shape it makes)
Load = Callable[[dict[str, MaybeShape]], dict[str, MaybeShape]]


@dataclass(frozen=True)
class Rewrite:
    strip: str = ""
    add: str = ""

    def apply(self, key: str) -> str:
        if self.strip and key.startswith(self.strip):
            key = key[len(self.strip):]
        return self.add + key

    @property
    def empty(self) -> bool:
        return not (self.strip or self.add)


@dataclass
class KeyReport:
    """The comparison after ``rewrite`` (and ``before``: matches without it)."""

    rewrite: Rewrite
    matched: list[str]  # expected keys present with the same shape
    missing: list[str]  # expected keys the file lacks
    unexpected: list[str]  # file keys (rewritten) the model does not have
    mismatched: list[tuple[str, Shape, Shape]]  # (key, file shape, model shape)
    before: int  # keys that match (by name) with no rewrite
    tied_missing: dict[str, str] = field(default_factory=dict)  # missing key -> present tied key

    @property
    def expected(self) -> int:
        return len(self.matched) + len(self.missing) + len(self.mismatched)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def _candidates(keys: Iterable[str]) -> list[str]:
    """Prefixes worth trying to strip from (or add to) these keys."""
    keys = list(keys)
    found: Counter[str] = Counter()
    for key in keys:
        found.update(leading_wrappers(key))
    # a wrapper prefix on a tenth of the keys or more (Lightning keeps a
    # loss module beside "model."); and each run of the shared prefix
    minimum = max(1, len(keys) // 10)
    out = [""] + [p for p, n in found.most_common(8) if n >= minimum]
    shared = common_prefix(keys).split(".")[:-1]
    out += [".".join(shared[:i]) + "." for i in range(1, len(shared) + 1)]
    return list(dict.fromkeys(out))


def infer_rewrite(names: list[str], expected: dict[str, MaybeShape],
                  load: Load | None = None) -> Rewrite:
    """The strip/add pair under which the most names match ``expected``;
    among equals, the smallest change. ``load``: the library renames the
    keys when it loads them, after the rewrite."""
    if load is not None:
        return _infer_loaded(names, expected, load)
    # a name matches under (strip, add) when it, stripped, is an expected
    # key with ``add`` taken off: set intersections keep 100k keys fast
    wanted = {add: {k[len(add):] for k in expected if k.startswith(add)}
              for add in _candidates(expected)}
    best, best_score = Rewrite(), -1
    for strip in _candidates(names):
        stripped = {Rewrite(strip).apply(n) for n in names}
        for add, keys in wanted.items():
            score = len(stripped & keys)
            if score > best_score:  # candidates come smallest first: ties keep it
                best, best_score = Rewrite(strip, add), score
    return best


def _infer_loaded(names: list[str], expected: dict[str, MaybeShape], load: Load) -> Rewrite:
    """``infer_rewrite`` where the library renames at load: each candidate
    rewritten, then loaded; the rewrite that changes nothing first."""
    def score(rewrite: Rewrite) -> int:
        return sum(1 for n in load(dict.fromkeys(map(rewrite.apply, names))) if n in expected)

    best, best_score = Rewrite(), score(Rewrite())
    if best_score == len(expected):
        return best
    adds = _candidates(expected)
    for strip in _candidates(names):
        for add in adds:
            rewrite = Rewrite(strip, add)
            if not rewrite.empty and (found := score(rewrite)) > best_score:
                best, best_score = rewrite, found
    return best


def reconcile(shapes: dict[str, MaybeShape], expected: dict[str, MaybeShape],
              tied: dict[str, tuple[str, ...]] | None = None,
              rewrite: Rewrite | None = None, load: Load | None = None) -> KeyReport:
    """Compare file keys (with their shapes) with the expected ones. ``tied``
    maps each key to the keys sharing its tensor in the model; ``load``
    names the keys as the library loads them (after the rewrite)."""
    if rewrite is None:
        rewrite = infer_rewrite(list(shapes), expected, load)
    renamed = {rewrite.apply(k): v for k, v in shapes.items()}
    if load is not None:
        renamed = load(renamed)
    matched, missing, mismatched = [], [], []
    for key, shape in expected.items():
        if key not in renamed:
            missing.append(key)
        elif (got := renamed[key]) is not None and shape is not None and got != shape:
            mismatched.append((key, tuple(got), tuple(shape)))
        else:
            matched.append(key)
    unexpected = [k for k in renamed if k not in expected]
    tied_missing = {}
    for k in missing:
        twin = next((t for t in (tied or {}).get(k, ()) if t in renamed), None)
        if twin is not None:
            tied_missing[k] = twin
    before = sum(1 for k in (load(dict(shapes)) if load is not None else shapes)
                 if k in expected)
    return KeyReport(rewrite, matched, missing, unexpected, mismatched, before, tied_missing)


@dataclass(frozen=True)
class ShapeHint:
    """Why shapes differ, in constructor terms: file value vs model value."""

    file_value: int
    model_value: int
    keys: int  # mismatched keys showing this pair
    arguments: tuple[str, ...]  # constructor arguments equal to model_value
    saved: tuple[str, ...]  # saved hyper-parameters equal to file_value


def explain_shapes(mismatched: list[tuple[str, Shape, Shape]], arguments: dict[str, Any],
                   saved: dict[str, Any]) -> list[ShapeHint]:
    """Dimension pairs (file, model) behind the mismatches, most common first,
    with the constructor arguments that hold the model's value and the
    saved hyper-parameters that hold the file's."""
    pairs: Counter[tuple[int, int]] = Counter()
    for _, got, want in mismatched:
        if len(got) != len(want):
            continue
        seen = {(g, w) for g, w in zip(got, want, strict=True) if g != w}
        pairs.update(seen)
    hints = []
    for (file_value, model_value), n in pairs.most_common(3):
        args = tuple(k for k, v in arguments.items() if _is_int(v) and v == model_value)
        hp = tuple(k for k, v in saved.items() if _is_int(v) and v == file_value)
        hints.append(ShapeHint(file_value, model_value, n, args, hp))
    return hints


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
