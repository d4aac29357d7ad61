"""``fix`` on a directory of Hugging Face shards: the same layout, fixed,
written to a new directory.

Every shard keeps its file name and its tensors; the index is rewritten
with the new names (and ``total_size`` after a cast). Key options
(``--strip-module``, ``--strip-prefix``, ``--add-prefix``, ``--rename``)
rename index keys as they rename a single file's state-dict keys; ``--drop``
takes names out (a tied name that loses the tensor it shares gets it);
``--dtype`` casts floating tensors; ``--to`` / ``--map`` retarget torch
shards' storages (safetensors records no device: refused, as for one file).
``--extract`` has nothing to take out of a sharded state dict.

The directory is written by ``convert_dir.write_directory``: beside the
target, every file verified, the whole read back, then renamed into place.

``--in-place`` fixes each shard that changes as ``fix --in-place`` fixes one
file (a torch zip: a new pickle appended, tensor bytes untouched, crash-safe
per file), then rewrites the index atomically, last. Every shard is given
the checkpoint's prefix to strip, not one it would find alone. DCP
directories are ``fix_dcp``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace

from ckptool.describe import shell_word
from ckptool.errors import UsageError
from ckptool.keys import unescape
from ckptool.model import Checkpoint
from ckptool.read import ties
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts.hf_sharded import HF_SAFETENSORS
from ckptool.write import shards
from ckptool.write.commit import AtomicOutput
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.directory import framework_files, write_directory
from ckptool.write.convert.plan import TORCH, Written
from ckptool.write.fix.plan import CASTABLE, FixOptions, Plan, check_consistent, key_function
from ckptool.write.results import FixResult

Progress = Callable[[int, int], None]
FixFile = Callable[..., FixResult]  # ckptool.write.fix.run.fix, for one shard in place


def fix(source: Checkpoint, opts: FixOptions, output: str, *, fix_file: FixFile,
        force: bool = False, in_place: bool = False, dry_run: bool = False,
        progress: Progress | None = None, fsync: bool = False) -> FixResult:
    """Rewrite the sharded checkpoint ``source`` as ``opts`` ask, into ``output``
    (``in_place``: each shard through ``fix_file``, then the index)."""
    path = source.path
    kind = "hf" if source.format == HF_SAFETENSORS else "hf-bin"
    check_consistent(opts)
    if opts.extract is not None:
        raise UsageError(f"{path} is a state dict already: --extract has nothing to take out",
                         "leave --extract out")
    if kind == "hf" and (opts.to or opts.maps):
        raise UsageError("safetensors shards record no device: there is nothing to retarget",
                         "pick the device when loading: load_file(path, device='cuda:0')")
    written = convert_plan.plan(source, SAFETENSORS if kind == "hf" else TORCH,
                                keep_entries=False)
    plan = Plan(None)
    file_of = {name: t.file or "" for name, t in written.tensors.items()}
    promoted = _drop(written, opts, plan, file_of)
    if in_place and kind == "hf" and promoted:
        dropped, heir = promoted[0]
        raise UsageError(
            f"{heir} is tied to {dropped}: safetensors shards store it under {dropped} only, "
            "so dropping that name renames the tensor, which --in-place does not do",
            f"write a fixed copy instead: ckptool fix {shell_word(path)} --drop "
            f"{shell_word(dropped)} -o DIR")
    if opts.changes_keys():
        _rename(written, key_function(opts, source.main_state_dict.prefix
                                      if source.main_state_dict else ""), plan, file_of)
        if opts.strip_module and not (source.main_state_dict and
                                      source.main_state_dict.prefix):
            plan.notes.append("--strip-module: no module./_orig_mod./model. prefix found")
    _storages(written, opts, plan)
    result = FixResult(plan, source, target=source.path if in_place else output)
    if dry_run:
        return result
    if in_place:
        result.bytes_written, result.metadata_only = _in_place(
            source, opts, written, plan, file_of, fix_file, fsync)
        result.output = source.path
        result.verified_storages = len(written.tensors)
        return result
    planned = shards.same_files(written, kind, file_of)
    stem, configs = framework_files(source)  # the framework's index name, its config files
    _, result.bytes_written = write_directory(source, written, kind, output, force=force,
                                              fsync=fsync, progress=progress, planned=planned,
                                              extras=configs, stem=stem)
    result.output = output
    result.verified_storages = len(written.tensors)
    return result


def _in_place(source: Checkpoint, opts: FixOptions, written: Written, plan: Plan,
              file_of: dict[str, str], fix_file: FixFile, fsync: bool) -> tuple[int, bool]:
    """Each shard fixed in place as one file is (a torch zip: its pickle
    only, crash-safe), then the index, atomically, last. Returns the bytes
    written, and whether every shard kept its tensor bytes where they were."""
    assert source.directory is not None
    if plan.empty:  # as one file's: nothing to change, and in place nothing to write
        return 0, True
    renames = dict(plan.renames)
    prefix = source.main_state_dict.prefix if source.main_state_dict else ""
    strip = (prefix,) if opts.strip_module and prefix else ()
    done, metadata_only = 0, True
    for shard in sorted({f.path for f in source.files if f.role == "shard"}):
        held = [t for t in source.tensors if t.file == shard]
        names = {unescape(t.key) for t in held}
        drops = tuple(d for d in opts.drop if unescape(d) in names)
        # the checkpoint's prefix, not one each shard would find on its own
        one = replace(opts, strip_module=False, strip_prefixes=strip + opts.strip_prefixes,
                      drop=drops)
        if not (drops or any(n in renames for n in names) or
                any(t.storage in plan.casts or t.storage in plan.retargets for t in held)):
            continue
        fixed = fix_file(os.path.join(source.directory, shard), one, in_place=True,
                         fsync=fsync)
        done += fixed.bytes_written
        metadata_only &= fixed.metadata_only
    # the index's metadata as it was, but for the ties it recorded: now the plan's
    index = {k: v for k, v in (source.metadata.get("index_metadata") or {}).items()
             if k not in source.aliases}
    if source.format == HF_SAFETENSORS:
        index.update(written.aliases)
    index["total_size"] = sum(written.nbytes(n) for n in written.tensors)
    stored = written.names() if source.format == "hf-bin" else list(written.tensors)
    weight_map = {name: file_of[written.aliases.get(name, name)] for name in stored}
    text = json.dumps({"metadata": index, "weight_map": weight_map}, indent=2) + "\n"
    index_name = str(source.metadata["index"])
    with AtomicOutput(os.path.join(source.directory, index_name), force=True,
                      fsync=fsync) as out:
        out.file.write(text.encode())
        out.file.flush()
        out.commit()
    return done + len(text), metadata_only


def _drop(written: Written, opts: FixOptions, plan: Plan,
          file_of: dict[str, str]) -> list[tuple[str, str]]:
    """Take ``--drop`` names out; returns (dropped, heir) for each stored
    name whose tied name takes its place."""
    promoted = []
    for drop in opts.drop:
        name = unescape(drop)
        if name in written.aliases:
            del written.aliases[name]
        elif name in written.tensors:
            heirs = [a for a, k in written.aliases.items() if k == name]
            if heirs:  # a name tied to it is stored in its place, by the framework's rule
                heir = ties.preferred(heirs)
                written.tensors[heir] = written.tensors[name]
                file_of[heir] = file_of[name]
                promoted.append((name, heir))
                del written.aliases[heir]
                for alias in heirs:
                    if alias != heir:
                        written.aliases[alias] = heir
            del written.tensors[name]
        else:
            raise UsageError(f"cannot drop {drop!r}: the checkpoint has no tensor of that name",
                             "see `ckptool inspect` for its keys")
        written.order = [n for n in written.order if n != name]
        plan.dropped.append(drop)
    return promoted


def _rename(written: Written, rename: Callable[[str], str], plan: Plan,
            file_of: dict[str, str]) -> None:
    names: dict[str, str] = {}
    for name in written.names():
        new = rename(name)
        if new in names.values():
            raise UsageError(f"two keys would both become {new!r}",
                             "check the prefixes and --rename patterns")
        names[name] = new
        if new != name:
            plan.renames.append((name, new))
    written.tensors = {names[n]: t for n, t in written.tensors.items()}
    written.aliases = {names[a]: names[k] for a, k in written.aliases.items()}
    written.order = [names[n] for n in written.order]
    renamed = {names[n]: f for n, f in file_of.items() if n in names}
    file_of.clear()
    file_of.update(renamed)


def _storages(written: Written, opts: FixOptions, plan: Plan) -> None:
    maps = dict(opts.maps)
    for name, t in written.tensors.items():
        if opts.dtype is not None and t.dtype in CASTABLE and t.dtype != opts.dtype:
            written.cast[name] = opts.dtype
            plan.casts[t.storage or name] = (t.dtype, opts.dtype)
        tag = opts.to if opts.to is not None else maps.get(t.location or "")
        if tag is not None and tag != t.location:
            written.location[name] = tag
            plan.retargets[t.storage or name] = tag
    for src in maps:
        if not any(t.location == src for t in written.tensors.values()):
            plan.notes.append(f"--map {src}=...: no storage is saved on {src}")


def default_output(path: str) -> str:
    """``run/model`` -> ``run/model.fixed`` (a directory beside the input)."""
    return os.path.normpath(path) + ".fixed"
