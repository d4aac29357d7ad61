"""The checkpoint a command reads: a file, or ``-`` and pipes.

ckptool reads a checkpoint by seeking in it (a zip's directory is at its
end) and reads it twice when it rewrites it, so a stream is first copied
into a private temporary file, removed when the command ends. Messages
and reports name the input as the user gave it (``<stdin>`` for ``-``),
never the temporary copy. Character devices (``/dev/zero``), a terminal
and other things that are no files are refused by the reader with the
reason (``ckptool.read.formats``).

Permissions are left to the reader too: an unreadable file is a bad input
(exit 3) with the reason, not a usage error.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import IO, Any

import click

from ckptool.errors import InputError

# temporary copy -> the name the user gave (for messages and reports)
_SPOOLED: dict[str, str] = {}


def shown_path(path: str) -> str:
    """``path`` as the user gave it (``<stdin>`` for a copy of standard input)."""
    return _SPOOLED.get(path, path)


def unspool(text: str) -> str:
    """``text`` with every temporary copy's path replaced by the given name."""
    for temp, given in _SPOOLED.items():
        text = text.replace(temp, given)
    return text


def is_spooled(path: str) -> bool:
    return path in _SPOOLED


def _is_stream(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # missing or unreadable: the reader says which
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class InputPath(click.ParamType):
    """A checkpoint to read: a path, ``-`` (standard input) or a pipe, which
    are copied to a temporary file first. ``streams=False``: a command that
    cannot take one (``browse`` reads its keys from the terminal)."""

    name = "path"

    def __init__(self, streams: bool = True, why: str = "give a file") -> None:
        self.streams = streams
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        path = os.fspath(value)
        if "://" in path:
            return _hide_credentials(path)
        if path != "-" and not _is_stream(path):
            return path
        given = "standard input" if path == "-" else path
        if not self.streams:
            self.fail(f"cannot read a checkpoint from {given} here: {self.why}", param, ctx)
        if path == "-" and sys.stdin.isatty():
            raise InputError("standard input is a terminal, not a checkpoint",
                             "pipe one in: ckptool inspect - < model.pth")
        return _spool(path, ctx)


def _hide_credentials(url: str) -> str:
    """``url`` as ckptool shows it, without its credentials (the read layer
    makes its requests with them: ``urls.hide``); a scheme ckptool does not
    read is a usage error."""
    from ckptool.read.remote import urls

    unknown = urls.looks_like_url(url)
    if unknown is not None and not os.path.exists(url):
        from ckptool.errors import UsageError

        raise UsageError(f"{unknown}:// is not a scheme ckptool reads",
                         "give a local path, or a URL: " + ", ".join(
                             f"{s}://" for s in ("hf", "s3", "gs", "https", "http")))
    return urls.hide(url)


def local_output(path: str | None, option: str) -> None:
    """Refuse a URL as a path to write: outputs are local files."""
    if path is None or "://" not in path:
        return
    from ckptool.errors import UsageError
    from ckptool.read.remote import urls

    scheme = urls.scheme_of(path) or urls.looks_like_url(path)
    if scheme is not None:
        raise UsageError(f"{option} {urls.shown(path)}: ckptool writes local files, not "
                         f"{scheme}:// URLs",
                         "write it here, then upload it (hf upload, aws s3 cp, gcloud storage "
                         "cp); ckptool reads URLs as inputs")


def _spool(path: str, ctx: click.Context | None) -> str:
    import shutil
    import tempfile  # (here: only a stream is copied, no other run pays for them)

    folder = tempfile.mkdtemp(prefix="ckptool-input-")
    if ctx is not None:  # the outermost context closes however the command ends
        ctx.find_root().call_on_close(lambda: _forget(folder))
    temp = os.path.join(folder, "input")
    source: IO[bytes]
    with open(temp, "xb") as out:
        source = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
        try:
            shutil.copyfileobj(source, out, 1 << 20)
        finally:
            if source is not sys.stdin.buffer:
                source.close()
    _SPOOLED[temp] = "<stdin>" if path == "-" else path
    return temp


def _forget(folder: str) -> None:
    import shutil

    # the name stays in _SPOOLED: the error that ended the command is
    # reported after this, and names the input as given
    shutil.rmtree(folder, ignore_errors=True)
