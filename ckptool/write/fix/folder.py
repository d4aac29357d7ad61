"""``fix`` into a folder: ``fix DIR -o OUT`` on a folder holding one model
file (a transformers, PEFT or diffusers folder, or any folder of one
checkpoint), or any input with ``-o OUT/``, writes the folder ``OUT/``: the
fixed weights under the name they were read under (the name the folder's
framework loads: ``model.safetensors``, ``adapter_model.safetensors``...)
and the folder's other files beside them as ``convert --format hf`` writes
them (``ckptool.write.convert.folder``: configs, tokenizer..., a
``config.json`` saying the ``--dtype`` cast to), so that ``OUT`` loads as
``DIR`` did. An ``OUT`` named as a checkpoint file
(``x.safetensors``, ``x.pth``...) is that file, as before.

The file is fixed as ``fix`` fixes one file, into a temporary directory
beside ``OUT`` that is renamed into place whole once the file is verified
and the configs copied (``ckptool.write.outdir``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ckptool.errors import OutputError, UsageError
from ckptool.read.companions import framework_of
from ckptool.read.layouts import loaders
from ckptool.read.layouts.recognise import Layout
from ckptool.write.convert.folder import plan_folder, write_extras
from ckptool.write.fix.plan import FixOptions
from ckptool.write.fix.targets import CHECKPOINT_SUFFIXES
from ckptool.write.flagged import refuse_flagged
from ckptool.write.outdir import AtomicDirectory, check_apart
from ckptool.write.results import FixResult
from ckptool.write.streamhash import Streams

Progress = Callable[[int, int], None]
FixFile = Callable[..., FixResult]  # ckptool.write.fix.run.fix, for the file itself


def wanted(given: str, output: str | None) -> str | None:
    """The folder ``fix given -o output`` writes: ``output`` where it ends in
    ``/``, or where ``given`` is a folder and ``output`` is not named as a
    checkpoint file; else None (a file)."""
    if output is None:
        return None
    if output.endswith(("/", os.sep)):
        return output
    named_file = Path(output).suffix.lower() in CHECKPOINT_SUFFIXES
    return output if os.path.isdir(given) and not named_file else None


def fix(given: str, src: str, layout: Layout | None, opts: FixOptions, output: str, *,
        fix_file: FixFile, force: bool = False, dry_run: bool = False,
        progress: Progress | None = None, fsync: bool = False,
        streams: Streams | None = None) -> FixResult:
    """Fix ``src`` (the model file of ``given``, a folder or that file) into
    the folder ``output``, its configs beside it. A variant read because the
    folder holds nothing else (``model.fp16.safetensors``) is written under
    the plain name, which the loader reads without ``variant=`` (and which
    no longer says a dtype ``--dtype`` may have changed)."""
    name = plain_name(os.path.basename(src))
    check_apart(Path(given), Path(output))
    if dry_run:
        if os.path.lexists(output) and not force:
            raise UsageError(f"{output} already exists",
                             "pass --force to replace it, or name another output")
        result = fix_file(src, opts, os.path.join(output, name), dry_run=True)
        _settle(result, given, layout, opts)
        beside = plan_folder(result.source, opts.dtype)
        return _said(result, output, name, beside.notes, "would write")
    with AtomicDirectory(output, force, fsync, source=given) as outdir:
        staged = os.path.realpath(outdir.path)
        try:
            result = fix_file(src, opts, os.path.join(outdir.path, name), progress=progress,
                              fsync=outdir.durable, streams=streams)
        except OutputError as exc:  # said of the folder's file, not of its staging
            exc.message = exc.message.replace(outdir.path, output.rstrip("/") or output)
            raise
        _settle(result, given, layout, opts)
        beside = plan_folder(result.source, opts.dtype)  # as convert --format hf writes them
        write_extras(beside.extras, outdir)
        outdir.commit()
    if streams:  # the file's hashes, under the name it now has (for --manifest)
        final = os.path.realpath(output)
        for key in [k for k in streams if k.startswith(staged + os.sep)]:
            streams[final + key[len(staged):]] = streams.pop(key)
    result.output = output
    return _said(result, output, name, beside.notes, "wrote")


def plain_name(name: str) -> str:
    """A framework's variant file name without its variant
    (``model.fp16.safetensors`` -> ``model.safetensors``); other names as they are."""
    parsed = loaders.parse(name)
    if parsed is None or parsed.kind != loaders.FILE or not parsed.variant:
        return name
    return name.replace(f".{parsed.variant}.", ".", 1)


def _settle(result: FixResult, given: str, layout: Layout | None, opts: FixOptions) -> None:
    """The source as its folder says (every file beside the model: what is
    copied, and what a writer refuses to write from)."""
    if layout is None or not os.path.isdir(given):
        return
    result.source.framework = framework_of(given, layout, result.source)
    refuse_flagged(result.source, opts.salvage, "fix")


def _said(result: FixResult, output: str, name: str, notes: list[str],
          verb: str) -> FixResult:
    result.target = output
    parsed = loaders.parse(name)
    fw = result.source.framework
    loader = f", the file {loaders.LOADER[parsed.family]} loads" if parsed else ""
    if fw is not None and fw.kind == "accelerate":  # no config: from_pretrained has nothing
        loader = (": the model alone (accelerate's load_state reads the training state "
                  "beside it too, which is not copied)")
    read = os.path.basename(result.source.path)
    was = f" (the folder's {read}, under the name read without variant=)" \
        if read != name and plain_name(read) == name else ""
    result.plan.notes += [f"{output} is a folder: {verb} {name}{was}{loader}", *notes]
    return result
