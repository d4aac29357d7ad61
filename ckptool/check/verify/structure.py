"""``check(path, jobs)``: everything a checkpoint's files say about
themselves, in every layout ckptool reads, as a ``Report``.

Each file is checked alone first (``files``: it exists, its zip directory
holds, its records' CRC-32 computed on ``jobs`` threads while the rest is
read), then the layout as a whole: an HF index against its shards
(``hfindex``), a DCP directory item by item (``dcpcheck``), and every
layout through its own reader (``ckptool.read.reader.open_checkpoint``:
sizes, coverage, DeepSpeed's partitions against ``param_shapes``, the
ranks' shards). Where that reader refuses, each file is read alone, so that
one damaged file never hides another. A Hugging Face cache snapshot's
blobs are checked against their names (``hfcache``).

A damaged checkpoint is a list of problems; only a path that is no
checkpoint at all, or that ckptool cannot read, raises (exit 3). Nothing
is written, and no tensor byte is read except by the CRC.
"""

from __future__ import annotations

import os
import re

from ckptool.check.verify import (
    dcpcheck,
    distcpalone,
    filehash,
    hfcache,
    hfindex,
    layouts,
    remotebytes,
)
from ckptool.check.verify.files import (
    NO_CHECKSUM,
    SAFETENSORS,
    ZIP,
    Run,
    check_file,
    local,
    read_alone,
    read_problem,
    safetensors_damage,
    stat_file,
)
from ckptool.check.verify.problems import (
    CRC,
    HEADER,
    MISMATCH,
    MISSING_FILE,
    TRUNCATED,
    UNREADABLE,
    Problem,
    Report,
    classify,
    dedupe,
)
from ckptool.check.verify.zipcheck import CrcPool, Failure, failure_text
from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError, InputError, NotACheckpointError
from ckptool.model import Checkpoint
from ckptool.read import dispatch, fs
from ckptool.read.layouts.names import DATA_FILE, MAX_SNIFFED, is_checkpoint_file, listing
from ckptool.read.layouts.recognise import DCP, FILE, HF, Layout
from ckptool.read.reader import open_checkpoint

SHOWN = 3  # tensors named in a damaged record's problem
# a file's name in a reader's message (never a pattern's tail: ``*_model_states.pt``)
FILE_NAME = re.compile(r"(?<![\w.*-])[\w.-]+\.(pt|pth|bin|ckpt|safetensors|distcp|json)\b")
# a file in a sub-folder (``zero/lin.weight/fp32.pt``), named by its path
PATH_NAME = re.compile(r"(?<![\w.*/-])[\w.-]+(?:/[\w.-]+)+\."
                       r"(pt|pth|bin|ckpt|safetensors|distcp|json)\b")


def default_jobs() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check(path: str, jobs: int | None = None, pool: CrcPool | None = None,
          full: bool = False) -> Report:
    """Verify the checkpoint at ``path`` (a file, a directory, an index, a
    file or folder of a Hugging Face cache snapshot, a URL). ``pool``: what
    computes the records' CRC-32 (a ``spread.SharedPool`` shares it among
    the ranks of a distributed job); a ``CrcPool`` of ``jobs`` threads
    unless given. A URL's bytes beyond its structure are read only with
    ``full`` (``remotebytes``)."""
    jobs = jobs or default_jobs()
    remote = fs.is_remote(path)
    first: tuple[str, Checkpoint | InputError] | None = None
    if remote:  # read whole first: its reader forgets what was fetched before
        filehash.forget_remote()
        first = (path, _read(path))
    snapshot = hfcache.locate(path)
    target = snapshot.target if snapshot is not None else path
    cache = hfcache.check(snapshot, jobs) if snapshot is not None else None
    pool = pool if pool is not None else CrcPool(jobs)
    layout: Layout | None = None
    ckpt: Checkpoint | None = None
    tensors: int | None = None
    try:
        try:
            run, layout, ckpt, tensors = _structure(target, pool, first)
        except InputError as exc:
            if cache is None or not cache.problems:
                raise
            # an interrupted download may leave no checkpoint to read: that is the problem
            run = Run(target if fs.isdir(target) else fs.dirname(target), pool)
            run.add(Problem(UNREADABLE, local(exc.message, target, os.path.basename(target))))
        read = remotebytes.check(run, pool, jobs, full) if remote else None
        failures = pool.failures() + (read.failures if read is not None else [])
    finally:
        pool.close()
    _name_failures(run, ckpt, failures)
    if cache is not None:  # a file whose blob is gone: said once, by the cache
        run.problems[:] = cache.problems + [p for p in run.problems if not (
            p.kind == MISSING_FILE and p.file in cache.missing)]
    hashed = (cache.hashed if cache is not None else set()) | (  # a blob's name is its sha256
        read.hashed if read is not None else set())  # the Hub's sha256 of each file
    for kind in dict.fromkeys(k for n, k in run.formats.items() if n not in hashed):
        if kind in NO_CHECKSUM:
            run.note(f"{NO_CHECKSUM[kind]}: damage inside their tensor bytes shows only "
                     "against a manifest (verify --write-manifest FILE, later --manifest FILE)")
    unsafe = ckpt.unsafe_globals if ckpt is not None else []
    if unsafe:  # whole, and yet not what verify vouches for
        run.note(f"it names globals torch.load(weights_only=False) would call ("
                 f"{', '.join(unsafe[:3])}{', …' if len(unsafe) > 3 else ''}): no damage, but "
                 "do not load it so; see ckptool diagnose")
    checks = ["structure", *(["crc"] if pool.checked or failures or (
                  read is not None and read.records) else []),
              *(["hf-cache"] if cache is not None else []),
              *(["store-sha256"] if read is not None and read.hashed else [])]
    fmt = ckpt.format if ckpt is not None else layouts.format_of(
        layout, next(iter(run.formats.values()), None))
    count = len(ckpt.tensors) if ckpt is not None else tensors
    return Report(path, fmt, [{"name": n, "size": s} for n, s in run.sizes.items()], count,
                  pool.checked + (cache.checked if cache is not None else 0) + (
                      read.checked if read is not None else 0),
                  dedupe(run.problems), checks, notes=run.notes, checkpoint=ckpt)


def _structure(path: str, pool: CrcPool, first: tuple[str, Checkpoint | InputError] | None
               ) -> tuple[Run, Layout | None, Checkpoint | None, int | None]:
    """Each file, then the layout; ``first``: the checkpoint already read
    (a URL), by the path it was read from."""
    def _open(path: str) -> Checkpoint | InputError:
        return first[1] if first is not None and first[0] == path else _read(path)

    layout, problems = layouts.recognised(path)
    kind = FILE if layout is None or layout.kind == FILE else layout.kind
    if kind == FILE:
        one = layouts.one_file(path, layout)
        assert one.file is not None
        run = Run(fs.dirname(one.file), pool)
        name = fs.basename(one.file)
        try:
            dispatch.check(one.file)  # missing, empty, not a checkpoint: exit 3
        except NotACheckpointError:
            if not one.file.endswith(".safetensors") or fs.getsize(one.file) < 8:
                raise
            # named as safetensors, with bytes of no format: its header is damaged
            check_file(run, name)
            run.formats[name] = SAFETENSORS
            run.add(Problem(HEADER, safetensors_damage(one.file), name))
            return run, layout, None, None
        check_file(run, name)
        ckpt = _refused(run, path, _open(path), name)
        _companions(run, ckpt, path)
        return run, layout, ckpt, None
    assert layout is not None
    run = Run(layout.directory, pool)
    run.add(*problems)
    tensors = None
    read: Checkpoint | InputError | None
    if kind == HF:
        assert layout.index is not None
        check_file(run, layout.index)
        present = hfindex.check_shards(run, layout.index)
        hfindex.extra_shards(run, layout.index)
        read = _open(layout.path)  # the directory, or its index where the directory is refused
        if isinstance(read, InputError):
            hfindex.cross_check(run, layout.index, present)
    elif kind == DCP:
        tensors = dcpcheck.check(run, layout)
        read = _open(path)
    else:
        if layout.index is not None:  # a damaged index: the files beside it, alone
            stat_file(run, layout.index)
        names = layouts.layout_files(layout)
        data = [n for n in names if kind == layouts.ALONE and DATA_FILE.match(n)]
        for name in data:  # DCP's data files without their .metadata: archive by archive
            distcpalone.check(run, name)
        names = [n for n in names if n not in data and check_file(run, n)]
        read = _open(path) if kind != layouts.ALONE else None
        if not isinstance(read, Checkpoint):
            for name in names:
                read_alone(run, name)
    ckpt = _refused(run, path, read)
    _companions(run, ckpt, path if kind == HF else None)
    return run, layout, ckpt, tensors


def _read(path: str) -> Checkpoint | InputError:
    """The checkpoint read whole by its layout's reader, or why it was not."""
    try:
        return open_checkpoint(path)
    except InputError as exc:
        return exc


def _refused(run: Run, path: str, read: Checkpoint | InputError | None,
             name: str | None = None) -> Checkpoint | None:
    """The checkpoint read whole; else None, and what its reader refused as
    a problem, unless the checks of each file said it already. A refusal
    that is no damage (no checkpoint, one ckptool cannot read) raises,
    unless the files were found damaged. ``name``: the one file read."""
    if not isinstance(read, InputError):
        return read
    if not isinstance(read, CorruptCheckpointError) and not run.problems:
        raise read
    if name is not None:  # one file: its reader's error is that file's
        problem = read_problem(run, name, read)
        run.add(*([problem] if problem is not None else []))
        return None
    message = _shorter(run, local(read.message, path, path))
    kind = classify(message, MISMATCH)
    inner = PATH_NAME.search(message)  # a file in a sub-folder ("zero/x/fp32.pt"): that one
    named = inner.group(0) if inner else next(
        (n for n in sorted(run.sizes, key=len, reverse=True) if os.path.basename(n) in message),
        None)
    if _said(run, message) or (kind == CRC and run.formats.get(named or "") == ZIP \
            and named not in run.crc_zero):
        return None  # the reader stopped at what the checks found (or the CRC will)
    if named is None:  # a file it names that is not there
        found = FILE_NAME.search(message)
        named = found.group(0) if found else None
    if named is not None:  # named once, as the problem's file
        message = message.removeprefix(f"{named}: ")
        if run.directory:  # "...: DIR has no NAME", of the file the problem names
            message = re.sub(rf":? {re.escape(run.directory)} has no {re.escape(named)}", "",
                             message)
    run.add(Problem(kind, message, named))
    return None


def _said(run: Run, message: str) -> bool:
    """Whether a reader's ``message`` is about a problem already found: it
    names a file or a tensor found damaged, or says what a problem says."""
    if any(os.path.basename(bad) in message for bad in run.bad_files()):
        return True
    for p in run.problems:
        if p.message.endswith(message) or message.endswith(p.message):
            return True
        if p.tensor and re.search(rf"(^|[\s'\"(]){re.escape(p.tensor)}($|[\s'\":,)])", message):
            return True
    return False


def _shorter(run: Run, message: str) -> str:
    """A reader's message with the checkpoint's directory left out of the
    paths it gives."""
    if run.directory:
        message = message.replace(os.path.join(run.directory, ""), "")
    return message


def _companions(run: Run, ckpt: Checkpoint | None, folder: str | None = None) -> None:
    """The other files of a framework's folder (an optimizer state, an RNG
    state...): their zip records checked, and what reading them found.
    Where the model could not be read (nothing said what its folder is),
    every other checkpoint file of ``folder`` is checked alone."""
    if ckpt is None and folder is not None and fs.isdir(folder):
        for name in sorted(listing(folder))[:MAX_SNIFFED]:
            if name not in run.sizes and is_checkpoint_file(fs.join(folder, name)) \
                    and check_file(run, name):
                read_alone(run, name)
    framework = ckpt.framework if ckpt is not None else None
    if framework is None:
        return
    for c in framework.companions:
        if c.format is None and c.error is None:
            continue
        full = os.path.join(framework.directory, c.path)
        name = os.path.relpath(full, run.directory or ".")
        if c.error is not None and c.error.startswith("not read"):
            run.note(f"{name}: {c.error}")
            continue
        check_file(run, name)
        if c.error is not None:
            problem = read_problem(run, name, CorruptCheckpointError(c.error))
            run.add(*([problem] if problem is not None else []))


def _name_failures(run: Run, ckpt: Checkpoint | None, failures: list[Failure]) -> None:
    """Each record whose CRC-32 failed as a problem naming the tensors
    whose bytes it holds."""
    holders = _Holders(ckpt, run) if failures and ckpt is not None else None
    for f in failures:
        kind = CRC if f.error is None else (
            TRUNCATED if "ends before" in f.error else UNREADABLE)
        text = failure_text(f)
        if isinstance(f.label, tuple):  # a DCP item: the tensor (or value) it holds
            tensor, where = f.label
            run.add(Problem(kind, f"{where}{text}", f.file, tensor))
            continue
        keys = holders.of(f) if holders is not None else []
        if len(keys) == 1:
            run.add(Problem(kind, text, f.file, keys[0]))
            continue
        more = f" and {plural(len(keys) - SHOWN, 'other')}" if len(keys) > SHOWN else ""
        own = f"<{os.path.basename(f.file)}>/"  # a DeepSpeed file's own entries: the file is named
        shown = [k.removeprefix(own) for k in keys[:SHOWN]]
        held = f" (it holds {', '.join(shown)}{more})" if keys else ""
        run.add(Problem(kind, text + held, f.file))


class _Holders:
    """The tensors whose bytes lie in a record: those viewing its storage,
    and those with a chunk inside its bytes (DeepSpeed's runs, a rank's
    shard)."""

    def __init__(self, ckpt: Checkpoint, run: Run) -> None:
        single = next(iter(run.sizes), None) if ckpt.directory is None else None
        self.records: dict[tuple[str | None, str], list[str]] = {}
        for s in ckpt.storages.values():
            if s.record is not None and not s.record.startswith("@"):
                self.records.setdefault((s.file or single, s.record), []).extend(s.tensors)
        self.chunks: dict[str, list[tuple[int, int, str]]] = {}
        for t in ckpt.tensors:
            for c in t.chunks:
                self.chunks.setdefault(c.file, []).append(
                    (c.byte_offset, c.byte_offset + c.byte_length, t.key))

    def of(self, f: Failure) -> list[str]:
        r = f.record
        keys = list(self.records.get((f.file, r.name), ()))
        end = r.offset + r.size
        keys += [key for start, stop, key in self.chunks.get(f.file, ())
                 if start < end and r.offset < stop]
        return list(dict.fromkeys(keys))
