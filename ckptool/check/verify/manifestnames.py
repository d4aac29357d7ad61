"""A manifest's tensor names paired with a checkpoint's of another layout,
as ``ckptool diff`` pairs two checkpoints' names.

One model's tensors take other names in other layouts: ``dcp.save({"model":
sd})`` gives ``model.fc.weight``, ``torch.save({"model": sd})`` the nested
key ``model/fc.weight``, and its conversion to safetensors ``fc.weight``.
``diff`` compares them after taking off the entry or wrapper each side's
names carry; a manifest is only names, so here the names left unmatched on
both sides are compared as dotted names (``model/fc.weight`` as
``model.fc.weight``) after taking off the one leading run of components on
each side (``model.``, ``state_dict.model.``, none) that pairs the most of
them, each name with one name. Names the same on both sides are paired as
they are, first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ckptool.keys import split_key

MAX_DEPTH = 3  # leading components that may be taken off a name
SAMPLE = 2000  # the checkpoint's names whose pairs choose the prefixes


def pair_names(current: Iterable[str], recorded: Iterable[str]) -> dict[str, str]:
    """Each of the ``current`` keys whose name the ``recorded`` keys spell
    otherwise, with the recorded key it stands for; {} when no way of
    taking prefixes off pairs at least half of the names left unmatched."""
    cur, rec = list(current), list(recorded)
    in_c, in_r = set(cur), set(rec)
    left_c = [k for k in cur if k not in in_r]
    left_r = [k for k in rec if k not in in_c]
    if not left_c or not left_r:
        return {}
    dotted_c = {k: _dotted(k) for k in left_c}
    dotted_r = {k: _dotted(k) for k in left_r}
    by_suffix: dict[str, set[str]] = {}
    for name in dotted_r.values():
        for p in _prefixes(name):
            by_suffix.setdefault(name[len(p):], set()).add(p)
    counts: Counter[tuple[str, str]] = Counter()
    names = list(dotted_c.values())
    for name in names[::max(1, len(names) // SAMPLE)]:  # which prefixes: told by a sample
        for q in _prefixes(name):
            for p in by_suffix.get(name[len(q):], ()):
                counts[(p, q)] += 1
    if not counts:
        return {}
    strip_r, strip_c = max(counts, key=lambda pq: (counts[pq], -len(pq[0]) - len(pq[1])))
    names_r = _unique({k: _strip(n, strip_r) for k, n in dotted_r.items()})
    names_c = _unique({k: _strip(n, strip_c) for k, n in dotted_c.items()})
    pairs = {names_c[n]: names_r[n] for n in names_c.keys() & names_r.keys()}
    if len(pairs) < max(1, min(len(left_c), len(left_r)) // 2):
        return {}
    return {k: pairs[k] for k in left_c if k in pairs}  # in the checkpoint's order


def _dotted(key: str) -> str:
    """``model/fc.weight`` -> ``model.fc.weight``: a key's components joined
    as a flattened state dict (DCP's) names them."""
    return ".".join(split_key(key))


def _prefixes(name: str) -> list[str]:
    """``""`` and each leading run of ``name``'s components (up to
    ``MAX_DEPTH``) that leaves a name after it, with its dot."""
    out, dot = [""], -1
    for _ in range(MAX_DEPTH):
        dot = name.find(".", dot + 1)
        if dot < 0:
            break
        out.append(name[:dot + 1])
    return out


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _unique(names: dict[str, str]) -> dict[str, str]:
    """name -> key, for the names only one key gives."""
    seen = Counter(names.values())
    return {n: k for k, n in names.items() if seen[n] == 1}
