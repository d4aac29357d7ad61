"""One verify run's state (``Run``: the problems found, the files checked,
the CRC pool) and the checks of one file alone: it exists as a regular
file, its zip directory holds (its records' CRC-32 sent to the pool), and
read by itself, its pickles or header parse.

A file of a checkpoint of many files is checked alone so that one damaged
file never hides another: the layout's reader stops at its first error.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from ckptool.check.verify.problems import (
    CRC,
    HEADER,
    MISSING_FILE,
    PICKLE,
    UNREADABLE,
    Problem,
    classify,
)
from ckptool.check.verify.zipcheck import CrcPool, open_zip, records_of
from ckptool.errors import (
    CorruptCheckpointError,
    InputError,
    NotACheckpointError,
    UnsupportedCheckpointError,
)
from ckptool.read import dispatch, fs
from ckptool.read.formats import safetensors_fmt, torch_legacy, torch_zip
from ckptool.read.formats.base import RawRead

ZIP, LEGACY, SAFETENSORS, PICKLE_FILE = "torch-zip", "torch-legacy", "safetensors", "pickle"
NO_CHECKSUM = {
    SAFETENSORS: "safetensors files record no checksum",
    LEGACY: "legacy torch files record no checksum",
    PICKLE_FILE: "plain pickles record no checksum",
}


@dataclass
class Run:
    """What a verify run has found so far."""

    directory: str  # file names are relative to it
    pool: CrcPool
    problems: list[Problem] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # every file checked
    formats: dict[str, str] = field(default_factory=dict)  # file -> format, by its first bytes
    notes: list[str] = field(default_factory=list)
    crc_zero: set[str] = field(default_factory=set)  # archives saved without CRC-32

    def path(self, name: str) -> str:
        return fs.join(self.directory, name) if self.directory else name

    def add(self, *problems: Problem) -> None:
        self.problems.extend(problems)

    def bad_files(self) -> set[str]:
        return {p.file for p in self.problems if p.file}

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def stat_file(run: Run, name: str, named_by: str | None = None,
              missing: str | None = None) -> int | None:
    """The size of file ``name``, or None and the problem: missing (said
    as ``missing``, when given), or not a regular file."""
    path = run.path(name)
    by = f" (named by {named_by})" if named_by else ""
    if fs.is_remote(path):
        return _stat_remote(run, name, path, by, missing)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        run.add(Problem(MISSING_FILE, missing or f"the file is missing{by}", name))
        return None
    except OSError as exc:
        run.add(Problem(UNREADABLE, f"cannot read it ({exc.strerror})", name))
        return None
    if not stat.S_ISREG(info.st_mode):
        run.add(Problem(UNREADABLE, f"not a regular file{by}", name))
        return None
    run.sizes[name] = info.st_size
    return info.st_size


def _stat_remote(run: Run, name: str, path: str, by: str, missing: str | None) -> int | None:
    """``stat_file`` of a remote file, from its folder's listing."""
    if not fs.exists(path):
        run.add(Problem(MISSING_FILE, missing or f"the file is missing{by}", name))
        return None
    if fs.isdir(path):
        run.add(Problem(UNREADABLE, f"not a regular file{by}", name))
        return None
    run.sizes[name] = size = fs.getsize(path)
    return size


def lexists(path: str) -> bool:
    """Whether there is something at ``path`` (locally a link counts, even
    one whose target is gone)."""
    return fs.exists(path) if fs.is_remote(path) else os.path.lexists(path)


def sniff(path: str) -> str | None:
    """A file's format by its first bytes (None: not a checkpoint file, or unreadable)."""
    try:
        with fs.open_binary(path) as f:
            head = f.read(16)
    except OSError:
        return None
    if torch_zip.sniff(head):
        return ZIP
    if torch_legacy.sniff(head):
        return LEGACY
    if safetensors_fmt.sniff(head):
        return SAFETENSORS
    return PICKLE_FILE if head[:1] == b"\x80" else None


def check_file(run: Run, name: str, named_by: str | None = None,
               missing: str | None = None) -> bool:
    """``name`` exists and, when it is a zip, its directory holds (its
    stored records sent to the CRC pool). False when it is absent."""
    size = stat_file(run, name, named_by, missing)
    if size is None:
        return False
    fmt = sniff(run.path(name))
    if fmt is not None:
        run.formats[name] = fmt
    if fmt != ZIP:
        return True
    path = run.path(name)
    try:
        with fs.open_binary(path) as f:
            archive, problems = open_zip(f, size, name)
            if archive is not None:
                found = records_of(archive, 0, name)
                problems += found.problems
                run.pool.checked += found.checked
                if found.unrecorded:
                    run.crc_zero.add(name)
                    run.note(f"{name} records no CRC-32 (saved with torch's compute_crc32="
                             "False): its bytes cannot be checked")
                run.pool.submit(path, name, found.records)
    except OSError as exc:
        run.add(Problem(UNREADABLE, f"cannot read it ({exc.strerror})", name))
        return True
    run.add(*problems)
    return True


def read_alone(run: Run, name: str) -> RawRead | None:
    """``name`` read by itself with its format's reader (its pickles or
    header parsed); None, and the problem, when it does not read."""
    path = run.path(name)
    try:
        return dispatch.read(path)
    except CkptoolErrors as exc:
        problem = read_problem(run, name, exc)
        if problem is not None:
            run.add(problem)
        return None


CkptoolErrors = (CorruptCheckpointError, NotACheckpointError, UnsupportedCheckpointError,
                 InputError)


def read_problem(run: Run, name: str, exc: InputError) -> Problem | None:
    """The problem a reader's error says of file ``name``; None when the
    zip checks say it already (its directory, a record's checksum)."""
    message = local(exc.message, run.path(name), name)
    fmt = run.formats.get(name)
    if isinstance(exc, UnsupportedCheckpointError) or not isinstance(
            exc, (CorruptCheckpointError, NotACheckpointError)):
        return Problem(UNREADABLE, message, name)
    if isinstance(exc, NotACheckpointError) and name.endswith(".safetensors") and \
            fs.isfile(run.path(name)) and fs.getsize(run.path(name)) >= 8:
        # named as safetensors, with bytes of no format: its header is damaged
        return Problem(HEADER, safetensors_damage(run.path(name)), name)
    kind = classify(message, HEADER if fmt == SAFETENSORS or isinstance(
        exc, NotACheckpointError) else PICKLE)
    if fmt == ZIP and name not in run.crc_zero and (
            kind == CRC or "zip archive is truncated or corrupt" in message):
        return None  # the directory check or the CRC pool says it, naming the record
    return Problem(kind, message, name)


def safetensors_damage(path: str) -> str:
    """What is wrong with a file named as safetensors whose first bytes are
    no format: its header's 8-byte length, or the header's first byte."""
    size = fs.getsize(path)
    with fs.open_binary(path) as f:
        head = f.read(9)
    length = int.from_bytes(head[:8], "little")
    if length + 8 > size:
        return (f"damaged safetensors header: its 8-byte length says {length:,} bytes of "
                f"header, and the file holds {size:,} in all")
    return (f"damaged safetensors header: it starts with {head[8:9]!r}, where a header is "
            "JSON that starts with b'{'")


def local(message: str, path: str, name: str) -> str:
    """A reader's message about ``path`` as one about ``name``: without the
    path it opens with, and naming the file as the report does."""
    if message.startswith(f"{path}: "):
        message = message[len(path) + 2:]
    return message.replace(path, name) if path != name else message
