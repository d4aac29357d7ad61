"""What a path holds, when it is a directory or an index file: recognised by
content, and a clear error for anything else.

- an index file (JSON with a ``weight_map``), or a directory holding one:
  Hugging Face shards; in a framework's folder, the weights its loader
  reads (``loaders``: transformers' single file before its index,
  safetensors before ``.bin``; diffusers' index first; never a variant
  beside the plain model);
- a directory with a ``.metadata`` pickle (or one ``__<rank>.metadata`` per
  rank, from ``dcp.save(use_collectives=False)``): DCP, Lightning's sharded
  ``.ckpt`` directory when a ``meta.pt`` sits beside it;
- a directory whose DCP checkpoints sit in accelerate's sub-directories
  (``pytorch_model_fsdp_0/``, ``optimizer_0/``): those, read together;
- DeepSpeed: a tag directory holding ``*_model_states.pt`` (and, under ZeRO,
  ``*_optim_states.pt``), or the directory above it whose ``latest`` names
  the tag (Lightning's DeepSpeed ``.ckpt`` directory is one: tag
  ``checkpoint``); without ``latest``, its one tag directory;
- a DeepSpeed universal checkpoint (``zero/`` beside model states), or the
  directory whose ``latest_universal`` (and no ``latest``) names it;
- files saved per rank (``*rank_<r>.pt``), or torch's HuggingFaceStorageWriter
  shards (``shard-00001-model-00001-of-00001.safetensors``): joined;
- a directory holding exactly one checkpoint file (by its first bytes), or
  one model beside a framework's other files (``ckptool.read.layouts.framework``).
  A diffusers pipeline's root is refused with its components named, a
  Hugging Face cache repository with its snapshot, a folder of PEFT
  adapters in subfolders with each (``nested``).

Nothing here reads more than an index's JSON and a few bytes of each file,
and nothing here imports a format reader beyond their ``sniff`` functions.
"""

from __future__ import annotations

import os
import stat
from dataclasses import replace

from ckptool.describe import plural, shell_word
from ckptool.errors import CorruptCheckpointError, InputError, NotACheckpointError
from ckptool.read import fs
from ckptool.read.layouts import framework, loaders  # (journal, mixed, nested: a folder's)
from ckptool.read.layouts.layout import (  # (what a layout is: re-exported)
    DCP,
    DEEPSPEED,
    FILE,
    HF,
    HF_STORAGE,
    MEGATRON,
    PER_RANK,
    Layout,
    describe,
)
from ckptool.read.layouts.names import (
    ACCELERATE_DIRS,
    DATA_FILE,
    HF_STORAGE_SHARD,
    INDEX_NAME,
    LATEST,
    MAX_INDEX_BYTES,
    MAX_SNIFFED,
    METADATA,
    MODEL_FILE,
    OPTIM_FILE,
    PREFERRED_INDEXES,
    RANK_METADATA,
    RANK_NAME,
    RECOVERY_SCRIPTS,
    ds_universal,
    is_checkpoint_file,
    is_deepspeed_tag,
    listing,
)
from ckptool.read.layouts.names import holds_dcp as _holds_dcp
from ckptool.read.layouts.names import index_json as _index_json
from ckptool.read.layouts.names import latest as _latest
from ckptool.read.layouts.names import shown as _names
from ckptool.read.megatron import layout as megatron_layout
from ckptool.read.megatron import nemo

__all__ = ["DCP", "DEEPSPEED", "FILE", "HF", "HF_STORAGE", "MEGATRON", "PER_RANK", "Layout",
           "describe", "recognise"]

def recognise(path: str) -> Layout | None:
    """The layout at ``path``; None for a path that is not a directory or an
    index file (a single checkpoint file, or something the format readers
    explain: missing, empty, not a checkpoint)."""
    if fs.is_remote(path):
        mode = (stat.S_IFREG if fs.isfile(path) else stat.S_IFDIR if fs.isdir(path) else 0)
    else:
        try:
            mode = os.stat(path).st_mode
        except NotADirectoryError:  # a file in a .nemo: read in place
            return recognise(path) if nemo.archive_above(path) else None
        except OSError:
            return None
    if stat.S_ISREG(mode):
        index = _index_json(path)
        if index is None:  # a .nemo (a tar) reads as the folder it holds
            return _directory(path) if nemo.archive(path) else None
        return Layout(HF, path, os.path.dirname(path) or ".", index=os.path.basename(path))
    if not stat.S_ISDIR(mode):
        return None
    return _directory(path)


def _directory(path: str) -> Layout:
    from ckptool.read.layouts import journal, mixed

    try:
        entries = sorted(fs.entries(path))
    except OSError as exc:
        raise InputError(f"{path}: cannot list the directory ({exc.strerror})",
                         "check its permissions") from exc
    # (never a file ckptool is writing, or a killed fix left: ``journal``)
    files = [name for name, _, is_file in entries if is_file and not journal.is_temporary(name)]
    dirs = [name for name, is_dir, _ in entries if is_dir]
    named = [n for n in files if INDEX_NAME.search(n)]
    parsed = {n: _index_json(os.path.join(path, n)) for n in named}
    indexes = [n for n in named if parsed[n]]
    mixed.refuse_two(path, files, dirs, {n: index for n in indexes if (index := parsed[n])})
    if (weights := nemo.layout(path, files, dirs, _directory)) is not None:
        return weights  # NeMo's folder: the weights in it, and what its config says
    if megatron_layout.TRACKER in files:  # a Megatron save directory: its latest iteration
        chosen, others = megatron_layout.iteration(path, dirs)
        inner = _directory(os.path.join(path, chosen))
        if inner.kind == DCP and inner.wrapper is None:  # --ckpt-format torch_dcp, fsdp_dtensor
            inner = replace(inner, wrapper="megatron-dcp")
        return replace(inner, path=path, iteration=chosen, notes=(*inner.notes, *others))
    metadata = [n for n in files if n == METADATA] or [n for n in files
                                                       if RANK_METADATA.match(n)]
    if metadata:
        return _dcp(path, files, metadata)
    ranks = megatron_layout.rank_files(path, dirs)
    if ranks:
        return Layout(MEGATRON, path, path, metadata=ranks, iteration=fs.basename(path))
    config = framework.json_file(path, "config.json") if "config.json" in files else None
    explicit = config.get("transformers_weights") if isinstance(config, dict) else None
    choice = loaders.choose(files, explicit if isinstance(explicit, str) else None,
                            peft="adapter_config.json" in files)
    if choice is not None and choice.name is None:
        message, pick = loaders.several(path, choice)
        raise InputError(message, f"name one: ckptool inspect "
                                  f"{shell_word(os.path.join(path, pick))}")
    if choice is not None and choice.name is not None and (
            choice.index or any(loaders.parse(n) for n in named)):
        # what the framework's loader reads: a single file before an index
        # (transformers), an index before the single file (diffusers)...
        return _with_deepspeed(path, files, dirs, _chosen(path, files, choice, parsed))
    if indexes:
        return _with_deepspeed(path, files, dirs, _hf(path, indexes))
    if named and any(n in PREFERRED_INDEXES for n in named):
        broken = next(n for n in named if n in PREFERRED_INDEXES)
        raise CorruptCheckpointError(
            f"{os.path.join(path, broken)} is not a shard index: no JSON object with a "
            "\"weight_map\" of tensor names to shard files (damaged, cut short, or over "
            f"{MAX_INDEX_BYTES >> 20} MiB)",
            "download or copy the index again; to read one shard alone, name it")
    wrapped = sorted((d for d in dirs if ACCELERATE_DIRS.match(d)
                      and _holds_dcp(os.path.join(path, d))),
                     key=lambda d: (not d.startswith("pytorch_model"), d))  # the model first
    if wrapped:
        # accelerate numbers a second model (and its optimizer) _1, _2...: the
        # first one's are read, the others named (their keys would collide)
        first = [d for d in wrapped if _accelerate_index(d) == 0]
        later = [d for d in wrapped if d not in first]
        metas = tuple(f"{d}/{METADATA}" for d in first or wrapped[:1])
        unknown = [n for n in files if framework.role_of(n) is None]  # the rest: listed by role
        notes: tuple[str, ...] = (
            f"{path} also holds {_names(unknown)}, not part of the sharded model: "
            "inspect them by name",) if unknown else ()
        if later:
            notes += (f"{path} also holds {_names([d + '/' for d in later])}: another "
                      "model's or optimizer's checkpoint, read alone by naming it",)
        return Layout(DCP, path, path, metadata=metas, wrapper="accelerate", notes=notes)
    if (universal := ds_universal(path, files, dirs)) is not None:  # ds_to_universal's
        return universal
    deepspeed, beside = _deepspeed(path, files, dirs)
    if deepspeed is not None:
        return deepspeed
    configured = choice if choice is not None and framework.configures_model(files) else None
    return _lone_file(path, files, dirs, (beside,) if beside else (), configured)


def _chosen(path: str, files: list[str], choice: loaders.Choice,
            parsed: dict[str, dict[str, object] | None]) -> Layout:
    """The layout of the weights a framework's loader reads (``choice``)."""
    assert choice.name is not None
    # an index that names only the file read is that file (with the ties its metadata records)
    same = next((n for n, index in parsed.items() if index and not choice.index
                 and _only(index) == {choice.name}), None)
    notes = tuple(loaders.notes(path, choice, [n for n in files if n != same]))
    if not choice.index and same is None:
        return Layout(FILE, path, path, file=os.path.join(path, choice.name), notes=notes)
    if same is not None:
        return Layout(HF, path, path, index=same, notes=notes)
    if not parsed.get(choice.name):
        raise CorruptCheckpointError(
            f"{os.path.join(path, choice.name)} is not a shard index: no JSON object with a "
            "\"weight_map\" of tensor names to shard files (damaged, cut short, or over "
            f"{MAX_INDEX_BYTES >> 20} MiB)",
            f"download or copy the index again ({choice.loader} reads it); to read one shard "
            "alone, name it")
    others = [n for n, index in parsed.items() if index and n != choice.name
              and loaders.parse(n) is None]  # a framework's other indexes: roles, listed
    if others:
        notes += (f"{path} also holds {_names(others)}; read {choice.name}, as "
                  f"{choice.loader} would (name an index to read another)",)
    return Layout(HF, path, path, index=choice.name, notes=notes)


def _only(index: dict[str, object]) -> set[object]:
    """The files an index's weight_map names."""
    weight_map = index.get("weight_map")
    return set(weight_map.values()) if isinstance(weight_map, dict) else set()


def _with_deepspeed(path: str, files: list[str], dirs: list[str], layout: Layout) -> Layout:
    """``layout`` with a note naming the DeepSpeed checkpoint beside it (HF
    Trainer's checkpoint-N/ with DeepSpeed's tag directory)."""
    tag = _latest(path) if LATEST in files else None
    if tag is None or not (tag in dirs or is_deepspeed_tag(os.path.join(path, tag))):
        return layout
    return replace(layout, notes=(
        *layout.notes, f"{path} also holds a DeepSpeed checkpoint ({tag}/, named by "
        "'latest'): its fp32 master weights are read by naming it: "
        f"ckptool inspect {shell_word(os.path.join(path, tag))}"))


def _deepspeed(path: str, files: list[str], dirs: list[str]) -> tuple[Layout | None, str]:
    """A DeepSpeed tag directory, or the directory above one; or, where a
    checkpoint file sits beside the tag directory (HF Trainer's
    ``checkpoint-N/`` with its model file), None and a note naming it."""
    if any(MODEL_FILE.match(n) or OPTIM_FILE.match(n) for n in files):
        return Layout(DEEPSPEED, path, path,
                      tag=fs.basename(path)), ""
    tags = [d for d in dirs if is_deepspeed_tag(os.path.join(path, d))]
    tag = _latest(path) if LATEST in files else None
    if tag is not None and "/" in tag and is_deepspeed_tag(os.path.join(path, tag)):
        tags.append(tag)  # a nested tag (resume/global_step9), as DeepSpeed joins it
    if not tags:
        return None, ""
    if tag is not None and tag not in tags:
        raise CorruptCheckpointError(
            f"{os.path.join(path, LATEST)} names the tag {tag!r}, but {path} has no DeepSpeed "
            f"checkpoint {tag}/ (it has {_names([d + '/' for d in tags])})",
            "the save was interrupted, or the tag directory was not copied; name a tag "
            "directory to read it")
    others = [n for n in files if n not in (LATEST, *RECOVERY_SCRIPTS)]
    # a model file beside the tag directory (a Trainer's checkpoint-N/) is
    # the model; its optimizer, RNG state and training arguments are not
    if any(framework.role_of(n) is None and is_checkpoint_file(os.path.join(path, n))
           for n in others[:MAX_SNIFFED]):
        shown = tag or tags[-1]
        return None, (f"{path} also holds a DeepSpeed checkpoint ({shown}/): its fp32 master "
                      f"weights are read by naming it: ckptool inspect "
                      f"{shell_word(os.path.join(path, shown))}")
    if tag is None and len(tags) > 1:
        raise InputError(
            f"{path} holds {plural(len(tags), 'DeepSpeed checkpoint')} "
            f"({_names([d + '/' for d in tags])}) and no 'latest' file saying which is current",
            f"name the one to read: ckptool inspect {shell_word(os.path.join(path, tags[-1]))}")
    chosen = tag or tags[0]
    unknown = [n for n in others if framework.role_of(n) is None]  # the rest: listed by role
    notes = (f"{path} also holds {_names(unknown)}, not part of the DeepSpeed checkpoint: "
             "inspect them by name",) if unknown else ()
    return Layout(DEEPSPEED, path, os.path.join(path, chosen), tag=chosen, notes=notes), ""


def _dcp(path: str, files: list[str], metadata: list[str]) -> Layout:
    for name in metadata:
        with fs.open_binary(os.path.join(path, name)) as f:
            head = f.read(2)
        if not head.startswith(b"\x80"):
            raise CorruptCheckpointError(
                f"{os.path.join(path, name)} is not a pickle: a torch.distributed.checkpoint "
                f"directory's {name} is one",
                "the directory is damaged, or was not written by torch.distributed.checkpoint")
    fallbacks = tuple(n for n in files if RANK_METADATA.match(n) and n not in metadata)
    megatron = megatron_layout.torch_dist(path, files)
    if megatron is not None:  # Megatron-core's distributed checkpoint: DCP and common.pt
        extras, notes = megatron
        return Layout(DCP, path, path, metadata=tuple(metadata), extras=extras,
                      wrapper="megatron", fallbacks=fallbacks, notes=notes)
    extras = ("meta.pt",) if "meta.pt" in files else ()
    return Layout(DCP, path, path, metadata=tuple(metadata), extras=extras,
                  wrapper="lightning" if extras else None, fallbacks=fallbacks)


def _hf(path: str, indexes: list[str]) -> Layout:
    chosen = next((n for n in PREFERRED_INDEXES if n in indexes), None)
    if chosen is None and len(indexes) == 1:
        chosen = indexes[0]
    if chosen is None:
        raise InputError(
            f"{path} holds {len(indexes)} shard indexes ({_names(indexes)}): ckptool cannot "
            "tell which one is the model",
            f"name one: ckptool inspect {shell_word(os.path.join(path, indexes[0]))}")
    others = [n for n in indexes if n != chosen]
    notes = (f"{path} also holds {_names(others)}; read {chosen}, as transformers would "
             "(name an index to read another)",) if others else ()
    return Layout(HF, path, path, index=chosen, notes=notes)


def _lone_file(path: str, files: list[str], dirs: list[str], notes: tuple[str, ...] = (),
               choice: loaders.Choice | None = None) -> Layout:
    """The one checkpoint file of ``path``: the one there is, or the one a
    framework's loader reads (``choice``, where a config describes the
    model), or one model beside a framework's other files."""
    from ckptool.read.layouts import nested

    data = [n for n in files if DATA_FILE.match(n)]
    if data:  # `cp src/* dst/` leaves .metadata behind; DCP writes it last
        raise CorruptCheckpointError(
            f"{path} holds torch.distributed.checkpoint data files ({_names(data)}) but no "
            ".metadata to say what is in them",
            "copy the checkpoint's .metadata too (`cp src/* dst/` skips dot files), or wait "
            "for the save to finish: it writes .metadata last")
    found = [n for n in files[:MAX_SNIFFED] if is_checkpoint_file(os.path.join(path, n))]
    pieces = [n for n in found if HF_STORAGE_SHARD.match(n)]
    if pieces and len(pieces) == len(found):  # even one: its name says which of how many
        # every shard its name says is one, read or not: a damaged one is
        # the reader's to refuse, never left out without a word
        return Layout(HF_STORAGE, path, path,
                      metadata=tuple(n for n in files if HF_STORAGE_SHARD.match(n)))
    if choice is not None and choice.name is not None:  # what from_pretrained reads
        return Layout(FILE, path, path, file=os.path.join(path, choice.name),
                      notes=notes + tuple(loaders.notes(path, choice, files)))
    model = framework.pick_model(found, framework.configures_model(files)) \
        if len(found) > 1 else None
    if model is not None:  # a Trainer's checkpoint-N/, accelerate's save_state folder
        found = [model]
    if len(found) == 1:
        return Layout(FILE, path, path, file=os.path.join(path, found[0]), notes=notes)
    ranked = _rank_files(path, found)
    if ranked is not None:
        return ranked
    if found:
        raise InputError(
            f"{path} is a directory holding {len(found)} checkpoint files "
            f"({_names(found)}) and no shard index or .metadata that joins them",
            f"name the one to read: ckptool inspect {shell_word(os.path.join(path, found[0]))}")
    dcp_dirs = [d for d in dirs if _holds_dcp(os.path.join(path, d))]
    if dcp_dirs:
        raise InputError(
            f"{path} is a directory holding {plural(len(dcp_dirs), 'DCP checkpoint')} in "
            f"sub-directories ({_names([d + '/' for d in dcp_dirs])})",
            f"name the one to read: ckptool inspect {shell_word(os.path.join(path, dcp_dirs[0]))}")
    facts = framework.folder_facts(path, files, dirs)
    parts = () if facts is None else facts.components \
        if facts.kind != "sentence-transformers" \
        else tuple(d for d in nested.st_module_paths(path) if d in dirs)
    models = [d for d in parts if any(
        is_checkpoint_file(os.path.join(path, d, n)) or INDEX_NAME.search(n)
        for n in sorted(listing(os.path.join(path, d)))[:MAX_SNIFFED])] if facts else []
    if facts is not None and models:
        raise InputError(
            f"{path} is {facts.description}, whose models are read one at a time: "
            f"{_names([d + '/' for d in models])}",
            f"name the one to read: ckptool inspect {shell_word(os.path.join(path, models[0]))}")
    nested.refuse(path, dirs)  # a Hub cache's repository, PEFT adapters in subfolders
    if not files and not dirs:
        raise NotACheckpointError(f"{path} is an empty directory",
                                  "point ckptool at a checkpoint file or a checkpoint directory")
    what = _names(files + [d + "/" for d in dirs])
    other = framework.other_framework(files, dirs)
    if other is not None:
        raise NotACheckpointError(f"{path} is {other[0]}, not a PyTorch checkpoint: it holds "
                                  f"{what}", other[1])
    raise NotACheckpointError(
        f"{path} is a directory with no checkpoint in it: it holds {what}",
        "ckptool reads a checkpoint file, a directory of Hugging Face shards with their "
        "*.index.json, or a torch.distributed.checkpoint directory (.metadata + *.distcp)")


def _rank_files(path: str, found: list[str]) -> Layout | None:
    """Files named by rank (``model_world_size_2_rank_0.pt``), ranks 0 to N-1:
    one checkpoint; of several (veRL's model, optim...) the model's."""
    groups: dict[str, dict[int, str]] = {}
    for name in found:
        m = RANK_NAME.match(name)
        if m:
            groups.setdefault(m.group("stem"), {})[int(m.group("rank"))] = name
    whole = {stem: ranks for stem, ranks in groups.items()
             if len(ranks) > 1 and sorted(ranks) == list(range(len(ranks)))}
    if not whole or sum(len(r) for r in whole.values()) != len(found):
        return None
    stems = sorted(whole, key=lambda s: (not s.startswith("model"), s))
    ranks = whole[stems[0]]
    notes = tuple(f"{path} also holds {_names([whole[s][0]])} ... ({plural(len(whole[s]), 'rank')}"
                  "): read them alone by naming one" for s in stems[1:])
    return Layout(PER_RANK, path, path, metadata=tuple(ranks[r] for r in sorted(ranks)),
                  notes=notes)


def _accelerate_index(name: str) -> int:
    """``pytorch_model_fsdp_1`` -> 1 (accelerate's number of the model or
    optimizer); no number is 0."""
    m = ACCELERATE_DIRS.match(name)
    return int(m.group(2)[1:]) if m and m.group(2) else 0
