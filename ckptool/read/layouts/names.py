"""What a directory's names and first bytes say, for ``recognise`` and
``mixed``: the file names each layout writes (DCP's ``.metadata`` and
``.distcp``, DeepSpeed's model and optimizer states, files saved per rank,
torch's HuggingFaceStorageWriter shards, accelerate's sub-directories,
shard indexes, DeepSpeed's universal checkpoint folder), whether a file is
a checkpoint by its first bytes, and an index's JSON. Nothing here reads
more than an index and a few bytes of a file.
"""

from __future__ import annotations

import json
import os
import re

from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs
from ckptool.read.formats import safetensors_fmt, torch_legacy, torch_zip
from ckptool.read.layouts.layout import DS_UNIVERSAL, Layout

# torch's HuggingFaceStorageWriter(save_distributed=True): rank, then file
HF_STORAGE_SHARD = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
# model_world_size_2_rank_0.pt (veRL), rank_0.pt, checkpoint-rank3.pth...
# transformers' shard names (model-00001-of-00002.safetensors, pytorch_model-...bin)
SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")
RANK_NAME = re.compile(r"^(?P<stem>.*?)[_-]?rank[_-]?(?P<rank>\d+)\.(?:pt|pth|bin)$")
METADATA = ".metadata"
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
ACCELERATE_DIRS = re.compile(r"^(pytorch_model_fsdp|optimizer)(_\d+)?$")
# DeepSpeed's names (engine.py: _get_ckpt_name, _get_zero_ckpt_name)
# (numbers as DeepSpeed prints them: a rank plain, mp_rank_{:02d}; never "mp_rank_0"
# beside "mp_rank_00", which int() would take for the same file)
_RANK, _MP = r"(0|[1-9][0-9]*)", r"([0-9]{2}|[1-9][0-9]{2,})"
MODEL_FILE = re.compile(rf"^(?:zero_pp_rank_{_RANK}_)?mp_rank_{_MP}_model_states\.pt$")
OPTIM_FILE = re.compile(rf"^(bf16_)?zero_pp_rank_{_RANK}_mp_rank_{_MP}_optim_states\.pt$")
# its MoE runs' (_get_expert_ckpt_name, _get_optimizer_ckpt_name): each expert's
# weights, global id E of the L-th MoE layer; ZeRO 0's optimizer states per
# expert-parallel rank; DeepSpeed before 0.6's expert files (no layer)
EXPERT_MODEL = re.compile(rf"^layer_{_RANK}_expert_{_RANK}_mp_rank_{_MP}_model_states\.pt$")
EXPERT_OPTIM = re.compile(rf"^expp_rank_{_RANK}_mp_rank_{_MP}_optim_states\.pt$")
OLD_EXPERT_MODEL = re.compile(rf"^expert_{_RANK}_mp_rank_{_MP}_model_states\.pt$")
# every file DeepSpeed's engine saves in a tag directory (pipeline layers, MoE experts too)
DEEPSPEED_FILE = re.compile(r"_(model|optim)_states\.pt$")
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # ds_to_universal's, beside its output folder
MAX_TAG_BYTES = 1024
INDEX_NAME = re.compile(r"\.index(\.[^./]+)?\.json$")
PREFERRED_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_INDEX_BYTES = 256 << 20  # an index of a million names is ~60 MB
MAX_SNIFFED = 4096  # files whose first bytes are read to find a lone checkpoint
LIST_SHOWN = 6
# the scripts DeepSpeed copies beside every checkpoint (never run: just files)
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def listing(folder: str) -> list[str]:
    try:
        return fs.listdir(folder)
    except OSError:
        return []


def regular_file(path: str) -> bool:
    """Whether ``path`` is a regular file (a FIFO or device is never opened:
    reading one could block for ever)."""
    return fs.regular(path)


def is_checkpoint_file(path: str) -> bool:
    """A torch zip, legacy torch file or safetensors file, by its first bytes."""
    if not regular_file(path):
        return False
    try:
        with fs.open_binary(path) as f:
            head = f.read(16)
    except OSError:
        return False
    return torch_zip.sniff(head) or torch_legacy.sniff(head) or safetensors_fmt.sniff(head)


def latest(path: str, name: str = LATEST) -> str | None:
    """The tag a DeepSpeed ``latest`` file (or ``latest_universal``) names
    (one line of text), or None."""
    if not regular_file(os.path.join(path, name)):
        return None
    try:
        with fs.open_binary(os.path.join(path, name)) as f:
            data = f.read(MAX_TAG_BYTES + 1)
    except OSError:
        return None
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    # DeepSpeed reads os.path.join(load_dir, tag): a nested tag
    # (resume/global_step9) is followed as it follows it
    parts = tag.split("/")
    if not tag or len(data) > MAX_TAG_BYTES or "\n" in tag or "\0" in tag or "\\" in tag \
            or tag.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None
    return tag


def is_deepspeed_tag(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed tag directory (holds its model or
    optimizer state files)."""
    try:
        names = fs.listdir(path)
    except OSError:
        return False
    return any(MODEL_FILE.match(n) or OPTIM_FILE.match(n) for n in names)


def ds_universal(path: str, files: list[str], dirs: list[str]) -> Layout | None:
    """A DeepSpeed universal checkpoint (``ds_to_universal``'s output folder:
    ``zero/`` beside the model states it copied), or the folder above one
    whose ``latest_universal`` names it (where no ``latest`` names a ZeRO
    checkpoint, which DeepSpeed loads unless told to load the universal one)."""
    if "zero" in dirs and any(MODEL_FILE.match(n) for n in files):
        return Layout(DS_UNIVERSAL, path, path, tag=fs.basename(path))
    if LATEST_UNIVERSAL not in files or LATEST in files:
        return None
    tag = latest(path, LATEST_UNIVERSAL)
    folder = os.path.join(path, tag) if tag is not None else None
    if folder is None or not fs.isdir(os.path.join(folder, "zero")):
        raise CorruptCheckpointError(
            f"{os.path.join(path, LATEST_UNIVERSAL)} names "
            f"{'no folder' if tag is None else repr(tag)}, but {path} has no DeepSpeed "
            f"universal checkpoint {'there' if tag is None else tag + '/'} (a folder holding "
            "zero/)", "the conversion was interrupted, or its output folder was not copied; "
            "name the folder to read it")
    return Layout(DS_UNIVERSAL, path, folder, tag=tag)


def holds_dcp(folder: str) -> bool:
    """Whether ``folder`` holds a DCP checkpoint's ``.metadata`` (or one per rank)."""
    return fs.isfile(os.path.join(folder, METADATA)) or any(
        RANK_METADATA.match(n) for n in listing(folder))


def index_json(path: str) -> dict[str, object] | None:
    """The JSON of a shard index (an object with a ``weight_map`` object), or None."""
    if not regular_file(path):
        return None
    try:
        with fs.open_binary(path) as f:
            if not f.read(64).lstrip().startswith(b"{"):
                return None
            if fs.size_of(f) > MAX_INDEX_BYTES:
                return None
            f.seek(0)
            data = json.loads(f.read())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if isinstance(data, dict) and isinstance(data.get("weight_map"), dict):
        return data
    return None


def shown(names: list[str]) -> str:
    """``a, b, c`` of the first few names, and how many more."""
    text = ", ".join(names[:LIST_SHOWN])
    return text + (f", … {len(names) - LIST_SHOWN} more" if len(names) > LIST_SHOWN else "")
