"""``convert ... --manifest FILE`` and ``fix ... --manifest FILE``: the
manifest of what a rewrite wrote, the one ``ckptool verify OUT
--write-manifest FILE`` writes (``manifest.write_manifest`` on the output
as it now reads).

``check_destination`` refuses, before anything is written, a manifest path
that is the output itself or lies in a folder that does not exist (a long
conversion must not end on that). ``write_for_output`` takes the hashes
``convert`` computed from the bytes it re-read to check their CRC (one
file, HF shards: their bytes re-read in file order, each tensor's bytes its
logical bytes), and hashes the rest after the commit (DCP through torch's
writer, ``fix``'s rewritten zips, small files: a second read), said in the
note it returns.
"""

from __future__ import annotations

import os
from typing import Any

from ckptool.check.verify.filehash import same_file
from ckptool.check.verify.manifest import write_manifest
from ckptool.describe import shell_word
from ckptool.errors import OutputError, UsageError


def check_destination(dest: str, output: str | None, source: str | None = None) -> None:
    """A ``UsageError`` where ``dest`` cannot take the manifest of ``output``:
    among other things where it is ``source`` (the input), one of its files
    or inside it (by any name: a link, a hard link), which it would replace."""
    folder = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(folder):
        raise UsageError(f"--manifest {dest}: the folder {folder} does not exist",
                         "create it, or give another path to --manifest")
    if os.path.isdir(dest):
        raise UsageError(f"--manifest {dest} is a directory", "give a file's path")
    if output is not None and same_file(dest, output):
        raise UsageError(f"--manifest {dest} is the output itself",
                         "write the manifest to another path")
    if source is not None and _of_input(dest, source):
        raise UsageError(f"--manifest {dest} is the input {source} or one of its files: "
                         "writing the manifest would replace it",
                         "write the manifest to another path")


def _of_input(dest: str, source: str) -> bool:
    """Whether ``dest`` is ``source``, a file inside it, or another name of one."""
    if same_file(dest, source):
        return True
    if not os.path.isdir(source):
        return False
    real, inside = os.path.realpath(dest), os.path.realpath(source)
    if real.startswith(inside + os.sep):
        return True
    if not os.path.exists(dest):
        return False
    for root, _dirs, files in os.walk(source):
        if any(same_file(dest, os.path.join(root, f)) for f in files):
            return True
    return False


class Streamed:
    """The hashes a writer took of its files as it re-read them (``Known``):
    by each file's real path, its (size, sha256) and its tensors' digests."""

    def __init__(self, streams: dict[str, tuple[Any, int]]) -> None:
        self._files: dict[str, tuple[int, str]] = {}
        self._tensors: dict[str, dict[tuple[int, int], str]] = {}
        for path, (stream, size) in streams.items():
            if size < 0:  # the size the file came to
                try:
                    size = os.path.getsize(path)
                except OSError:
                    continue
            got = stream.result(size)
            if got is not None:
                self._files[path] = (size, got[0])
                self._tensors[path] = got[1]
        self.used_files = 0
        self.used_tensors = 0

    def file(self, path: str) -> tuple[int, str] | None:
        taken = self._files.get(os.path.realpath(path))
        if taken is not None and os.path.getsize(path) == taken[0]:
            self.used_files += 1
            return taken
        return None

    def tensor(self, path: str, offset: int, size: int) -> str | None:
        digest = self._tensors.get(os.path.realpath(path), {}).get((offset, size))
        if digest is not None:
            self.used_tensors += 1
        return digest


def write_for_output(output: str, dest: str, jobs: int,
                     streams: dict[str, tuple[Any, int]] | None = None
                     ) -> tuple[dict[str, Any], str]:
    """Write the manifest of the checkpoint at ``output`` to ``dest``; it and
    the note that says so. ``streams``: the hashes the writer took of the
    bytes it wrote (``write.streamhash``); what they cover is not
    read again."""
    from ckptool.read.reader import open_checkpoint

    known = Streamed(streams or {})
    try:
        manifest = write_manifest(open_checkpoint(output), dest, jobs, known)
    except OutputError as exc:  # OUT itself is in place, whole: say so
        exc.message = f"wrote {output}, but not its manifest: {exc.message}"
        exc.hint = (f"{exc.hint.split(' (')[0]}; then write the manifest again: ckptool "
                    f"verify {shell_word(output)} --write-manifest {shell_word(dest)}")
        raise
    nfiles, ntensors = len(manifest["files"]), len(manifest["tensors"])
    said = (f"manifest of {output} written to {dest} ({nfiles} "
            f"file{'s' if nfiles != 1 else ''}, {ntensors} tensors)")
    if known.used_files == nfiles and known.used_tensors:
        note = f"{said}, from the bytes as they were written: no second read"
    elif known.used_files:
        note = (f"{said}: {known.used_files} of its files hashed as they were checked, the "
                "rest read again")
    else:
        note = f"{said}, reading the output again to hash it"
    return manifest, note


def default_jobs() -> int:
    """Threads hashing the output's files: the machine's cores, up to 8."""
    return max(1, min(8, os.cpu_count() or 1))
