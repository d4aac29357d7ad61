"""Tied weights: of the names that share one tensor, the one a writer keeps.

Formats that store a shared tensor once (safetensors; a Hugging Face index
records the rest as aliases) keep one name and drop the others, and the
reader of the output must find the kept name where it looks. transformers
loads the input embedding and ties the output head to it (``lm_head.weight``
is in ``_tied_weights_keys``, never the other way round): keep the
embedding's name, whatever the order of the file (pickle order) or of an
index (alphabetical, where ``lm_head`` comes before ``model.``). Among names
that are neither, the first in the source's order.
"""

from __future__ import annotations

import json
import re
from typing import Any

# input embeddings, as transformers' architectures name them
EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings"
                       r"|shared|embeddings|embedding|embed)(\.|$)")
# output heads tied to them
HEAD = re.compile(r"(^|\.)(lm_head|embed_out|output|decoder|head|cls|classifier|proj_out"
                  r"|generator_lm_head|lm_loss)(\.|$)")


def rank(name: str) -> int:
    """0: an input embedding; 2: an output head; 1: anything else."""
    if EMBEDDING.search(name):
        return 0
    return 2 if HEAD.search(name) else 1


def preferred(names: list[str]) -> str:
    """The name to keep of ``names`` (in the source's order), tied to one tensor."""
    return names[min(range(len(names)), key=lambda i: (rank(names[i]), i))]


def recorded_aliases(meta: dict[str, Any], names: set[str]) -> tuple[dict[str, str], list[str]]:
    """The ``ckptool.aliases`` a safetensors file records (``convert`` wrote
    them: alias -> the tensor it shares), or else the entries of
    ``__metadata__`` that name a tensor of the file under a name it does not
    hold (huggingface_hub records a tied name it drops that way), as far as
    they make sense: the file's metadata is input, not instructions. Returns
    (aliases, notes on what was ignored)."""
    text = meta.get("ckptool.aliases")
    if text is None:  # huggingface_hub's form: a dropped name -> the name kept
        return {k: v for k, v in meta.items() if isinstance(v, str) and v in names
                and k not in names and not k.startswith("ckptool.")}, []
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return {}, ["__metadata__ 'ckptool.aliases' is not JSON: ignored"]
    if not isinstance(raw, dict):
        return {}, ["__metadata__ 'ckptool.aliases' is not a JSON object: ignored"]
    aliases: dict[str, str] = {}
    bad = []
    for alias, kept in raw.items():
        # an alias of a tensor the file has, under a name no tensor has: an
        # alias of an alias (or of itself) is no tensor at all
        if isinstance(kept, str) and kept in names and alias not in names:
            aliases[alias] = kept
        else:
            bad.append(alias)
    notes = [f"__metadata__ 'ckptool.aliases' names {len(bad)} alias(es) that are not "
             f"a new name for a tensor of the file: ignored ({', '.join(bad[:3])})"] if bad else []
    return aliases, notes
