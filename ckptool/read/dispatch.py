"""Recognise a checkpoint by its bytes and hand it to the right reader.

Formats are sniffed from the first bytes of the file, never from its name.
Each reader module of ``ckptool.read.formats`` offers ``sniff`` and
``read(path) -> RawRead``. Files that are not checkpoints get an error
saying what they look like instead.

A directory (or an index file) is recognised by ``ckptool.read.layouts.recognise``:
one holding a single checkpoint file reads as that file here; a checkpoint of
many files is ``ckptool.read.reader``'s to assemble, and ``read`` refuses it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator

from ckptool.errors import (
    CkptoolError,
    CorruptCheckpointError,
    InputError,
    NotACheckpointError,
    UnsupportedCheckpointError,
)
from ckptool.read import fs
from ckptool.read.formats import pickle_fmt, safetensors_fmt, torch_legacy, torch_zip
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts import recognise

__all__ = ["RawRead", "check", "explained", "one_file", "read"]

# magic bytes of files people mistake for checkpoints
_LOOKALIKES = (
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5?)", "load it with h5py or Keras"),
    (b"GGUF", "a GGUF file (llama.cpp)", "use the gguf tools to inspect it"),
    (b"\x93NUMPY", "a numpy .npy array", "load it with numpy.load"),
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it first (gunzip)"),
    (b"BZh", "a bzip2-compressed file", "decompress it first (bunzip2)"),
    (b"\xfd7zXZ", "an xz-compressed file", "decompress it first (unxz)"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first (unzstd)"),
    (b"version https://git-lfs", "a Git LFS pointer, not the file itself",
     "run `git lfs pull` to fetch the real file"),
    (b"<", "an HTML or XML page (a failed download?)",
     "download the file again; check the URL points at the raw file"),
)


# a hint for errors raised without one, most specific class first
_HINTS = (
    (CorruptCheckpointError, "the file is truncated, damaged, or not what its name says; "
     "if it was downloaded or copied, fetch it again"),
    (UnsupportedCheckpointError, "load it with the tool that wrote it and save it again "
     "with torch.save"),
    (NotACheckpointError, "ckptool reads torch.save files (zip and legacy), TorchScript "
     "archives, safetensors and pickles"),
    (CkptoolError, "check the path and the file"),
)


def read(path: str) -> RawRead:
    """Read the checkpoint at ``path`` with the reader its bytes call for."""
    with _explained(path):
        path = one_file(path)
        return _reader_for(path)(path)


def read_zip(path: str, archive: torch_zip.Archive) -> RawRead:
    """``read`` of a torch zip whose directory is already open (``fix`` opens
    it first to start copying): the pickle from that same file."""
    with _explained(path):
        return torch_zip.read_archive(archive)


def check(path: str) -> None:
    """Raise what ``read`` would for a file that is missing, empty or not a
    checkpoint at all, reading only its first and last bytes."""
    with _explained(path):
        layout = recognise.recognise(path)
        if layout is None or layout.file is not None:
            _reader_for(layout.file if layout and layout.file else path)


def one_file(path: str) -> str:
    """``path``, or the one checkpoint file of a directory that holds one;
    a checkpoint of many files is refused with what it is (the readers of
    one file cannot take it; ``ckptool.read.reader`` reads it whole)."""
    layout = recognise.recognise(path)
    if layout is None:
        return path
    if layout.file is not None:
        return layout.file
    raise UnsupportedCheckpointError(
        f"{path} is {recognise.describe(layout)}, not one file",
        "read it whole with ckptool.open (every ckptool command takes it), or name "
        "one of its files")


@contextlib.contextmanager
def _explained(path: str) -> Iterator[None]:
    try:
        yield
    except CkptoolError as exc:
        if not exc.hint:
            exc.hint = next(hint for cls, hint in _HINTS if isinstance(exc, cls))
        if path not in exc.message:  # say which file: diff and convert read two
            exc.message = f"{path}: {exc.message}"
            exc.args = (exc.message,)
        raise


explained = _explained  # for the readers of many files (ckptool.read.reader)


def _reader_for(path: str) -> Callable[[str], RawRead]:
    head, size = _peek(path)
    if size == 0:
        raise NotACheckpointError(f"{path} is empty (0 bytes)",
                                  "the download or copy probably failed; fetch it again")
    if torch_zip.sniff(head):
        return torch_zip.read
    if torch_legacy.sniff(head):
        return torch_legacy.read
    if safetensors_fmt.sniff(head):
        return safetensors_fmt.read
    if torch_legacy.sniff_tar(head):
        _explain_tar(path)
    # other formats' magic first: a headerless (protocol 0/1) pickle may open
    # with almost any byte, and what follows some magic numbers parses as one
    for magic, what, hint in _LOOKALIKES:
        if head.lstrip().startswith(magic):
            raise NotACheckpointError(f"{path} is {what}, not a PyTorch checkpoint", hint)
    # a pickle before the formats known by their first bytes' shape alone:
    # a pickle may open like a msgpack map (SHORT_BINUNICODE is 0x8c), and
    # what torch.load would unpickle is read as the pickle it is
    if pickle_fmt.sniff(head, _tail(path, size)):
        return pickle_fmt.read
    other = _other_format(head)
    if other is not None:
        raise NotACheckpointError(f"{path} is {other[0]}, not a PyTorch checkpoint", other[1])
    raise NotACheckpointError(
        f"{path} is not a checkpoint: no known format starts with {head[:8]!r}",
        "ckptool reads torch.save files (zip and legacy), TorchScript archives, "
        "safetensors and pickles",
    )


# protobuf field tags a serialized ONNX ModelProto has after its ir_version
# (field 1, varint): producer_name, producer_version, domain, model_version,
# doc_string, graph, opset_import, metadata_props
_ONNX_NEXT = frozenset(b"\x12\x1a\x22\x28\x32\x3a\x42\x72")


def _other_format(head: bytes) -> tuple[str, str] | None:
    """Formats without a magic number that people take for checkpoints,
    recognised by their first bytes' structure: ONNX (a protobuf whose first
    field is ir_version), Flax's msgpack (a map whose first key is a short
    string such as "params"). None for anything else."""
    if len(head) >= 3 and head[0] == 0x08 and 1 <= head[1] <= 20 and head[2] in _ONNX_NEXT:
        return ("an ONNX model (protobuf)",
                "inspect it with onnx (onnx.load) or netron; onnx2torch converts some models")
    if len(head) >= 3 and (0x81 <= head[0] <= 0x8f or head[0] in (0xde, 0xdf)):
        at = 1 if head[0] < 0xde else (3 if head[0] == 0xde else 5)
        if len(head) > at + 1 and 0xa1 <= head[at] <= 0xbf:
            key = head[at + 1: at + 1 + (head[at] - 0xa0)]
            if key.isascii() and key.replace(b"_", b"").isalnum():
                return (f"a msgpack file (Flax serialization? its first key is "
                        f"{key.decode()!r})",
                        "load it with flax.serialization.msgpack_restore; transformers' "
                        "from_pretrained(..., from_flax=True) converts Flax models")
    return None


def _tail(path: str, size: int) -> bytes:
    """The last 16 bytes (read only for a file no format's magic claims: a
    remote file's tail is a request of its own)."""
    try:
        with fs.open_binary(path) as f:
            f.seek(max(0, size - 16))
            return f.read(16)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})", "check the path") from exc


def _peek(path: str) -> tuple[bytes, int]:
    if fs.isdir(path):  # read and check recognise directories first
        raise InputError(f"{path} is a directory, not a file",
                         "point ckptool at a checkpoint file inside it")
    _check_regular(path)
    try:
        with fs.open_binary(path) as f:
            size = fs.size_of(f)
            head = f.read(512)
    except FileNotFoundError as exc:
        if fs.is_remote(path):
            from ckptool.read.remote import stores

            raise stores.not_found(path) from None
        raise InputError(f"{path}: no such file", "check the path and try again") from exc
    except PermissionError as exc:
        raise InputError(f"{path}: permission denied",
                         "check the file's permissions") from exc
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})", "check the path") from exc
    return head, size


def _check_regular(path: str) -> None:
    """A checkpoint is a file: refuse a device or a pipe with the reason
    rather than reading it as an empty or endless one."""
    if fs.is_remote(path):
        return  # a remote file is a file (a URL names no device)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: open() says which
    if stat.S_ISREG(mode):
        return
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            if os.isatty(f.fileno()):
                raise InputError(f"{path} is a terminal, not a checkpoint file",
                                 "pipe a checkpoint in, or give its path")
        kind = "character" if stat.S_ISCHR(mode) else "block"
        raise InputError(f"{path} is a {kind} device, not a checkpoint file",
                         "give the path of a checkpoint file")
    raise InputError(f"{path} is a pipe or socket, not a file ckptool can seek in",
                     "save it to a file first, or pass it to the command line as `-`")


def _explain_tar(path: str) -> None:
    import tarfile  # rare; kept off the import path of every command

    try:
        with fs.open_binary(path) as f, tarfile.open(fileobj=f) as tf:
            names = set(tf.getnames())
    except (tarfile.TarError, OSError) as exc:
        raise NotACheckpointError(f"{path} is a damaged tar archive: {exc}") from exc
    if {"storages", "tensors", "pickle"} <= names:
        raise UnsupportedCheckpointError(
            f"{path} is a tar-format torch checkpoint (torch < 0.4), not supported",
            "re-save it with an old torch: torch.save(torch.load(path), new_path)",
        )
    raise NotACheckpointError(f"{path} is a tar archive, not a PyTorch checkpoint",
                              "extract it and point ckptool at the checkpoint inside")
