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

import re

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
