"""Where a fix writes when no output is named: ``model.fixed.pth`` beside
the input (``x.pth.tar`` -> ``x.fixed.pth.tar``), or in the current
directory for an input behind a URL (never beside it: a URL is read, not
written); ``fresh_output`` the first such name that no file holds yet."""

from __future__ import annotations

import os
from pathlib import Path

from ckptool.read import fs
from ckptool.write.fix.targets import CHECKPOINT_SUFFIXES


def _name_and_suffixes(src: str) -> tuple[str, str]:
    """``dir/x.pth.tar`` -> (``dir/x``, ``.pth.tar``): every checkpoint suffix
    at the end, or the last suffix of a name that has none of them."""
    path = Path(src)
    name, suffixes = path.name, ""
    while True:
        base, ext = os.path.splitext(name)
        if not base or ext.lower() not in CHECKPOINT_SUFFIXES:
            break
        name, suffixes = base, ext + suffixes
    if not suffixes:
        name, suffixes = os.path.splitext(path.name)
    return str(path.with_name(name)), suffixes


def default_output(src: str) -> str:
    """``model.pth`` -> ``model.fixed.pth``, ``x.pth.tar`` -> ``x.fixed.pth.tar``,
    beside the input."""
    name, suffixes = _name_and_suffixes(_here(src))
    return f"{name}.fixed{suffixes}"


def _here(src: str) -> str:
    """Where outputs of ``src`` go by default: beside it; for a URL, in the
    current directory, under its last name."""
    if not fs.is_remote(src):
        return src
    from ckptool.read.remote import urls

    return urls.name(urls.shown(src))


def fresh_output(src: str) -> str:
    """``default_output``, or the first of ``x.fixed2.pth``, ``x.fixed3.pth``...
    that does not exist: a name no write would refuse to replace."""
    name, suffixes = _name_and_suffixes(_here(src))
    output, n = f"{name}.fixed{suffixes}", 2
    while os.path.lexists(output):
        output, n = f"{name}.fixed{n}{suffixes}", n + 1
    return output
