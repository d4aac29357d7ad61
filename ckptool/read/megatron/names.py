"""The names Megatron gives a save directory's parts
(``megatron/training/checkpointing.py``: ``get_checkpoint_name``,
``get_checkpoint_tracker_filename``, ``read_metadata``), and the
``metadata.json`` of a Megatron-core distributed checkpoint
(``megatron/core/dist_checkpointing/core.py``: ``CheckpointingConfig``).

- the save directory holds ``latest_checkpointed_iteration.txt`` (an
  iteration number, or ``release``) and one folder per saved iteration,
  ``iter_0000100`` (seven digits at least) or ``release``;
- a ``torch_dist`` iteration folder holds ``metadata.json``
  (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` and DCP files;
  ``torch_dcp`` and ``fsdp_dtensor`` iteration folders are plain DCP;
- a legacy (``--ckpt-format torch``) iteration folder holds one folder per
  model-parallel rank, ``mp_rank_{tp:02d}``, with pipeline parallelism
  ``mp_rank_{tp:02d}_{pp:03d}``, with expert parallelism a further
  ``_{ep:03d}``, each with ``model_optim_rng.pt`` (and ``distrib_optim.pt``
  under the distributed optimizer).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptool.read import fs

TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
RELEASE = "release"
MP_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
MODEL_FILE = "model_optim_rng.pt"
NEMO_RANK_DIR = re.compile(r"^(?:mp_rank_(\d{2})|tp_rank_(\d{2})_pp_rank_(\d{3}))$")
NEMO_MODEL_FILE = "model_weights.ckpt"
OPTIMIZER_FILE = "distrib_optim.pt"
BACKEND_FILE = "metadata.json"
COMMON_FILE = "common.pt"
MAX_TRACKER_BYTES = 64
MAX_BACKEND_BYTES = 1 << 20


def iteration_dir(iteration: int | None) -> str:
    """``iter_0000100`` for 100; ``release`` for None."""
    return RELEASE if iteration is None else f"iter_{iteration:07d}"


def tracked(path: str) -> tuple[str | None, str]:
    """The iteration folder the tracker file of ``path`` names
    (``iter_0000100``, or ``release``), as Megatron's ``read_metadata``
    reads it; None and why where it names none (damaged, not a number)."""
    name = os.path.join(path, TRACKER)
    try:
        with fs.open_binary(name) as f:
            data = f.read(MAX_TRACKER_BYTES + 1)
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror})"
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, "it is not text"
    if len(data) > MAX_TRACKER_BYTES or not text:
        return None, "it is empty" if not text else "it is not an iteration number"
    if text == RELEASE:
        return RELEASE, ""
    if not text.isdigit():
        return None, f"it says {text[:20]!r}, not an iteration number or 'release'"
    return iteration_dir(int(text)), ""


def iteration_of(name: str) -> int | None:
    """100 for ``iter_0000100``; None for ``release`` or another name."""
    m = ITERATION_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RankDir:
    """One legacy ``mp_rank_XX[_YYY[_ZZZ]]`` folder: its ranks."""

    name: str
    tp: int
    pp: int | None  # None: no pipeline parallelism in the name
    ep: int | None  # None: no expert parallelism in the name


def rank_dir(name: str) -> RankDir | None:
    m = MP_RANK_DIR.match(name)
    if m is None:
        return None
    tp, pp, ep = m.groups()
    return RankDir(name, int(tp), None if pp is None else int(pp), None if ep is None else int(ep))


def nemo_rank_dir(name: str) -> RankDir | None:
    """NeMo 1's rank folders (``inject_model_parallel_rank``): ``mp_rank_{tp:02d}``
    without pipeline parallelism, ``tp_rank_{tp:02d}_pp_rank_{pp:03d}`` with."""
    m = NEMO_RANK_DIR.match(name)
    if m is None:
        return None
    alone, tp, pp = m.groups()
    return RankDir(name, int(alone), None, None) if alone is not None else \
        RankDir(name, int(tp), int(pp), None)


def _megatron_name(numbers: tuple[int, ...]) -> str:
    return f"mp_rank_{numbers[0]:02d}" + "".join(f"_{n:03d}" for n in numbers[1:])


def _nemo_name(numbers: tuple[int, ...]) -> str:
    return f"mp_rank_{numbers[0]:02d}" if len(numbers) == 1 else \
        f"tp_rank_{numbers[0]:02d}_pp_rank_{numbers[1]:03d}"


@dataclass(frozen=True)
class Naming:
    """How a writer names its rank folders and the file in each."""

    file: str
    parse: Callable[[str], RankDir | None]
    name: Callable[[tuple[int, ...]], str]  # (tp[, pp[, ep]]) -> the folder's name


MEGATRON_NAMING = Naming(MODEL_FILE, rank_dir, _megatron_name)
NEMO_NAMING = Naming(NEMO_MODEL_FILE, nemo_rank_dir, _nemo_name)


def backend(path: str) -> dict[str, Any] | None:
    """``metadata.json`` of the folder ``path`` where it is a Megatron-core
    distributed checkpoint's (a JSON object naming its ``sharded_backend``);
    else None."""
    name = os.path.join(path, BACKEND_FILE)
    try:
        with fs.open_binary(name) as f:
            data = f.read(MAX_BACKEND_BYTES + 1)
        found = json.loads(data) if len(data) <= MAX_BACKEND_BYTES else None
    except (OSError, ValueError):
        return None
    if isinstance(found, dict) and isinstance(found.get("sharded_backend"), str):
        return found
    return None
