"""``ckptool diff`` by manifests: two checkpoints' values compared through
the tensor digests of their manifests (``ckptool verify --write-manifest``,
``convert``/``fix`` ``--manifest``), reading no tensor bytes.

A side's manifest is the file given (``--manifest-a``/``--manifest-b``), or
else ``<PATH>.manifest.json`` beside the checkpoint when it exists
(``default_manifest``). A digest is the sha256 of a tensor's logical bytes,
the same in every layout, so equal digests of two tensors of one dtype and
shape are equal values, and different digests differ (how many elements
and by how much is not known: ``num_different`` is ``None``).

A manifest is trusted only where it still describes its checkpoint, as far
as ``stat`` tells (``untrusted``): every file it lists is there with the
size it records and was not modified after the manifest was written, the
checkpoint has no file it does not list, and its tensors are the
checkpoint's (keys, dtypes, shapes). Else the values are read as without
manifests, and a note says why. ``diff`` does not re-hash the files: a byte
flipped in place since is found by ``ckptool verify PATH --manifest FILE``.
"""

from __future__ import annotations

import os
from typing import Any

from ckptool import dtypes
from ckptool.check.tensor_compare import DIFFERENT, EQUAL, ValueDiff
from ckptool.check.verify.filehash import files_of, root_of, same_file
from ckptool.check.verify.manifest import dtype_name, read_manifest
from ckptool.errors import UsageError
from ckptool.model import Checkpoint, TensorInfo

SUFFIX = ".manifest.json"

Found = tuple[str, dict[str, Any]]  # a manifest's path and its content


def default_manifest(path: str) -> str:
    """``<PATH>.manifest.json``: where a side's manifest is looked for."""
    return path.rstrip("/" + os.sep) + SUFFIX


def find_manifest(path: str, given: str | None, label: str, notes: list[str],
                  look_beside: bool = True) -> Found | None:
    """The manifest of the checkpoint at ``path``: ``given`` (a bad one is a
    ``UsageError``), else the default one beside it when ``look_beside``
    (a bad one is left aside with a note)."""
    if given is not None:
        return given, read_manifest(given)
    beside = default_manifest(path)
    if not look_beside or not os.path.isfile(beside):
        return None
    try:
        return beside, read_manifest(beside)
    except UsageError as exc:
        notes.append(f"{label}: {beside} not used: {exc.message}")
        return None


def untrusted(ckpt: Checkpoint, found: Found) -> str | None:
    """Why ``found`` no longer describes ``ckpt`` (None: it does, as far as
    ``stat`` tells)."""
    where, manifest = found
    root = root_of(ckpt)
    try:
        made = os.stat(where)
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    # a time set back (touch -r, cp -p, rsync -a) hides a change from the
    # modification time, never from the change time, which no one can set
    written, noted = made.st_mtime, made.st_ctime
    recorded: dict[str, dict[str, Any]] = manifest["files"]
    for name, entry in sorted(recorded.items()):
        try:
            st = os.stat(os.path.join(root, name))
        except OSError:
            return f"{name} is missing"
        if st.st_size != entry["size"]:
            return f"{name} is {st.st_size} bytes, the manifest says {entry['size']}"
        if st.st_mtime > written or st.st_ctime > noted:
            return f"{name} was modified after the manifest was written"
    extra = [n for n in files_of(ckpt) if n not in recorded
             and not same_file(os.path.join(root, n), where)]
    if extra:
        return f"{extra[0]} is not in it"
    tensors: dict[str, dict[str, Any]] = manifest["tensors"]
    if set(tensors) != {t.key for t in ckpt.tensors}:
        return "its tensors are not the checkpoint's"
    for t in ckpt.tensors:
        entry = tensors[t.key]
        if entry["dtype"] != dtype_name(t.dtype) or entry["shape"] != list(t.shape):
            return f"{t.key} is {dtype_name(t.dtype)} {list(t.shape)} in the checkpoint"
    return None


def trusted_digests(a: Checkpoint, b: Checkpoint, found: tuple[Found | None, Found | None],
                    notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Both sides' tensor entries, where both have a manifest that can be
    trusted; else None, with a note where a manifest was left aside."""
    fa, fb = found
    if fa is None and fb is None:
        return None
    if fa is None or fb is None:
        have, lack, one = ("A", "B", fa) if fa is not None else ("B", "A", fb)
        assert one is not None
        notes.append(f"only {have} has one ({one[0]}); {lack} has none: values read")
        return None
    for label, ckpt, side in (("A", a, fa), ("B", b, fb)):
        why = untrusted(ckpt, side)
        if why is not None:
            notes.append(f"{label}'s {side[0]} not trusted ({why}): values read")
            return None
    return fa[1]["tensors"], fb[1]["tensors"]


def by_digest(ta: TensorInfo, tb: TensorInfo, ea: dict[str, Any] | None,
              eb: dict[str, Any] | None) -> ValueDiff | None:
    """``ta`` and ``tb`` compared by their manifest entries; None where the
    digests cannot tell (no digest; dtypes differ: equal values of two dtypes
    have different bytes)."""
    if ea is None or eb is None or ea.get("digest") is None or eb.get("digest") is None:
        return None
    if ta.dtype != tb.dtype or ta.shape != tb.shape or ta.parts or tb.parts:
        return None
    numel = ta.numel
    if ea["digest"] == eb["digest"]:
        return ValueDiff(EQUAL, numel, 0, 0.0 if dtypes.is_floating(ta.dtype) else None,
                         by_digest=True)
    return ValueDiff(DIFFERENT, numel, None, None, 0, by_digest=True)
