"""A Hugging Face index against its shards, every disagreement listed: a
shard missing, a tensor the index puts in a shard that does not hold it, a
tensor stored in two shards or in a shard the index does not list it for,
and shard files nothing names.

The reader (``ckptool.read.layouts.hf_sharded``) refuses at the first of
these; verify reads the index and each shard alone (``files``) and names
them all.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ckptool.check.verify.files import Run, check_file, read_alone
from ckptool.check.verify.problems import (
    DUPLICATE,
    EXTRA_FILE,
    HEADER,
    MISSING_TENSOR,
    UNLISTED_TENSOR,
    Problem,
)
from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs
from ckptool.read.layouts.base import member
from ckptool.read.layouts.names import INDEX_NAME, SHARD_NAME, index_json
from ckptool.read.tensors import CompositeTensor, StorageRef, TensorRecord

MAX_NAMED = 20  # problems of one kind named one by one per shard; the rest counted


def shards_of(run: Run, index: str) -> list[str] | None:
    """The shard files index ``index`` names (sorted), each a path inside
    the directory; None, and the problem, when the index is not one."""
    try:
        with fs.open_binary(run.path(index)) as f:
            data = json.loads(f.read(), object_pairs_hook=_pairs)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        run.add(Problem(HEADER, f"not a valid JSON index: {exc}", index))
        return None
    except _Repeated as exc:
        run.add(Problem(HEADER, f"names {exc.args[0]!r:.80} twice", index))
        return None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) for v in weight_map.values()):
        run.add(Problem(HEADER, "has no weight_map of tensor names to shard file names", index))
        return None
    named: list[str] = []
    for shard in sorted(set(weight_map.values())):
        try:
            member(run.directory, shard, index)
        except CorruptCheckpointError as exc:
            run.add(Problem(HEADER, exc.message, index))
            continue
        named.append(shard)
    return named


class _Repeated(ValueError):
    pass


def _pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in items:
        if key in out:
            raise _Repeated(key)
        out[key] = value
    return out


def check_shards(run: Run, index: str) -> list[str]:
    """Each shard the index names checked alone (``files.check_file``); the
    shards present. A shard missing is said with the tensors it should hold."""
    shards = shards_of(run, index) or []
    weight_map = (index_json(run.path(index)) or {}).get("weight_map")
    held: dict[str, list[str]] = {}
    for key, shard in weight_map.items() if isinstance(weight_map, dict) else ():
        held.setdefault(shard, []).append(key)
    present = []
    for shard in shards:
        keys = held.get(shard, [])
        more = f", and {plural(len(keys) - 3, 'other')}" if len(keys) > 3 else ""
        said = f"{index} puts {plural(len(keys), 'tensor')} in it ({', '.join(keys[:3])}{more})"
        if check_file(run, shard, index, missing=f"the file is missing; {said}"):
            present.append(shard)
    return present


def cross_check(run: Run, index: str, present: list[str]) -> None:
    """Each shard present read alone, and every tensor checked against the
    index: where it says, once, and listed (shards missing are said by
    their own problem, not tensor by tensor)."""
    data = index_json(run.path(index)) or {}
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        return
    holder: dict[str, str] = {}
    read: set[str] = set()
    for shard in present:
        raw = read_alone(run, shard)
        if raw is None or not isinstance(raw.root, dict):
            continue
        read.add(shard)
        names = [k for k, v in raw.root.items() if isinstance(k, str) and isinstance(
            v, (TensorRecord, StorageRef, CompositeTensor))]
        unlisted = [k for k in names if k not in weight_map]
        _named(run, shard, unlisted, UNLISTED_TENSOR,
               f"{shard} holds it, but {index} does not list it",
               f"more tensors {index} does not list")
        twice = [k for k in names if k in holder]
        for key in twice[:MAX_NAMED]:
            run.add(Problem(DUPLICATE, f"stored in two shards, {holder[key]} and {shard}",
                            shard, key))
        for key in names:
            holder.setdefault(key, shard)
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if shard in read and holder.get(key) != shard:
            by_shard.setdefault(shard, []).append(key)
    for shard, keys in by_shard.items():
        elsewhere = {k: holder[k] for k in keys if k in holder}
        _named(run, shard, keys, MISSING_TENSOR,
               f"{index} puts it in {shard}, which does not hold it", "more tensors it lacks",
               elsewhere)


def _named(run: Run, shard: str, keys: list[str], kind: str, message: str, rest: str,
           elsewhere: dict[str, str] | None = None) -> None:
    for key in keys[:MAX_NAMED]:
        where = f" (it is in {elsewhere[key]})" if elsewhere and key in elsewhere else ""
        run.add(Problem(kind, message + where, shard, key))
    if len(keys) > MAX_NAMED:
        run.add(Problem(kind, f"and {plural(len(keys) - MAX_NAMED, 'other')}: {rest}", shard))


def extra_shards(run: Run, index: str) -> None:
    """Shard files (``model-00003-of-00004.safetensors``) that no index of
    the directory names: left by another save, or a shard the index lost."""
    directory = run.directory or "."
    try:
        names = sorted(fs.listdir(directory))
    except OSError:
        return
    named: set[str] = set()
    for n in names:
        if INDEX_NAME.search(n):
            weight_map = (index_json(os.path.join(directory, n)) or {}).get("weight_map")
            if isinstance(weight_map, dict):
                named |= {v for v in weight_map.values() if isinstance(v, str)}
    kind = _shard_kind(index)
    for n in names:
        m = SHARD_NAME.search(n)
        if m and n not in named and (kind is None or m.group(1) == kind) \
                and fs.isfile(fs.join(directory, n)):
            run.add(Problem(EXTRA_FILE, f"a shard file that {index} does not name", n))


def _shard_kind(index: str) -> str | None:
    """``safetensors`` or ``bin``: the shards an index of that name names."""
    m = re.search(r"\.(safetensors|bin)\.index", index)
    return m.group(1) if m else None
