"""Hugging Face shards, as ``huggingface_hub.save_torch_state_dict`` and
``transformers`` write them: which tensor goes in which shard, the shard
names, and the index.

- ``--max-shard-size`` means what it means there: tensors are taken in order
  and a shard is closed when the next tensor would take it over the size; a
  tensor larger than the size gets a shard of its own. Sizes are decimal
  (``5GB`` is 5 * 10**9 bytes); a plain number is bytes.
- One shard is ``model.safetensors`` (``pytorch_model.bin``) with no index;
  more are ``model-00001-of-0000N.safetensors`` and an index
  ``model.safetensors.index.json``: ``{"metadata": {"total_size": ...},
  "weight_map": {name: shard}}``, ``total_size`` being the bytes of the
  tensors stored, each once.
- Tied names (aliases) stay in their tensor's shard in torch shards (they share
  its storage there); safetensors cannot share, so there the name is left out
  and recorded as ``alias: kept`` in the index's metadata (in the file's
  ``__metadata__`` when there is one file), as huggingface_hub records them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptool.errors import UsageError

if TYPE_CHECKING:
    from ckptool.write.convert.plan import Written

DEFAULT_MAX = 5 * 10**9
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
PATTERNS = {"hf": ("model", ".safetensors"), "hf-bin": ("pytorch_model", ".bin")}


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """``5GB`` -> 5000000000 (Hugging Face's decimal units; ``GiB`` binary),
    for ``option`` (named in the error)."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS:
        raise UsageError(f"{option} {text!r} is not a size",
                         "write it as a number and a unit: 5GB, 500MB, 2GiB")
    size = int(float(m.group(1)) * UNITS[unit])
    if size <= 0:
        raise UsageError(f"{option} {text!r} is not a size above zero",
                         "write it as a number and a unit: 5GB, 500MB")
    return size


@dataclass
class Shard:
    name: str
    tensors: list[str] = field(default_factory=list)  # names stored in it
    aliases: list[str] = field(default_factory=list)  # torch shards: tied names kept here
    nbytes: int = 0


def plan(written: Written, kind: str, max_size: int = DEFAULT_MAX,
         stem: str | None = None) -> list[Shard]:
    """The shards of ``written``'s tensors (in order), named for ``kind`` (hf,
    hf-bin) or, with ``stem``, as a framework names its own
    (``diffusion_pytorch_model``, ``adapter_model``)."""
    groups: list[Shard] = []
    current = Shard("")
    for name in written.tensors:
        size = written.nbytes(name)
        if size > max_size:
            groups.append(Shard("", [name], nbytes=size))
            continue
        if current.tensors and current.nbytes + size > max_size:
            groups.append(current)
            current = Shard("")
        current.tensors.append(name)
        current.nbytes += size
    if current.tensors or not groups:
        groups.append(current)
    prefix, suffix = PATTERNS[kind]
    prefix = stem or prefix
    n = len(groups)
    for i, shard in enumerate(groups):
        shard.name = f"{prefix}{suffix}" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}{suffix}"
    return _place_aliases(groups, written, kind)


def same_files(written: Written, kind: str, file_of: dict[str, str]) -> list[Shard]:
    """The shards of ``written`` in the files ``file_of`` names (fix keeps a
    sharded checkpoint's shards: the same names, each with its own tensors)."""
    groups: dict[str, Shard] = {}
    for name in written.tensors:
        shard = groups.setdefault(file_of[name], Shard(file_of[name]))
        shard.tensors.append(name)
        shard.nbytes += written.nbytes(name)
    return _place_aliases(list(groups.values()), written, kind)


def _place_aliases(groups: list[Shard], written: Written, kind: str) -> list[Shard]:
    if kind == "hf-bin":  # a tied name is stored beside its tensor, sharing its storage
        where = {name: shard for shard in groups for name in shard.tensors}
        for alias, kept in written.aliases.items():
            where[kept].aliases.append(alias)
    return groups


def index(shards: list[Shard], aliases: dict[str, str], kind: str) -> dict[str, object]:
    """The index JSON of more than one shard."""
    metadata: dict[str, object] = {"total_size": sum(s.nbytes for s in shards)}
    weight_map: dict[str, str] = {}
    for shard in shards:
        for name in (*shard.tensors, *shard.aliases):
            weight_map[name] = shard.name
    if kind == "hf":
        metadata.update(aliases)
    return {"metadata": metadata, "weight_map": weight_map}


def index_name(kind: str, stem: str | None = None) -> str:
    prefix, suffix = PATTERNS[kind]
    return f"{stem or prefix}{suffix}.index.json"
