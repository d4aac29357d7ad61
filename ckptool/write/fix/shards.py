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

``--in-place`` changes the directory all at once or not at all, holding its
lock (``dirlock``: a second fix of it waits, then is refused). A journal
first records what the fix may touch (``journaled``). Each shard that
changes is then fixed as ``fix --in-place`` fixes one file, but not put in
place: written beside it and verified (a torch zip of its own: a new pickle
appended after its records, its tensor bytes untouched), and so is the new
index. Then the journal is replaced by one naming every change, and the
changes are made (``ckptool.read.layouts.journal``, which any later command
on the directory uses to finish a fix that a crash cut short, or to roll
back one cut short before). A Ctrl-C or an error before the commit rolls
the directory back as it was, byte for byte; one after it is held until the
directory is fixed (``ckptool.write.interrupt``). A shard or index that is a
link (a Hugging Face cache's snapshot) is replaced by a file of its own;
the file it links to is untouched. Every shard is given the checkpoint's
prefix to strip, not one it would find alone. DCP directories are
``fix_dcp``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

from ckptool.describe import shell_word
from ckptool.errors import InputError, Interrupted, UnsupportedCheckpointError, UsageError
from ckptool.keys import unescape
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import ties
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import dirlock, journal
from ckptool.read.layouts.hf_sharded import HF_SAFETENSORS
from ckptool.write import interrupt, shards
from ckptool.write.commit import AtomicOutput, shared_file
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.directory import write_directory
from ckptool.write.convert.folder import plan_folder
from ckptool.write.convert.plan import TORCH, Written
from ckptool.write.failures import naming
from ckptool.write.fix.flags import flags
from ckptool.write.fix.journaled import Job
from ckptool.write.fix.plan import CASTABLE, FixOptions, Plan, check_consistent, key_function
from ckptool.write.results import FixResult

Progress = Callable[[int, int], None]
FixFile = Callable[..., FixResult]  # ckptool.write.fix.run.fix, for one shard in place


def fix(source: Checkpoint, opts: FixOptions, output: str, *, fix_file: FixFile,
        force: bool = False, in_place: bool = False, dry_run: bool = False,
        progress: Progress | None = None, fsync: bool = False,
        resumed: tuple[str, bool] | None = None, locks: bool = False) -> FixResult:
    """Rewrite the sharded checkpoint ``source`` as ``opts`` ask, into ``output``
    (``in_place``: each shard through ``fix_file``, then the index, with the
    directory's lock held, ``locks`` where the filesystem has them).
    ``resumed``: what ``resume`` settled before ``source`` was read."""
    path = source.path
    if resumed is not None and resumed[1]:  # this very fix, finished: not made twice
        done = FixResult(Plan(None, notes=[resumed[0]]), source, target=path)
        done.output = None if dry_run else path
        return done
    kind = "hf" if source.format == HF_SAFETENSORS else "hf-bin"
    check_consistent(opts)
    if in_place:
        _refuse_nested(source)
    if opts.extract is not None:
        raise UsageError(f"{path} is a state dict already: --extract has nothing to take out",
                         "leave --extract out")
    if kind == "hf" and (opts.to or opts.maps):
        raise UsageError("safetensors shards record no device: there is nothing to retarget",
                         "pick the device when loading: load_file(path, device='cuda:0')")
    written = convert_plan.plan(source, SAFETENSORS if kind == "hf" else TORCH,
                                keep_entries=False)
    plan = Plan(None, notes=[resumed[0]] if resumed else [])
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
            source, opts, written, plan, file_of, fix_file, fsync, locks)
        result.output = source.path
        result.verified_storages = len(written.tensors)
        return result
    planned = shards.same_files(written, kind, file_of)
    beside = plan_folder(source, opts.dtype)  # the framework's index name, files, notes
    plan.notes += beside.notes
    _, result.bytes_written = write_directory(source, written, kind, output, force=force,
                                              fsync=fsync, progress=progress, planned=planned,
                                              extras=beside.extras, stem=beside.stem)
    result.output = output
    result.verified_storages = len(written.tensors)
    return result


@contextlib.contextmanager
def guarded(directory: str, in_place: bool, dry_run: bool) -> Iterator[bool]:
    """Around a fix of ``directory``, from before it is read: a dry run
    refuses an in-place fix that was cut short (it changes nothing, that
    one's end included); an in-place fix holds the directory's lock to the
    end (another waits, then is refused). Yields whether the filesystem locks."""
    if dry_run:
        with journal.left_as_is():
            yield False
    elif in_place:
        with dirlock.locked(directory, lambda: journal.holder(directory)) as locks:
            yield locks
    else:
        yield False


def resume(directory: str, opts: FixOptions, in_place: bool) -> tuple[str, bool] | None:
    """Settle the in-place fix of ``directory`` that a crash cut short, if
    one did (its journal). Returns what to say, and whether it was this very
    fix (asked again: it is done, and is not made twice). A rolled back fix
    is no fix; another one finished refuses this one: it would apply on top
    of that one unseen."""
    try:
        done = journal.settle(directory, say=False)  # (said here, as this fix sees it)
    except journal.SettleInterrupted as exc:  # (a Ctrl-C: settled, and nothing else done)
        finished = exc.settled
        if finished.rolled_back or not in_place:
            raise
        if finished.options == repr(opts):
            raise Interrupted(
                f"interrupted: {finished.done}: it was this same fix, so {directory} is "
                "fixed", "there is nothing more to do: do not run this fix again (it would "
                f"apply it twice); ckptool inspect {shell_word(directory)} shows what it "
                "holds") from None
        raise Interrupted(f"interrupted: {finished.done}: {directory} is fixed as that fix "
                          "asked; this fix was not applied", _ANOTHER.format(
                              shell_word(directory))) from None
    if done is None:
        return None
    if done.rolled_back:
        warnings.warn(journal.InterruptedFixNote(done.note), stacklevel=2)
        return done.note, False
    if in_place and done.options == repr(opts):
        interrupt.mark_fixed(directory)  # a Ctrl-C from now on: it is fixed
        note = f"{done.done}: it was this same fix, so there is nothing more to do"
        warnings.warn(journal.InterruptedFixNote(note), stacklevel=2)
        return note, True
    raise InputError(f"{done.done}: {directory} is fixed as that fix asked; this fix was "
                     "not applied on top of it", _ANOTHER.format(shell_word(directory)))


_ANOTHER = "see what it holds now: ckptool inspect {}; then run this command again if it " \
           "is still wanted"


def _in_place(source: Checkpoint, opts: FixOptions, written: Written, plan: Plan,
              file_of: dict[str, str], fix_file: FixFile, fsync: bool,
              locks: bool) -> tuple[int, bool]:
    """The journal's prepare record; each shard that changes, fixed as one
    file is but beside it (a torch zip: its new pickle appended, verified,
    not committed), and the new index; then the commit record, and the
    changes it names. Anything that stops it first rolls it back. Returns
    the bytes written, and whether every shard kept its tensor bytes where
    they were."""
    directory = source.directory
    assert directory is not None
    if plan.empty:  # as one file's: nothing to change, and in place nothing to write
        return 0, True
    renames = dict(plan.renames)
    prefix = source.main_state_dict.prefix if source.main_state_dict else ""
    strip = (prefix,) if opts.strip_module and prefix else ()
    work = []
    shard_files = {f.path for f in source.files if f.role == "shard"}
    # what each shard stores (a tied name the index records is not in it)
    stored: dict[str, list[TensorInfo]] = {}
    for t in source.tensors:
        if t.file is not None and unescape(t.key) not in source.aliases:
            stored.setdefault(t.file, []).append(t)
    for shard in sorted(shard_files):
        held = stored.get(shard, [])
        names = {unescape(t.key) for t in held}
        drops = tuple(d for d in opts.drop if unescape(d) in names)
        if drops or any(n in renames for n in names) or any(
                t.storage in plan.casts or t.storage in plan.retargets for t in held):
            # the checkpoint's prefix, not one each shard would find on its own
            work.append((shard, replace(opts, strip_module=False,
                                        strip_prefixes=strip + opts.strip_prefixes, drop=drops)))
    index_name = str(source.metadata["index"])
    text = _index_text(source, written, file_of).encode()
    files = shard_files | set(file_of.values())
    job = Job(directory, index_name, repr(opts), command(opts), [s for s, _ in work], files)
    done, metadata_only = 0, True
    with interrupt.changing(source.path) as change, naming(directory):
        try:
            job.prepare(locks)
            for shard, one in work:
                fixed = fix_file(os.path.join(directory, shard), one, in_place=True,
                                 fsync=fsync, pending=job.pending(shard))
                done += fixed.bytes_written
                metadata_only &= fixed.metadata_only
                journal.crash_point("prepared")
            index = os.path.join(directory, index_name)
            with AtomicOutput(os.path.join(directory, job.temps[index_name]), fsync=True,
                              shown=directory, like=index) as out:
                out.file.write(text)
                out.commit()
            job.record.steps.append(journal.Step(index_name, len(text),
                                                 temp=job.temps[index_name]))
            linked = [why for s in job.record.steps
                      if (why := shared_file(os.path.join(directory, s.name)))]
            with change.committing():
                job.commit()
        except BaseException:
            job.roll_back()  # (nothing once committed: the journal finishes it)
            raise
    if linked:
        more = f" (and {len(linked) - 1} more)" if len(linked) > 1 else ""
        plan.notes.append(f"{linked[0]}{more}: each is now a file of its own, and the files "
                          "they shared are untouched")
    return done + len(text), metadata_only


def _refuse_nested(source: Checkpoint) -> None:
    """An in-place fix changes only files of the directory itself (its journal
    names no other): an index naming a shard elsewhere is refused, before
    anything is written."""
    for f in source.files:
        name = f.path
        if f.role == "shard" and ("/" in name or os.sep in name or name.startswith(".")):
            raise UnsupportedCheckpointError(
                f"{source.path}: its index names shard {name!r:.80}, which is not a file of "
                "the directory itself: --in-place fixes only shards beside their index",
                f"write a fixed copy instead: ckptool fix {shell_word(source.path)} -o DIR")


def command(opts: FixOptions) -> str:
    """The flags of ``opts`` as ``ckptool fix`` takes them, with --in-place
    (what a journal shows of the fix it names)."""
    words = flags(opts)
    text = " ".join(words)
    return f"{text[:300]}{' …' if len(text) > 300 else ''} --in-place"


def _index_text(source: Checkpoint, written: Written, file_of: dict[str, str]) -> str:
    """The index with the plan's names: its metadata as it was, but for the
    ties it recorded (now the plan's) and ``total_size``."""
    index = {k: v for k, v in (source.metadata.get("index_metadata") or {}).items()
             if k not in source.aliases}
    if source.format == HF_SAFETENSORS:
        index.update(written.aliases)
    index["total_size"] = sum(written.nbytes(n) for n in written.tensors)
    stored = written.names() if source.format == "hf-bin" else list(written.tensors)
    weight_map = {name: file_of[written.aliases.get(name, name)] for name in stored}
    return json.dumps({"metadata": index, "weight_map": weight_map}, indent=2) + "\n"


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
    """``run/model`` -> ``run/model.fixed`` (a directory beside the input);
    its index named (``run/model/model.safetensors.index.json``), the same:
    the output is a directory, never one inside the input."""
    path = os.path.normpath(path)
    return (os.path.dirname(path) if os.path.isfile(path) else path) + ".fixed"
