"""``convert ... --manifest FILE`` and ``fix ... --manifest FILE``: the
manifest of what a rewrite wrote, the one ``ckptool verify OUT
--write-manifest FILE`` writes (``manifest.write_manifest`` on the output
as it now reads).

``check_destination`` refuses, before anything is written, a manifest path
that is the output itself or lies in a folder that does not exist (a long
conversion must not end on that). ``write_for_output`` hashes the output
after it was committed: a second read of it, said in the note it returns.
"""

from __future__ import annotations

import os
from typing import Any

from ckptool.check.verify.filehash import same_file
from ckptool.check.verify.manifest import write_manifest
from ckptool.errors import UsageError


def check_destination(dest: str, output: str | None) -> None:
    """A ``UsageError`` where ``dest`` cannot take the manifest of ``output``."""
    folder = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(folder):
        raise UsageError(f"--manifest {dest}: the folder {folder} does not exist",
                         "create it, or give another path to --manifest")
    if os.path.isdir(dest):
        raise UsageError(f"--manifest {dest} is a directory", "give a file's path")
    if output is not None and same_file(dest, output):
        raise UsageError(f"--manifest {dest} is the output itself",
                         "write the manifest to another path")


def write_for_output(output: str, dest: str, jobs: int) -> tuple[dict[str, Any], str]:
    """Write the manifest of the checkpoint at ``output`` to ``dest``; it and
    the note that says so."""
    from ckptool.read.reader import open_checkpoint

    manifest = write_manifest(open_checkpoint(output), dest, jobs)
    note = (f"manifest of {output} written to {dest} ({len(manifest['files'])} "
            f"file{'s' if len(manifest['files']) != 1 else ''}, {len(manifest['tensors'])} "
            "tensors), reading the output again to hash it")
    return manifest, note


def default_jobs() -> int:
    """Threads hashing the output's files: the machine's cores, up to 8."""
    return max(1, min(8, os.cpu_count() or 1))
