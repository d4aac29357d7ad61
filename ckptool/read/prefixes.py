"""Key prefixes: what wrappers (DataParallel, torch.compile, Lightning,
PEFT) put in front of state-dict names, and how to find them.
"""

from __future__ import annotations

from collections.abc import Iterable

# dotted component runs that wrappers add, and who adds them; longest first
# so that "base_model.model." wins over "model."
WRAPPERS: tuple[tuple[str, ...], ...] = (
    ("base_model", "model"),
    ("_orig_mod",),
    ("module",),
    ("model",),
    ("_forward_module",),
)
WRAPPER_NAMES = {"base_model.model.": "PEFT", "_orig_mod.": "torch.compile",
                 "module.": "DataParallel/DDP", "model.": "a Lightning module attribute",
                 "_forward_module.": "Lightning Fabric"}


# wrappers that are never part of a model's own names: DataParallel/DDP,
# torch.compile, Fabric. "model." and "base_model.model." may be either a
# wrapper (a Lightning module's attribute) or the model's own naming (every
# transformers decoder keeps its layers under "model."; PEFT its base model)
ALWAYS_WRAPPERS = ("module.", "_orig_mod.", "_forward_module.")


def split_wrappers(prefix: str) -> tuple[str, str]:
    """``prefix`` as (its leading components that are always wrappers, the
    rest): ``_orig_mod.module.model.`` -> (``_orig_mod.module.``, ``model.``)."""
    i = 0
    while True:
        step = next((w for w in ALWAYS_WRAPPERS if prefix.startswith(w, i)), None)
        if step is None:
            return prefix[:i], prefix[i:]
        i += len(step)


def common_prefix(names: Iterable[str]) -> str:
    """Longest run of leading dotted module components shared by all names."""
    common: list[str] | None = None
    shared = ""  # common as text: a name that starts with it changes nothing
    for name in names:
        if shared and name.startswith(shared):
            continue
        parts = name.split(".")[:-1]
        if common is None:
            common = parts
            shared = ".".join(common) + "." if common else ""
            continue
        n = 0
        while n < len(common) and n < len(parts) and common[n] == parts[n]:
            n += 1
        del common[n:]
        if not common:
            break
        shared = ".".join(common) + "."
    return ".".join(common) + "." if common else ""


def wrapper_prefix(names: Iterable[str], common: str | None = None) -> str:
    """The wrapper components (``module.``, ``_orig_mod.module.``...) leading
    every name, or "" if the names do not all share one. ``common`` is
    ``common_prefix(names)`` when the caller has it already."""
    runs = leading_wrappers(common_prefix(names) if common is None else common)
    return runs[-1] if runs else ""


def leading_wrappers(name: str) -> list[str]:
    """The wrapper prefixes ``name`` starts with, each one longer:
    ``_orig_mod.module.fc.weight`` -> ``["_orig_mod.", "_orig_mod.module."]``."""
    parts = name.split(".")[:-1]
    runs: list[str] = []
    i = 0
    while i < len(parts):
        for run in WRAPPERS:
            if tuple(parts[i: i + len(run)]) == run:
                i += len(run)
                runs.append(".".join(parts[:i]) + ".")
                break
        else:
            break
    return runs


def describe_wrapper(prefix: str) -> str:
    """Who adds ``prefix``: "torch.compile over DataParallel/DDP", "PEFT"..."""
    if prefix in WRAPPER_NAMES:
        return WRAPPER_NAMES[prefix]
    known = [WRAPPER_NAMES[p + "."] for p in prefix.rstrip(".").split(".")
             if p + "." in WRAPPER_NAMES]
    return " over ".join(known) if known else "a wrapper"
