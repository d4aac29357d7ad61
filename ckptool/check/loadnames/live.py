"""transformers' own load-time renames, asked of the installed library for a
model that is one of its classes (``PreTrainedModel``): the transforms
``get_model_conversion_mapping(model)`` collects (the model's family, each
sub-model's, the legacy ones), applied by its ``rename_source_key``, and a
gathered tensor built by the converter's own ``convert`` as
``from_pretrained`` builds it.

transformers is never imported here for a model that is not its own: a
model of one of its classes means it is already imported. transformers 4,
which has no conversion mapping, renames by the class's
``_checkpoint_conversion_mapping`` (its ``key_mapping``): regular
expressions applied in turn.
"""

from __future__ import annotations

import copy
import re
import sys
from typing import TYPE_CHECKING, Any

from ckptool.check.loadnames import LoadNames

if TYPE_CHECKING:
    import torch


def transformers_names(model: Any) -> LoadNames | None:
    """How transformers' ``from_pretrained`` names a checkpoint's keys for
    ``model``; None when ``model`` is not a transformers model."""
    library = sys.modules.get("transformers")
    base = getattr(library, "PreTrainedModel", None) if library is not None else None
    if base is None or not isinstance(model, base):
        return None
    version = f"transformers {getattr(library, '__version__', '?')}"
    prefix = getattr(model, "base_model_prefix", "") or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # transformers 4: the class's key_mapping
        return _key_mapping(model, version, prefix)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    def rename(key: str) -> tuple[str, Any, str | None]:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            return name, None, None
        return name, by_pattern[pattern], pattern

    def make(converter: Any, name: str,
             gathered: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        fresh = copy.deepcopy(converter)
        for pattern, tensors in gathered.items():
            for i, t in enumerate(tensors):
                fresh.add_tensor(name, f"{name}#{pattern}#{i}", pattern, lambda t=t: t)
        made = fresh.convert(name, model=model, config=getattr(model, "config", None))
        return dict(made)

    def fills(converter: Any, name: str) -> tuple[str, ...]:
        first, *others = converter.target_patterns
        return tuple(name.replace(first, o, 1) for o in others if first in name)

    return LoadNames(version, "its own conversion mapping", rename, make, prefix, fills)


def _key_mapping(model: Any, version: str, prefix: str | None) -> LoadNames | None:
    mapping = getattr(model, "_checkpoint_conversion_mapping", None)
    patterns = [(re.compile(k), v) for k, v in mapping.items()
                if isinstance(k, str) and isinstance(v, str)] if isinstance(mapping, dict) \
        else []

    def rename(key: str) -> tuple[str, Any, str | None]:
        for pattern, replacement in patterns:
            key, n = pattern.subn(replacement, key)
            if n:
                break
        return key, None, None

    def make(converter: Any, name: str, gathered: Any) -> Any:
        raise AssertionError("transformers 4's key mapping gathers nothing")

    return LoadNames(version, f"{type(model).__name__}'s key mapping", rename, make, prefix)
