"""Key prefixes: what wrappers (DataParallel, torch.compile, Lightning,
PEFT) put in front of state-dict names, and how to find them.
"""

from __future__ import annotations

from collections.abc import Iterable

# dotted component runs that wrappers add; longest first so that
# "base_model.model." wins over "model."
WRAPPERS: tuple[tuple[str, ...], ...] = (
    ("base_model", "model"),
    ("_orig_mod",),
    ("module",),
    ("model",),
    ("_forward_module",),
)


def common_prefix(names: Iterable[str]) -> str:
    """Longest run of leading dotted module components shared by all names."""
    common: list[str] | None = None
    for name in names:
        parts = name.split(".")[:-1]
        if common is None:
            common = parts
            continue
        n = 0
        while n < len(common) and n < len(parts) and common[n] == parts[n]:
            n += 1
        del common[n:]
        if not common:
            break
    return ".".join(common) + "." if common else ""


def wrapper_prefix(names: Iterable[str], common: str | None = None) -> str:
    """The wrapper components (``module.``, ``_orig_mod.module.``...) leading
    every name, or "" if the names do not all share one. ``common`` is
    ``common_prefix(names)`` when the caller has it already."""
    parts = (common_prefix(names) if common is None else common).split(".")[:-1]
    taken: list[str] = []
    i = 0
    while i < len(parts):
        for run in WRAPPERS:
            if tuple(parts[i: i + len(run)]) == run:
                taken.extend(run)
                i += len(run)
                break
        else:
            break
    return ".".join(taken) + "." if taken else ""
