"""Two checkpoints in one directory: refused, with both named, before
``recognise`` picks one of them and reads it as the directory.

``refuse_two`` finds what a directory's names and first bytes show: a DCP
``.metadata`` with its ``.distcp`` files, a shard index with its shards,
DeepSpeed's model and optimizer states (or tag directories holding them),
files saved per rank, torch's HuggingFaceStorageWriter shards, accelerate's
DCP sub-directories, and checkpoint files of their own. Two of them are an
error, unless one is a companion of the other by design:

- a file with a role beside a model (``optimizer.pt``, ``rng_state.pth``,
  ``training_args.bin``...: ``framework.role_of``), Lightning's ``meta.pt``
  and Megatron-core's ``common.pt`` beside a DCP ``.metadata``;
- a shard index and the framework's other files of the same model
  (``model.safetensors``, ``pytorch_model.bin``, the other format's shards,
  its variants: ``loaders``);
- a Trainer's ``checkpoint-N/``: the model (an index or one file) beside
  DeepSpeed's tag directory;
- in a folder whose ``config.json`` (or ``adapter_config.json``) describes
  the model, a shard index beside other checkpoint files: transformers loads
  the index (Mistral's repositories ship ``consolidated.safetensors`` too).

Checkpoint files with no layout joining them are ``recognise``'s to judge
(one model among a framework's files, or refused).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckptool.describe import plural, shell_word
from ckptool.errors import InputError
from ckptool.read.layouts import framework, loaders
from ckptool.read.layouts.names import (
    ACCELERATE_DIRS,
    DATA_FILE,
    DEEPSPEED_FILE,
    HF_STORAGE_SHARD,
    LATEST,
    MAX_SNIFFED,
    METADATA,
    MODEL_FILE,
    OPTIM_FILE,
    PREFERRED_INDEXES,
    RANK_METADATA,
    RANK_NAME,
    SHARD_NAME,
    holds_dcp,
    is_checkpoint_file,
    latest,
    listing,
    shown,
)

# files that belong to the DCP checkpoint beside them: Lightning's sharded
# .ckpt directory (meta.pt), Megatron-core's torch_dist checkpoint (common.pt)
DCP_COMPANIONS = ("meta.pt", "common.pt")
HF, TAGS, FILES = "hf", "tags", "files"
WORDS = {2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class Found:
    """One checkpoint a directory holds."""

    kind: str  # HF, TAGS, FILES, or the kind of another layout of many files
    what: str  # "a Hugging Face sharded checkpoint (model.safetensors.index.json)"
    named: str | None = None  # the path that reads it alone, where there is one


def refuse_two(path: str, files: list[str], dirs: list[str],
               indexes: dict[str, dict[str, Any]]) -> None:
    """Raise where ``path`` holds two checkpoints that are not one framework's
    folder; ``indexes`` are its shard indexes, parsed."""
    found = _found(path, files, dirs, indexes)
    many = [f for f in found if f.kind not in (TAGS, FILES)]
    tags = [f for f in found if f.kind == TAGS]
    lone = [f for f in found if f.kind == FILES]
    if not (len(many) > 1 or (many and tags and many[0].kind != HF)  # a Trainer's: by design
            or (many and lone and not (many[0].kind == HF and framework.configures_model(files)))):
        return
    clash = many + tags + lone  # all of them named
    whats = [f.what for f in clash]
    said = ", ".join(whats[:-1]) + f" and {whats[-1]}"
    named = next((f.named for f in clash if f.named), None)
    others = "the other" if len(clash) == 2 else "the others"
    hint = (f"name one: ckptool inspect {shell_word(named)}, or move {others} into a "
            "directory of its own" if named else
            "move one of them into a directory of its own, and name that directory")
    raise InputError(f"{path} holds {WORDS.get(len(clash), len(clash))} checkpoints, {said}: "
                     "ckptool cannot tell which one is the model", hint)


def _found(path: str, files: list[str], dirs: list[str],
           indexes: dict[str, dict[str, Any]]) -> list[Found]:
    out: list[Found] = []
    data = [n for n in files if DATA_FILE.match(n)]
    owned = set(data)  # a DCP's, with or without its .metadata (recognise says which)
    metas = [n for n in files if n == METADATA] or [n for n in files if RANK_METADATA.match(n)]
    if metas:
        owned.update(metas + [n for n in DCP_COMPANIONS if n in files])
        out.append(Found("dcp", f"a torch.distributed.checkpoint ({shown(metas)} and "
                                f"{plural(len(data), '.distcp file')})"))
    if indexes:
        chosen = next((n for n in PREFERRED_INDEXES if n in indexes), sorted(indexes)[0])
        shards = {v for index in indexes.values() for v in index["weight_map"].values()
                  if isinstance(v, str)}
        owned.update(indexes, shards, (n for n in files if loaders.parse(n) is not None or (
            SHARD_NAME.search(n) and not HF_STORAGE_SHARD.match(n))))
        out.append(Found(HF, f"a Hugging Face sharded checkpoint ({shown(sorted(indexes))})",
                         os.path.join(path, chosen)))
    states = [n for n in files if DEEPSPEED_FILE.search(n)]
    if states:
        owned.update(states)
        out.append(Found("deepspeed", f"a DeepSpeed checkpoint ({shown(states)})"))
    wrapped = sorted((d for d in dirs if ACCELERATE_DIRS.match(d)
                      and holds_dcp(os.path.join(path, d))),
                     key=lambda d: (not d.startswith("pytorch_model"), d))
    if wrapped:
        out.append(Found("accelerate", f"accelerate's sharded checkpoint "
                                       f"({shown([d + '/' for d in wrapped])})",
                         os.path.join(path, wrapped[0])))
    rest = [n for n in files if n not in owned and framework.role_of(n) is None]
    out += _files(path, [n for n in rest[:MAX_SNIFFED]
                         if is_checkpoint_file(os.path.join(path, n))])
    tags = [d for d in dirs[:MAX_SNIFFED] if any(
        MODEL_FILE.match(n) or OPTIM_FILE.match(n) for n in listing(os.path.join(path, d)))]
    if tags:
        tag = latest(path) if LATEST in files else None
        out.append(Found(TAGS, f"a DeepSpeed checkpoint ({shown([d + '/' for d in tags])})",
                         os.path.join(path, tag if tag in tags else tags[-1])))
    return out


def _files(path: str, found: list[str]) -> list[Found]:
    """Checkpoint files no layout above owns: HuggingFaceStorageWriter shards,
    files saved per rank (ranks 0 to N-1 of one name), and the rest."""
    out = []
    pieces = [n for n in found if HF_STORAGE_SHARD.match(n)]
    if pieces:
        out.append(Found("hf-storage", f"torch's HuggingFaceStorageWriter shards "
                                       f"({shown(pieces)})"))
    groups: dict[str, dict[int, str]] = {}
    for name in found:
        m = RANK_NAME.match(name)
        if m and name not in pieces:
            groups.setdefault(m.group("stem"), {})[int(m.group("rank"))] = name
    ranked = [name for ranks in groups.values()
              if len(ranks) > 1 and sorted(ranks) == list(range(len(ranks)))
              for name in ranks.values()]
    if ranked:
        out.append(Found("per-rank", f"a checkpoint saved per rank ({shown(sorted(ranked))})"))
    lone = [n for n in found if n not in pieces and n not in ranked]
    if lone:
        what = (f"the checkpoint file {lone[0]}" if len(lone) == 1 else
                f"{len(lone)} checkpoint files ({shown(lone)})")
        out.append(Found(FILES, what, os.path.join(path, lone[0])))
    return out
