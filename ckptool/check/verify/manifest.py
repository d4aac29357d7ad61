"""Manifests: the size and sha256 of every file of a checkpoint, and the
digest of every tensor's logical bytes, written once and checked later.

``write_manifest(ckpt, dest, jobs)`` writes (atomically) and returns::

    {"ckptool_manifest": 1, "tool": "ckptool 0.1.0", "created": "<UTC ISO time>",
     "layout": "<format>", "path": "<the checkpoint's path>",
     "files": {"<path relative to the root>": {"size": N, "sha256": "<hex>"}},
     "tensors": {"<key>": {"dtype": "float32", "shape": [..], "digest": "sha256:<hex>"}}}

A tensor whose values ckptool cannot read (sparse, quantized, a meta
tensor) has ``"digest": null`` and ``"unread": "<why>"``: its bytes are
still covered by its file's sha256.

The files are those ``filehash.files_of`` names (the layout's, the others
in its folders, a framework's files beside the model), relative to
``root_of``: the directory given, or the one file's folder. They are hashed
on ``jobs`` threads while the calling thread digests the tensors, one at a
time: where a tensor's bytes lie in its file as they are, straight from the
file through one buffer (``digest.digest_ranges``), else its values as
ckptool reads them. Both release the GIL: on two cores, about one pass.

``check_manifest(ckpt, manifest_path, jobs)`` lists every file whose size or
sha256 differs, files missing or added, tensors missing or added, and every
tensor whose dtype, shape or digest differs. A tensor's digest is computed
only where the bytes it is read from changed (a file that holds it, or one
that says where it lies: an index, a ``.metadata``, the one file), unless
``every_tensor``: a file whose sha256 matches holds the same tensors.
``check_files`` checks the files alone (a checkpoint that does not open);
the files' part of a check is ``manifestfiles``'.
A manifest that is not one, or is malformed, is a one-line ``UsageError``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

from ckptool.check.verify.digest import digest_ranges, is_digest, tensor_digest
from ckptool.check.verify.filehash import (
    Hashing,
    Known,
    files_of,
    holders,
    layout_paths,
    name_in,
    own_paths,
    root_of,
    same_file,
)
from ckptool.check.verify.manifestfiles import checkpoint_files, file_problems
from ckptool.check.verify.manifestnames import pair_names
from ckptool.check.verify.problems import Problem
from ckptool.errors import CkptoolError, InputError, UnsupportedCheckpointError, UsageError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import fs
from ckptool.read.tensor_source import TensorValues
from ckptool.write.commit import AtomicOutput
from ckptool.write.layout import Span
from ckptool.write.sources import TensorSource

__all__ = ["build_manifest", "check_files", "check_manifest", "document", "files_of",
           "read_manifest", "root_of", "save_manifest", "tensor_entries", "write_manifest"]

VERSION = 1
_HEX = frozenset("0123456789abcdef")
_REWRITE = "write it again: ckptool verify PATH --write-manifest FILE"


def dtype_name(dtype: object) -> str:
    """A dtype as the manifest writes it (``float32``), also from a torch dtype."""
    return str(dtype).removeprefix("torch.")


def _share_key(ckpt: Checkpoint, t: TensorInfo) -> tuple[Any, ...] | None:
    """What makes two tensors one tensor's values (views of the same bytes)."""
    if t.storage is None or t.chunks or t.parts or t.stride is None:
        return None
    storage = ckpt.storages.get(t.storage)
    return (storage.file if storage else t.file, t.storage, t.storage_offset, t.shape,
            t.stride, dtype_name(t.dtype))


def _spans(source: TensorSource, t: TensorInfo) -> list[Span] | None:
    """``t``'s bytes as ranges of its files, where they lie there as they are
    (dense, little-endian, its dtype); else None: its values are read.
    A bool's values are (bytes other than 0 and 1 read as True)."""
    if dtype_name(t.dtype) == "bool" or not t.numel:
        return None
    try:
        segments = source.segments(t, t.dtype, 0, t.key)
    except UnsupportedCheckpointError:
        return None
    spans = sorted((s for s in segments if isinstance(s, Span)), key=lambda s: s.at)
    if len(spans) != len(segments) or sum(s.size for s in spans) != t.nbytes:
        return None
    return spans


def _digest(source: TensorSource, values: TensorValues, t: TensorInfo,
            known: Known | None = None) -> str:
    spans = _spans(source, t)
    if spans is not None and known is not None and len(spans) == 1 and not t.chunks:
        digest = known.tensor(source.reader(t).ckpt.path, spans[0].src, spans[0].size)
        if digest is not None:
            return digest
    if spans is not None:
        return digest_ranges(((s.fd, s.src, s.size) for s in spans), t.key)
    return tensor_digest(values.values(t))


def tensor_entries(ckpt: Checkpoint, keys: set[str] | None = None,
                   strict: bool = True, known: Known | None = None) -> dict[str, dict[str, Any]]:
    """The manifest entry of each tensor (of ``keys``, or all), one at a
    time. A tensor ckptool cannot read the values of (sparse, quantized...)
    gets no digest and says why; with ``strict`` a damaged one raises its
    error, else it is recorded as unread too."""
    out: dict[str, dict[str, Any]] = {}
    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    with TensorSource(ckpt) as source, TensorValues(ckpt) as values:
        for t in ckpt.tensors:
            if keys is not None and t.key not in keys:
                continue
            entry: dict[str, Any] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            share = _share_key(ckpt, t)
            if share is not None and share in done:
                entry |= {k: v for k, v in done[share].items() if k in ("digest", "unread")}
                out[t.key] = entry
                continue
            try:
                entry["digest"] = _digest(source, values, t, known)
            except UnsupportedCheckpointError as exc:
                entry |= {"digest": None, "unread": exc.message}
            except CkptoolError as exc:
                if strict:
                    raise
                entry |= {"digest": None, "unread": exc.message}
            out[t.key] = entry
            if share is not None:
                done[share] = entry
    return out


# -- writing --------------------------------------------------------------

def build_manifest(ckpt: Checkpoint, jobs: int, exclude: str | None = None,
                   known: Known | None = None) -> dict[str, Any]:
    """``ckpt``'s manifest (files hashed on ``jobs`` threads while this one
    digests the tensors); ``exclude``: a path that is not the checkpoint's
    (the manifest itself); ``known``: hashes taken already (not read again)."""
    root = root_of(ckpt)
    paths = {n: fs.join(root, n) for n in files_of(ckpt)}
    if exclude is not None:
        paths = {n: p for n, p in paths.items() if not same_file(p, exclude)}
    taken = {n: known.file(p) for n, p in paths.items()} if known is not None else {}
    files: dict[str, dict[str, Any]] = {}
    with Hashing({n: p for n, p in paths.items() if taken.get(n) is None}, jobs) as hashing:
        tensors = tensor_entries(ckpt, known=known)
        for name in sorted(paths):
            try:
                size, sha = taken.get(name) or hashing.result(name)
            except OSError as exc:
                raise InputError(f"{paths[name]}: cannot read it ({exc.strerror or exc})",
                                 "check the file's permissions and that it is still there"
                                 ) from exc
            files[name] = {"size": size, "sha256": sha}
    return document(ckpt.format, ckpt.path, files, tensors)


def tool_name() -> str:
    """``ckptool <version>``, from the installed distribution (``ckptool.__version__``
    is the public API's, which this layer does not import)."""
    try:
        return f"ckptool {metadata.version('ckptool')}"
    except metadata.PackageNotFoundError:
        return "ckptool (version unknown)"


def document(layout: str, path: str, files: dict[str, dict[str, Any]],
             tensors: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A manifest of ``files`` and ``tensors`` (entries as ``build_manifest``'s)."""
    return {"ckptool_manifest": VERSION, "tool": tool_name(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "layout": layout, "path": path, "files": files, "tensors": tensors}


def save_manifest(manifest: dict[str, Any], dest: str) -> None:
    """Write ``manifest`` to ``dest`` atomically (a file there is replaced)."""
    data = json.dumps(manifest, indent=1).encode() + b"\n"
    with AtomicOutput(dest, force=True) as out:
        out.file.write(data)
        out.commit()


def write_manifest(ckpt: Checkpoint, dest: str, jobs: int,
                   known: Known | None = None) -> dict[str, Any]:
    """Write ``ckpt``'s manifest to ``dest`` (atomically) and return it."""
    for path in own_paths(ckpt):
        if same_file(path, dest):
            raise UsageError(f"{dest} is a file of the checkpoint: the manifest would replace it",
                             "write the manifest to another path")
    manifest = build_manifest(ckpt, jobs, exclude=dest, known=known)
    save_manifest(manifest, dest)
    return manifest


# -- reading and checking -------------------------------------------------

def _malformed(path: str, what: str) -> UsageError:
    return UsageError(f"{path} is not a valid ckptool manifest: {what}", _REWRITE)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _safe_name(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and \
        all(p not in ("", ".", "..") for p in parts)


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest at ``path``, checked to be one this ckptool reads."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read the manifest {path}: {exc.strerror or exc}",
                         "check the path given to --manifest") from exc
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not a ckptool manifest: it is not JSON",
                         "give a file written by ckptool verify --write-manifest") from exc
    if not isinstance(data, dict) or "ckptool_manifest" not in data:
        raise UsageError(f"{path} is not a ckptool manifest: it has no ckptool_manifest field",
                         "give a file written by ckptool verify --write-manifest")
    version = data["ckptool_manifest"]
    if version != VERSION:
        if _is_size(version) and version > VERSION:
            raise UsageError(f"{path} is a manifest of version {version}, newer than this "
                             f"ckptool reads ({VERSION})", "upgrade ckptool")
        raise _malformed(path, f"unknown version {version!r}")
    files, tensors = data.get("files"), data.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise _malformed(path, "files and tensors must be objects")
    for name, entry in files.items():
        if not _safe_name(name):
            raise _malformed(path, f"file name {name!r} is not a relative path inside the "
                             "checkpoint")
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not _is_size(entry.get("size")) or not (
                isinstance(sha, str) and len(sha) == 64 and set(sha) <= _HEX):
            raise _malformed(path, f"file {name!r} needs a size and a sha256")
    for key, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or not (
                isinstance(shape, list) and all(map(_is_size, shape))) or not (
                entry.get("digest") is None or is_digest(entry.get("digest"))):
            raise _malformed(path, f"tensor {key!r} needs a dtype, a shape and a digest")
    return data


def _short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def _to_digest(ckpt: Checkpoint, root: str, changed: set[str]) -> set[str]:
    """The tensors whose values may have changed with the files ``changed``."""
    held = holders(ckpt, root)
    data = set().union(*held.values()) if held else set()
    layout = {name_in(p, root) for p in layout_paths(ckpt)}
    if (changed & layout) - data:  # an index, a .metadata: any tensor may have moved
        return set(held)
    return {k for k, files in held.items() if not files or files & changed}


def _file_of(files: set[str], changed: set[str]) -> str | None:
    """The one file to name for a tensor held by ``files``."""
    hit = files & changed
    one = hit if len(hit) == 1 else files
    return next(iter(one)) if len(one) == 1 else None


def _tensor_problems(ckpt: Checkpoint, recorded: dict[str, dict[str, Any]],
                     problems: list[Problem]) -> set[str]:
    """Tensors missing, added, or of another dtype or shape (as problems);
    the keys of the others that have a digest to compare."""
    current = {t.key: t for t in ckpt.tensors}
    same: set[str] = set()
    for key, entry in recorded.items():
        t = current.get(key)
        if t is None:
            problems.append(Problem("manifest-missing", "missing: the manifest lists it",
                                    tensor=key))
        elif dtype_name(t.dtype) != entry["dtype"] or list(t.shape) != entry["shape"]:
            problems.append(Problem("manifest-tensor", f"{dtype_name(t.dtype)} "
                                    f"{list(t.shape)}, the manifest says {entry['dtype']} "
                                    f"{entry['shape']}", tensor=key))
        elif entry["digest"] is not None:
            same.add(key)
    problems += [Problem("manifest-extra", "not in the manifest", tensor=k)
                 for k in current if k not in recorded]
    return same


def check_files(root: str, manifest_path: str, jobs: int,
                present: list[str] | None = None) -> list[Problem]:
    """The files the manifest at ``manifest_path`` lists, under ``root``,
    each missing, of another size or of another sha256 (hashed on ``jobs``
    threads), and those of ``present`` it does not list: what can be said
    of a checkpoint that does not even open."""
    return file_problems(read_manifest(manifest_path)["files"], root, manifest_path, jobs,
                         present)


def check_manifest(ckpt: Checkpoint, manifest_path: str, jobs: int,
                   every_tensor: bool = False, notes: list[str] | None = None) -> list[Problem]:
    """Every difference between ``ckpt`` and the manifest at ``manifest_path``:
    files first, then tensors. A tensor's values are digested where a file
    they depend on changed (a file whose sha256 matches holds the same
    values), or all of them (``every_tensor``). A manifest of another
    layout has its tensor names paired with ``ckpt``'s as ``diff`` pairs
    them (``manifestnames``; said in ``notes``)."""
    manifest = read_manifest(manifest_path)
    recorded: dict[str, dict[str, Any]] = manifest["tensors"]
    paired = pair_names((t.key for t in ckpt.tensors), recorded) \
        if manifest["layout"] != ckpt.format else {}
    if paired:  # the manifest's entries under this checkpoint's names
        here = {then: now for now, then in paired.items()}
        recorded = {here.get(k, k): entry for k, entry in recorded.items()}
        now, then = next(iter(paired.items()))
        more = f" (and {len(paired) - 1} more)" if len(paired) > 1 else ""
        if notes is not None:
            notes.append(f"the manifest's tensor names paired with this checkpoint's, as diff "
                         f"pairs them: {then} as {now}{more}")
    root = root_of(ckpt)
    problems = checkpoint_files(manifest, ckpt.format, root, manifest_path, jobs,
                                files_of(ckpt))
    changed = {p.file for p in problems if p.file is not None}
    tensor_problems: list[Problem] = []
    same = _tensor_problems(ckpt, recorded, tensor_problems)
    every_tensor = every_tensor or manifest["layout"] != ckpt.format  # its files say nothing
    wanted = same if every_tensor else same & _to_digest(ckpt, root, changed)
    for key, entry in (tensor_entries(ckpt, wanted, strict=False) if wanted else {}).items():
        then = recorded[key]["digest"]
        if entry["digest"] is None:
            message = f"cannot read its values: {entry['unread']}"
        elif entry["digest"] != then:
            message = (f"values differ from the manifest (digest {_short(entry['digest'])}…, "
                       f"the manifest says {_short(then)}…)")
        else:
            continue
        tensor_problems.append(Problem("manifest-tensor", message, tensor=key))
    held = holders(ckpt, root)
    return problems + [replace(p, file=_file_of(held.get(p.tensor or "", set()), changed),
                               message=p.message + (f"; the manifest names it {paired[p.tensor]}"
                                                    if p.tensor in paired else ""))
                       for p in tensor_problems]
