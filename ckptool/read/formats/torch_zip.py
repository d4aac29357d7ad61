"""torch.save's zip format (torch >= 1.6) and TorchScript archives.

Only the central directory and the pickle records (``data.pkl``,
``constants.pkl``) are read; storage records are checked for presence and
size from the central directory and never opened. The archive's root folder
is taken from its first entry: torch names it after the file's stem.
"""

from __future__ import annotations

import contextlib
import io
import operator
from typing import IO, Any, Protocol

from ckptool.dtypes import ITEMSIZE
from ckptool.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedCheckpointError,
)
from ckptool.read import fs, pickles
from ckptool.read.formats import pt2
from ckptool.read.formats.base import RawRead, parse_storage_pid
from ckptool.read.formats.torch_legacy import read_bytes
from ckptool.read.pickle import policy
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef
from ckptool.read.ziparchive import ChecksumMismatch, Member, ZipArchive, ZipError

TORCH_ZIP = "torch-zip"
TORCHSCRIPT = "torchscript"
SCRIPT_CLASS = ("a TorchScript class of this archive: torch.jit.load compiles it from the "
                "archive's code/ records, whose __setstate__ calls ckptool judges")
TRUNCATED_HINT = ("the file was probably cut short while copying or downloading; "
                  "compare its size with the original")
# torch stores records uncompressed; a compressed pickle record is read whole,
# so its claimed size is what reading it would cost
MAX_INFLATED = 1 << 30


def sniff(head: bytes) -> bool:
    return head[:4] in (b"PK\x03\x04", b"PK\x05\x06")


def root_of(names: list[str]) -> str:
    """The archive's root folder: its first entry's, as torch takes it."""
    first = names[0]
    return first.split("/", 1)[0] if "/" in first else ""


def open_archive(f: IO[bytes]) -> ZipArchive:
    """The archive's directory, or a CorruptCheckpointError saying why not."""
    try:
        return ZipArchive(f, fs.size_of(f))
    except ZipError as exc:
        raise CorruptCheckpointError(f"zip archive is truncated or corrupt ({exc})",
                                     TRUNCATED_HINT) from exc


class Archive(Protocol):
    """What ``read_archive`` needs: a ``ZipArchive``, or a stand-in for one
    (``fix`` reads its output back before the directory is written)."""

    members: dict[str, Member]

    def read(self, name: str, max_size: int) -> bytes: ...


def read(path: str) -> RawRead:
    with fs.open_binary(path) as f:
        return read_archive(open_archive(f))


def read_archive(zf: Archive) -> RawRead:
    """The pickles of an open archive; storage records are checked for
    presence and size from its directory and never opened."""
    infos = zf.members
    names = list(infos)
    if not names:
        raise NotACheckpointError("empty zip archive, not a checkpoint",
                                  "the file holds no records; fetch it again")
    repeated: list[str] = getattr(zf, "duplicates", [])
    if repeated:
        raise UnsupportedCheckpointError(
            f"the archive holds more than one record named {repeated[0]}: which one "
            "torch loads is not what ckptool would read", _HIDING_HINT)
    if len(set(map(str.lower, names))) != len(names):  # (in C: 100,000 records)
        _refuse_case_twins(names)
    root = root_of(names)
    prefix = f"{root}/" if root else ""
    if f"{prefix}data.pkl" not in infos:
        if pt2.is_pt2(infos, prefix):
            return pt2.read_archive(zf, prefix, _read_record, read_archive)
        _explain_other_zip(names)
    # (the names tested in C: an optimizer state has 100,000 records)
    is_script = f"{prefix}constants.pkl" in infos or any(
        map(operator.methodcaller("startswith", f"{prefix}code/"), names))
    seen = GlobalsSeen()
    storages: dict[str, StorageRef] = {}

    def loader(folder: str, id_prefix: str) -> pickles.PersistentLoader:
        where = f"{prefix}{folder}/"

        def persistent(pid: tuple[Any, ...]) -> StorageRef:  # hot: once per tensor
            stype, key, location, numel = parse_storage_pid(pid, 5)
            sid = id_prefix + key
            ref = storages.get(sid)
            if ref is None:
                record = where + key
                info = infos.get(record)
                if info is None:
                    raise CorruptCheckpointError(f"storage record {record} is missing",
                                                 TRUNCATED_HINT)
                ref = StorageRef(sid, stype.dtype, location, numel, record, pid)
                if info.size < numel * ITEMSIZE.get(stype.dtype, 1):  # ref.nbytes, uncalled
                    raise CorruptCheckpointError(
                        f"storage record {record} holds {info.size} bytes, "
                        f"{ref.nbytes} expected", TRUNCATED_HINT)
                storages[sid] = ref
            return ref
        return persistent

    warnings: list[str] = []

    def load(name: str, folder: str, id_prefix: str) -> Any:
        data = io.BytesIO(_read_record(zf, f"{prefix}{name}"))
        seen.part = name
        obj = pickles.load(data, loader(folder, id_prefix), seen, read_embedded=read_bytes)
        rest = pickles.scan_rest(data, len(data.getbuffer()), seen, name, read_bytes)
        warnings.extend([rest] if rest else [])
        return obj

    extra: dict[str, Any] = {}
    with seen.naming_unsafe():
        obj = load("data.pkl", "data", "")
        if is_script and f"{prefix}constants.pkl" in infos:
            consts = load("constants.pkl", "constants", "constants/")
            if consts:
                extra["constants"] = consts
        for other in sorted(n for n in names if n.lower().endswith(".pkl")
                            and n not in (f"{prefix}data.pkl", f"{prefix}constants.pkl")):
            # a pickle torch does not load today: read all the same (its
            # objects dropped), for what it names
            seen.part = other
            _scan_pickle(_read_record(zf, other), seen, other)
            warnings.append(f"{other}: a pickle record torch.load does not read; "
                            "read for the globals it names")
    if is_script:
        _judge_code(zf, prefix, names, seen)
    named = {ref.record for ref in storages.values()}
    unnamed = sorted(n for n in infos.keys() - named  # (the set difference in C)
                     if n.startswith(f"{prefix}data/") and not n.endswith("/"))
    if unnamed:  # bytes no object of the file reaches: torch never loads them
        warnings.append(f"{len(unnamed)} storage record(s) no object of the pickle names "
                        f"({', '.join(unnamed[:3])}{', …' if len(unnamed) > 3 else ''}): "
                        "torch.load never reads them")
    meta: dict[str, Any] = {"archive_root": root}
    for name in ("version", ".format_version", "byteorder", ".storage_alignment"):
        if f"{prefix}{name}" in infos and infos[f"{prefix}{name}"].size < 64:
            meta[name.lstrip(".")] = _read_record(zf, f"{prefix}{name}").decode(
                "ascii", "replace").strip()
    fmt = TORCHSCRIPT if is_script else TORCH_ZIP
    return RawRead(fmt, obj, storages, seen, meta, extra, warnings)


def _refuse_case_twins(names: list[str]) -> None:
    """torch's reader finds a record ignoring case (miniz), so of two records
    whose names differ only in case it may load either: not the one a
    case-sensitive reader reads (a clean ``data.pkl`` beside a ``DATA.pkl``)."""
    first: dict[str, str] = {}
    for name in names:
        seen = first.setdefault(name.lower(), name)
        if seen != name:
            raise UnsupportedCheckpointError(
                f"the archive holds records whose names differ only in case ({seen}, "
                f"{name}): torch finds records ignoring case, so which one it loads is not "
                "what ckptool would read", _HIDING_HINT)


_HIDING_HINT = ("do not load this file with torch: it looks made to hide what it runs; "
                "torch.save never writes such names")


def _read_record(zf: Archive, name: str) -> bytes:
    info: Member = zf.members[name]
    if info.method != 0 and info.size > MAX_INFLATED:
        raise CorruptCheckpointError(
            f"{name} is compressed and claims {info.size} bytes unpacked",
            "torch.save never compresses records; this archive was rewritten, "
            "maybe to exhaust memory")
    try:
        # a stored record's size is bounded by the file; a deflated one by MAX_INFLATED
        return zf.read(name, max(MAX_INFLATED, info.compressed_size))
    except ChecksumMismatch as exc:
        unsafe = _unsafe_in(exc.data) if name.lower().endswith(".pkl") else []
        runs = (f"; torch.load does not check it and would run {', '.join(unsafe)}"
                if unsafe else "")
        raise CorruptCheckpointError(
            f"cannot read {name} from the archive: {exc}{runs}",
            "do not load this file with torch: it looks made to run code when loaded"
            if unsafe else TRUNCATED_HINT) from exc
    except (ZipError, OSError) as exc:
        raise CorruptCheckpointError(f"cannot read {name} from the archive: {exc}",
                                     TRUNCATED_HINT) from exc


def _unsafe_in(data: bytes) -> list[str]:
    """The unsafe globals a pickle record names, read as far as it reads (a
    record refused for its checksum is still what torch would unpickle)."""
    seen = GlobalsSeen()
    with contextlib.suppress(CorruptCheckpointError):  # what it named before it broke counts
        _scan_pickle(data, seen, "the record")
    return seen.unsafe()


def _scan_pickle(data: bytes, seen: GlobalsSeen, part: str) -> None:
    """A pickle record and the pickles after its STOP, read (objects dropped)
    for the globals they name."""
    def unplaced(pid: tuple[Any, ...]) -> StorageRef:
        # tensors of a record torch does not load (traced_inputs.pkl): their
        # storages are not looked for, only what the pickle names is
        stype, key, location, numel = parse_storage_pid(pid, 5)
        return StorageRef(f"{part}/{key}", stype.dtype, location, numel, None, pid)

    stream = io.BytesIO(data)
    pickles.load(stream, unplaced, seen, {}, read_bytes)
    pickles.scan_rest(stream, len(data), seen, part, read_bytes)


def _judge_code(zf: Any, prefix: str, names: list[str], seen: GlobalsSeen) -> None:
    """A TorchScript archive's code: what its ``__setstate__`` methods call
    when torch.jit.load runs them (``ckptool.read.pickle.torchscript``); and
    its ``__torch__`` classes are the archive's own, compiled from that code."""
    from ckptool.read.pickle import torchscript  # (ast: only for TorchScript archives)

    code = {n: _read_record(zf, n) for n in names
            if n.startswith(f"{prefix}code/") and n.endswith(".py")}
    for finding in torchscript.judge(code):
        seen.flag(finding.op, finding.reason, finding.record)
    for name, verdict in list(seen.verdicts.items()):
        if name.startswith("__torch__.") and verdict.category == policy.CUSTOM:
            seen.verdicts[name] = policy.Verdict(policy.TORCH, SCRIPT_CLASS)


def _explain_other_zip(names: list[str]) -> None:
    if any(n.endswith(".npy") for n in names):
        raise NotACheckpointError(
            "this is a numpy .npz archive, not a PyTorch checkpoint",
            "load it with numpy.load",
        )
    base = {n.rsplit("/", 1)[-1] for n in names}
    if {"metadata.json", "config.json"} <= base and any(n.endswith(".weights.h5") or
                                                         n.endswith(".h5") for n in base):
        raise NotACheckpointError(
            "this is a Keras model archive (.keras: config.json, metadata.json and its "
            "weights in HDF5), not a PyTorch checkpoint",
            "load it with keras.saving.load_model")
    if any(n.endswith("archive_format") or "/models/" in n for n in names):
        raise UnsupportedCheckpointError(
            "a torch.export (.pt2) archive whose layout ckptool does not know (no "
            "archive_format record where torch.export.save puts it)",
            "load it with torch.export.load on a trusted file")
    raise NotACheckpointError(
        "zip archive without a data.pkl record: not a PyTorch checkpoint",
        "ckptool reads torch.save files, TorchScript archives and safetensors",
    )
