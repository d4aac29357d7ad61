"""The pure data model of a checkpoint: what ``ckptool.open`` returns.

Plain dataclasses with no tensor bytes in them. Every view (CLI text, JSON,
TUI) and every later stage (diagnostics, rewrites) reads these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any

from ckptool import dtypes
from ckptool.keys import join_key

NO_LOCATION = "unrecorded"  # bucket for formats that save no device (safetensors)


@dataclass(slots=True)
class TensorInfo:
    """One tensor: where it sits in the file and what it is."""

    # container path joined by "/": "state_dict/module.conv.weight"; a "/" or
    # "\\" inside one name is escaped ("a\\/b" is {"a/b": t}: ckptool.keys)
    key: str
    shape: tuple[int, ...]
    dtype: str  # canonical torch name: "float32", "bfloat16", "float8_e4m3fn"...
    stride: tuple[int, ...] | None
    storage_offset: int  # in elements
    storage: str | None  # storage id: tensors that share one share the id
    location: str | None  # saved device tag: "cpu", "cuda:2", "mps"; None if unrecorded
    nbytes: int  # bytes this tensor's elements take
    requires_grad: bool = False
    is_parameter: bool = False
    layout: str = "strided"  # strided, quantized, sparse_coo, sparse_csr..., nested, storage
    subclass: str | None = None  # tensor subclass named by the file, if any
    # a sparse (or nested) tensor is one tensor with a dense shape, made of
    # these: "indices" and "values", keyed "<its key>/indices"...
    parts: tuple[TensorInfo, ...] = ()
    # checkpoints of many files: the file that holds it (an HF shard, relative
    # to Checkpoint.directory), or the chunks it is saved in (DCP)
    file: str | None = None
    chunks: tuple[Chunk, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int | None:
        """Stored values of a sparse tensor (None for any other)."""
        values = next((p for p in self.parts if p.key.endswith("/values")), None)
        return values.shape[0] if values is not None and values.shape else None

    @property
    def is_floating(self) -> bool:
        return dtypes.is_floating(self.dtype)


@dataclass(frozen=True)
class Chunk:
    """One piece of a tensor saved in chunks: the box it fills in the whole
    tensor, and where its bytes lie.

    - DCP: a ``torch.save`` archive of the piece, embedded in ``file`` at
      ``byte_offset``;
    - ``flat`` (DeepSpeed ZeRO partitions): ``offsets`` and ``sizes`` are one
      run of elements of the tensor flattened, whose raw little-endian
      elements lie at ``byte_offset`` in ``file`` (inside a storage record),
      as ``dtype`` when that is not the tensor's (a cast on reading)."""

    file: str  # relative to Checkpoint.directory: "__1_0.distcp"
    offsets: tuple[int, ...]  # where the box starts, per dimension
    sizes: tuple[int, ...]  # its shape
    byte_offset: int
    byte_length: int
    rank: int | None = None  # the rank that wrote it (from "__<rank>_<n>.distcp")
    transforms: tuple[str, ...] = ()  # what to undo first ("stream.zstd/1")
    flat: bool = False
    dtype: str | None = None
    # raw: a row-major box of raw little-endian elements at byte_offset (a
    # rank's local DTensor shard in its zip, an HF storage writer's shard)
    raw: bool = False

    @classmethod
    def plain(cls, file: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
              byte_offset: int, byte_length: int, rank: int | None,
              transforms: tuple[str, ...]) -> Chunk:
        """``Chunk(file, offsets, ..., transforms)`` (the other fields their
        defaults), equal to it in every way, made in one step (a DCP
        checkpoint of 100,000 tensors has a million chunks): its ``__dict__``
        set whole, as the frozen dataclass's ``__init__`` fills it field by field."""
        chunk = _new(cls)
        _set(chunk, "__dict__", {
            "file": file, "offsets": offsets, "sizes": sizes, "byte_offset": byte_offset,
            "byte_length": byte_length, "rank": rank, "transforms": transforms,
            "flat": False, "dtype": None, "raw": False})
        return chunk


_new, _set = object.__new__, object.__setattr__


@dataclass(frozen=True)
class FileInfo:
    """One file of a checkpoint made of many."""

    path: str  # relative to Checkpoint.directory
    role: str  # index, shard, metadata (DCP .metadata), data (a .distcp), extra (meta.pt)
    format: str | None  # how it is read: safetensors, torch-zip... (None: JSON, pickle)
    size: int
    num_tensors: int = 0  # tensors (a shard) or tensor chunks (a .distcp) it holds
    num_values: int = 0  # non-tensor values it holds (DCP's BYTE_IO items)
    rank: int | None = None  # the rank that wrote it (DCP)


@dataclass(frozen=True)
class Companion:
    """A file beside the model in a framework's folder: an optimizer state,
    an RNG state, training arguments, a config... with what reading it found."""

    path: str  # relative to Framework.directory
    role: str  # "optimizer state", "RNG state", "training arguments"...
    size: int
    format: str | None = None  # how ckptool read it (a pickle, a torch zip); None: not read
    unsafe: tuple[str, ...] = ()  # globals torch.load(weights_only=False) would call
    custom: tuple[str, ...] = ()  # classes from outside torch that loading imports
    error: str | None = None  # why it could not be read
    detail: str | None = None  # what it holds, in a few words ("Adam/AdamW: ... 9 parameters")


@dataclass(frozen=True)
class Framework:
    """What a framework's folder says about the checkpoint in it."""

    kind: str  # transformers, peft, trainer, accelerate, diffusers, sentence-transformers
    directory: str
    description: str  # "a transformers Trainer checkpoint (checkpoint-2/)"
    model_class: str | None = None  # config.json's architectures[0]; PEFT: the task
    model_type: str | None = None
    tie_word_embeddings: bool | None = None
    # prefixes the framework itself puts on the names ("model." of a Llama,
    # "base_model.model." of PEFT): no wrapper to strip
    own_prefix: str = ""
    evidence: str = ""  # the file that says so: "config.json", "adapter_config.json"
    adapter: dict[str, Any] = field(default_factory=dict)  # PEFT: type, r, targets, base model
    companions: tuple[Companion, ...] = ()
    components: tuple[str, ...] = ()  # diffusers: the pipeline's model folders
    # PEFT: every adapter of the folder (name, peft_type, path, r), "default" first
    adapters: tuple[dict[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "directory": self.directory,
                "description": self.description, "model_class": self.model_class,
                "model_type": self.model_type, "tie_word_embeddings": self.tie_word_embeddings,
                "own_prefix": self.own_prefix, "evidence": self.evidence,
                "adapter": self.adapter, "components": list(self.components),
                "adapters": [dict(a) for a in self.adapters],
                "companions": [{"path": c.path, "role": c.role, "size": c.size,
                                "format": c.format, "unsafe": list(c.unsafe),
                                "custom": list(c.custom), "error": c.error,
                                "detail": c.detail} for c in self.companions]}


@dataclass(slots=True)
class StorageInfo:
    """One storage record: the bytes that one or more tensors view."""

    id: str
    dtype: str
    location: str | None
    nbytes: int
    record: str | None  # archive record name, or "@offset" into the file
    tensors: tuple[str, ...]  # keys of the tensors viewing it
    file: str | None = None  # the file it is in, for checkpoints of many files


@dataclass(frozen=True)
class Entry:
    """A non-tensor entry: epoch, hyper-parameters, an argparse.Namespace..."""

    key: str
    type: str
    summary: str
    value: Any = None  # the JSON-friendly value, when it is small and plain


@dataclass(frozen=True)
class GlobalInfo:
    """A global the file names, with its policy category."""

    name: str
    category: str  # torch, data, custom or unsafe
    reason: str
    count: int
    # what loading does with it: called, called-instance, created, built
    # (none: only referenced); see ckptool.read.pickle.policy
    uses: tuple[str, ...] = ()
    where: tuple[str, ...] = ()  # the file's pickles that name it


@dataclass(frozen=True)
class StateDictInfo:
    """The main state dict: the weights a user wants to load."""

    path: str  # its key ("" when the file is the state dict itself)
    kind: str  # "dict", or "module" for a pickled nn.Module / TorchScript
    keys: tuple[str, ...]  # its names as they are (never escaped), in file order
    prefix: str  # wrapper prefix shared by every key: "module.", "_orig_mod.module."...
    common_prefix: str  # longest dotted prefix shared by every key
    num_tensors: int
    num_parameters: int  # elements of its parameters, a tied one once (read/params.py)
    nbytes: int
    num_buffers: int = 0  # elements of its buffers (running statistics, counters...)

    def tensor_key(self, name: str) -> str:
        """The checkpoint-wide key of state-dict entry ``name`` (escaped as
        ``ckptool.keys.join_key`` does: ``name`` itself when it has no ``/``
        or ``\\`` and the file is the state dict)."""
        return join_key(self.path, name)


@dataclass
class Checkpoint:
    path: str
    # torch-zip, torch-legacy, torchscript, safetensors, pickle; and layouts of
    # many files: hf-safetensors, hf-bin (Hugging Face shards + index), dcp
    format: str
    file_size: int  # for many files: all of them together
    tensors: list[TensorInfo]
    storages: dict[str, StorageInfo]
    entries: list[Entry]
    globals: list[GlobalInfo]
    main_state_dict: StateDictInfo | None
    metadata: dict[str, Any] = field(default_factory=dict)
    root: Any = None  # the inert object tree, for views that want to dig
    # what the file holds that its format does not (bytes after the end...)
    warnings: list[str] = field(default_factory=list)
    # checkpoints of many files: the directory holding them, and each file
    directory: str | None = None
    files: list[FileInfo] = field(default_factory=list)
    # DCP: where each key sat in the nested dict that was saved (its
    # planner_data: "model.fc.weight" -> ("model", "fc.weight")); aliases: names
    # an HF index records as the same tensor as a stored one (alias -> stored)
    tree_paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    # the framework folder it was read from (a transformers model, a PEFT
    # adapter, a Trainer checkpoint-N/...), and the other files in it
    framework: Framework | None = None
    # tensors made from another checkpoint's (``ckptool.read.derived.Made``:
    # Megatron's layers unstacked, a Hugging Face model's names): every
    # tensor here is one of them, its values made from that checkpoint's
    derived_from: Any = None

    @property
    def is_multifile(self) -> bool:
        return self.directory is not None

    @property
    def unsafe_globals(self) -> list[str]:
        return [g.name for g in self.globals if g.category == "unsafe"]

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        storages = self.storages.values()
        return _tally(map(attrgetter("dtype"), storages), map(attrgetter("nbytes"), storages))

    @property
    def bytes_by_location(self) -> dict[str, int]:
        storages = self.storages.values()
        return _tally(map(attrgetter("location"), storages), map(attrgetter("nbytes"), storages),
                      NO_LOCATION)

    @property
    def tensors_by_location(self) -> dict[str, int]:
        return _tally(map(attrgetter("location"), self.tensors), repeat(1), NO_LOCATION)

    @property
    def locations(self) -> list[str]:
        """Saved device tags, most bytes first."""
        return list(self.bytes_by_location)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())

    def state_dict(self) -> dict[str, TensorInfo]:
        """The main state dict's names mapped to their tensors."""
        sd = self.main_state_dict
        if sd is None:
            return {}
        by_key = {t.key: t for t in self.tensors}
        return {k: by_key[sd.tensor_key(k)] for k in sd.keys if sd.tensor_key(k) in by_key}


def _tally(names: Iterable[str | None], amounts: Iterable[int],
           blank: str | None = None) -> dict[str, int]:
    """Each name's total, largest first; with ``blank``, a name that is
    None or empty (a device unrecorded) counts as ``blank``."""
    out: dict[str | None, int] = {}
    get = out.get
    for name, n in zip(names, amounts, strict=False):  # amounts may be an endless repeat
        out[name] = get(name, 0) + n
    totals: dict[str, int] = {}
    for name, n in out.items():  # per distinct name: a few
        key = (name or blank) if blank is not None else name
        totals[key] = totals.get(key, 0) + n  # type: ignore[index,arg-type]
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))
