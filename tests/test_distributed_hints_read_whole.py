"""The hint a rank's failure carries, once its staging directory is there,
says how to resume and keeps the words around what it drops: a full disk's
"free space on that filesystem, or write elsewhere (nothing was left
half-written)" becomes "... or write elsewhere; ... run the same command
again", never "write elsewhere ()"."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from ckptool.errors import CkptoolError
from ckptool.write.distributed import ending
from ckptool.write.failures import output_error


@dataclass
class Staged:
    staged: bool = True


def test_a_full_disk_hint_loses_its_brackets_with_their_words() -> None:
    err = output_error("/x/out", OSError(errno.ENOSPC, "No space left on device"))
    hint = ending._hint(err, Staged())  # type: ignore[arg-type]
    assert "()" not in hint and "elsewhere;" in hint
    assert hint.startswith("free space on that filesystem, or write elsewhere")
    assert "nothing was left half-written" not in hint and "run the same command" in hint


def test_a_bug_hint_keeps_what_comes_before() -> None:
    err = CkptoolError("m", "check x; this is a bug in ckptool; nothing was written")
    hint = ending._hint(err, Staged())  # type: ignore[arg-type]
    assert hint.startswith("check x; ") and "bug" not in hint
