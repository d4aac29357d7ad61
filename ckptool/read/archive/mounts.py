"""The archives open as folders, and the one a path lies in.

An archive is mounted by ``ckptool.read.archive.tar.mount`` (called when
``ckptool.read.layouts.recognise`` finds a ``.nemo``); from then on every
question ``ckptool.read.fs`` asks of the archive's path or a path below it
(``model.nemo/model_weights/.metadata``) is answered by the archive. This
module holds only the table: no tar reader, no file read.
"""

from __future__ import annotations

import os
from typing import Any

from ckptool.read.remote import urls

# the archive's path (``key``) -> its ``tar.Archive``
MOUNTED: dict[str, Any] = {}


def key(path: str) -> str:
    """A path as the table keys it: a URL without a trailing ``/``, a
    local path absolute and normalised."""
    return path.rstrip("/") if urls.is_url(path) else os.path.abspath(path)


def find(path: object) -> Any | None:
    """The mounted archive ``path`` is, or lies in; None for any other path."""
    if not MOUNTED or not isinstance(path, str):
        return None
    at = key(path)
    for root, archive in list(MOUNTED.items()):
        if at == root or at.startswith(root + "/"):
            if archive.stale():  # rewritten since indexed: indexed again when next met
                MOUNTED.pop(root, None)
                return None
            return archive
    return None


def mount(root: str, archive: Any) -> None:
    MOUNTED[key(root)] = archive


def unmount_all() -> None:
    """Forget every archive (a test's, or a long-lived process's between
    commands): the next read indexes it again."""
    MOUNTED.clear()
