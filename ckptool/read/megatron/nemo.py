"""NeMo checkpoints, read without NeMo: which files hold the weights, and
what the model's config says about them.

- A ``.nemo`` file (``SaveRestoreConnector``: ``tarfile.open(path, "w:")``,
  ``tar.add(folder, arcname=".")``, so members ``./model_config.yaml``...)
  is an uncompressed tar: read in place (``ckptool.read.archive``) as the
  folder it was made from. NeMo 1.0 to 1.6-ish wrote ``"w:gz"``, which
  NeMo still opens (``r:`` first, then ``r:gz``): a gzip one is refused,
  with ``tar xzf`` as the way on.
- NeMo 1's folder (a ``.nemo``, or one extracted): ``model_config.yaml``
  and the weights, ``model_weights.ckpt`` (the LightningModule's
  ``state_dict``, a torch file), a ``model_weights/`` Megatron-core
  distributed checkpoint (``torch_dist``), or one
  ``mp_rank_XX/`` (``tp_rank_XX_pp_rank_YYY/`` with pipeline parallelism)
  ``model_weights.ckpt`` per model-parallel rank: joined as legacy
  Megatron rank files are (``legacy``), the run's sizes from the config
  (``megatron_args``).
- NeMo 2's checkpoint folder: ``weights/`` (a ``torch_dist`` checkpoint)
  and ``context/`` (``io.json``: the objects NeMo would rebuild, never
  read here; ``model.yaml``: the config, read as text).

The configs are YAML: read by ``flat_yaml``, a parser of ``key: scalar``
lines and nested mappings alone (no tags, no anchors, nothing built), never
by a YAML library.
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ckptool.describe import shell_word
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read import fs
from ckptool.read.layouts.layout import FILE, MEGATRON, Layout
from ckptool.read.layouts.names import shown
from ckptool.read.megatron.names import NEMO_RANK_DIR
from ckptool.read.remote import urls

CONFIG = "model_config.yaml"  # NeMo 1
WEIGHTS_FILE = "model_weights.ckpt"
WEIGHTS_DIR = "model_weights"
NEMO2_WEIGHTS, NEMO2_CONTEXT, NEMO2_CONFIG = "weights", "context", "model.yaml"
MAX_CONFIG_BYTES = 1 << 20
# whether a NeMo folder's weights are being recognised (a NeMo folder there is refused)
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("nemo_inside", default=False)
# what inspect says of the config, in this order (NeMo 1's top level, or
# NeMo 2's ``config:``)
SHOWN = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
         "hidden_size", "num_attention_heads", "ffn_hidden_size", "precision",
         "nemo_version")


@dataclass(frozen=True)
class Weights:
    """Where a NeMo folder's weights are, and what it says about them."""

    inner: str  # the weights' file or folder, relative to the NeMo folder
    folder: bool  # a folder (a torch_dist checkpoint) or one torch file
    facts: dict[str, Any]  # ckpt.metadata["nemo"]
    notes: tuple[str, ...] = ()
    ranks: tuple[str, ...] = ()  # NeMo 1's rank files (``tp_rank_00_pp_rank_001/...``)


def archive(path: str) -> bool:
    """Whether the file ``path`` is a ``.nemo`` (an uncompressed tar holding
    a NeMo model, or any tar named ``.nemo``): then indexed and mounted, a
    folder from now on. A gzip ``.nemo`` is refused. A URL is looked at
    only when it is named ``.nemo`` (one request fewer for every other)."""
    named = path.rstrip("/").endswith(".nemo")
    from ckptool.read.archive import mounts

    if (urls.is_url(path) and not named) or mounts.find(path) is not None:
        return False  # (a .nemo in a .nemo is not read in place)
    from ckptool.read.archive import tar

    kind = tar.sniff(tar.head_of(path))
    if kind == "gzip" and named:
        raise UnsupportedCheckpointError(
            f"{path} is a gzip-compressed .nemo (NeMo before 1.7 wrote them so): ckptool "
            "reads a .nemo in place only when it is an uncompressed tar",
            f"extract it: mkdir model && tar xzf {shell_word(path)} -C model, then "
            "ckptool inspect model")
    if kind != "tar":
        return False
    found = tar.mount(path)
    if named or CONFIG in found.files or WEIGHTS_FILE in found.files:
        return True
    mounts.MOUNTED.pop(mounts.key(path), None)  # another tar: the file reader explains it
    return False


def archive_above(path: str) -> bool:
    """Whether a local ``path`` that is no file lies in a ``.nemo``
    (``model.nemo/mp_rank_00/model_weights.ckpt``): that archive mounted."""
    if urls.is_url(path):
        return False
    parent = os.path.dirname(os.path.abspath(path))
    while parent and parent != os.path.dirname(parent):
        try:
            regular = os.path.isfile(parent)
        except OSError:
            return False
        if regular:
            return archive(parent)
        parent = os.path.dirname(parent)
    return False


def layout(path: str, files: list[str], dirs: list[str],
           folder: Callable[[str], Layout]) -> Layout | None:
    """The layout of the NeMo folder ``path`` (its weights' file, or
    ``folder`` of its weights' folder: ``recognise``'s), with what its
    config says; None where ``path`` is no NeMo folder."""
    found = weights(path, files, dirs)
    if found is None:
        return None
    if _INSIDE.get():  # (NeMo folders nested as deep as an archive's names allow)
        raise UnsupportedCheckpointError(
            f"{path} is a NeMo folder inside another's weights: NeMo saves none so",
            "name the NeMo folder (or .nemo) that holds the weights")
    if found.ranks:
        return Layout(MEGATRON, path, path, metadata=found.ranks, notes=found.notes,
                      nemo=found.facts)
    held = os.path.join(path, found.inner)
    token = _INSIDE.set(True)
    try:
        inner = folder(held) if found.folder else Layout(FILE, path, path, file=held)
    finally:
        _INSIDE.reset(token)
    return replace(inner, path=path, notes=(*inner.notes, *found.notes), nemo=found.facts)


def weights(path: str, files: list[str], dirs: list[str]) -> Weights | None:
    """The weights of the NeMo folder ``path`` (files and folders listed),
    or None where it is none."""
    if CONFIG in files:
        return _nemo1(path, files, dirs)
    if NEMO2_WEIGHTS in dirs and NEMO2_CONTEXT in dirs:
        return _nemo2(path)
    return None


def _nemo1(path: str, files: list[str], dirs: list[str]) -> Weights:
    config = read_yaml(fs.join(path, CONFIG))
    facts = _facts(1, config, CONFIG)
    ranks = sorted(d for d in dirs if NEMO_RANK_DIR.match(d)
                   and fs.isfile(fs.join(path, d, WEIGHTS_FILE)))
    if WEIGHTS_DIR in dirs:
        return Weights(WEIGHTS_DIR, True, facts)
    if WEIGHTS_FILE in files:
        return Weights(WEIGHTS_FILE, False, facts)
    sizes = [config.get(k) for k in ("tensor_model_parallel_size",
                                     "pipeline_model_parallel_size")]
    if len(ranks) == 1 and all(not isinstance(n, int) or n <= 1 for n in sizes):
        return Weights(f"{ranks[0]}/{WEIGHTS_FILE}", False, facts)
    if ranks:  # one per model-parallel rank: joined as Megatron's (``legacy``)
        for key, bad in (("virtual_pipeline_model_parallel_size", _over_one),
                         ("expert_model_parallel_size", _over_one),
                         ("activation", lambda v: v in _GATED)):
            if bad(config.get(key)):
                raise UnsupportedCheckpointError(
                    f"{path} holds the weights of {len(ranks)} model-parallel ranks "
                    f"({shown([d + '/' for d in ranks])}) of a run with {key} "
                    f"{config[key]!r:.40}, which ckptool does not join from NeMo 1's rank files",
                    "read one rank's by naming it: ckptool inspect "
                    f"{shell_word(fs.join(path, ranks[0], WEIGHTS_FILE))}")
        return Weights("", True, facts, ranks=tuple(f"{d}/{WEIGHTS_FILE}" for d in ranks))
    raise CorruptCheckpointError(
        f"{path} holds {CONFIG} but no weights ({WEIGHTS_FILE}, {WEIGHTS_DIR}/ or "
        "mp_rank_XX/)", "the .nemo was cut short or saved without its weights")


def _nemo2(path: str) -> Weights:
    context = fs.join(path, NEMO2_CONTEXT)
    try:
        held = sorted(n + ("/" if d else "") for n, d, _ in fs.entries(context))
    except OSError:
        held = []
    config = read_yaml(fs.join(context, NEMO2_CONFIG)) \
        if f"{NEMO2_CONFIG}" in held else {}
    facts = _facts(2, config, f"{NEMO2_CONTEXT}/{NEMO2_CONFIG}")
    note = (f"{path} is a NeMo 2 checkpoint: read {NEMO2_WEIGHTS}/; {NEMO2_CONTEXT}/ "
            f"({shown(held) if held else 'empty'}) is how NeMo rebuilds the model "
            "(io.json names the classes it would import: never read here)")
    return Weights(NEMO2_WEIGHTS, True, facts, (note,))


def _facts(version: int, config: dict[str, Any], source: str) -> dict[str, Any]:
    """ckpt.metadata["nemo"]: what the config says, and a line for inspect."""
    inner = {k[len("config."):]: v for k, v in config.items() if k.startswith("config.")}
    values = {k: v for k in SHOWN if (v := config.get(k, inner.get(k))) is not None}
    target = config.get("target") or config.get("_target_")
    model = target.rsplit(".", 1)[-1] if isinstance(target, str) else None
    said = [f"NeMo {version}" + (f" {model}" if model else "")]
    tp = values.get("tensor_model_parallel_size")
    pp = values.get("pipeline_model_parallel_size")
    if tp is not None or pp is not None:
        said.append(f"TP {tp or 1} x PP {pp or 1}")
    if values.get("num_layers") is not None:
        said.append(f"{values['num_layers']} layers")
    if values.get("hidden_size") is not None:
        said.append(f"hidden {values['hidden_size']}")
    if values.get("precision") is not None:
        said.append(f"precision {values['precision']}")
    if values.get("nemo_version") is not None:
        said.append(f"nemo {values['nemo_version']}")
    where = f"({source})" if config else f"(no {source} read)"
    return {"version": version, "model": target if isinstance(target, str) else None,
            "config": values, "source": source,
            "description": " · ".join(said) + " " + where}


# NeMo 1's MegatronGPTModel config keys and Megatron's args of the same meaning
# (nemo/collections/nlp/models/language_modeling/megatron_base_model.py:
# ``build_transformer_config``)
_SAME = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
         "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
         "max_position_embeddings", "position_embedding_type", "rotary_base",
         "make_vocab_size_divisible_by", "openai_gelu")
_RENAMED = {"layernorm_epsilon": "norm_epsilon", "rotary_percentage": "rotary_percent",
            "bias": "add_bias_linear", "num_moe_experts": "num_experts",
            "moe_router_topk": "moe_router_topk",
            "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
            # (the fused bias GELU is the tanh approximation: the gpt2 map's gelu_new)
            "bias_activation_fusion": "bias_gelu_fusion"}
# gated activations other than SwiGLU: their fc1 halves would be joined as
# SwiGLU's, and no map knows them
_GATED = ("geglu", "reglu", "fast-geglu", "fast-reglu")
_NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm", "layernorm1p": "LayerNorm"}


def _over_one(value: Any) -> bool:
    return isinstance(value, int) and value > 1


def megatron_args(config: dict[str, Any]) -> dict[str, Any]:
    """Megatron's ``args`` (the names ``facts`` and the maps read) of a NeMo
    1 config (``flat_yaml`` of ``model_config.yaml``): what the join of its
    rank files and ``convert --map`` need."""
    args: dict[str, Any] = {k: config[k] for k in _SAME if config.get(k) is not None}
    args.update({new: config[old] for old, new in _RENAMED.items()
                 if config.get(old) is not None})
    activation = str(config.get("activation", "gelu"))
    args["swiglu"] = activation in ("swiglu", "fast-swiglu")
    args["squared_relu"] = activation == "squared-relu"
    norm = config.get("normalization")
    if isinstance(norm, str) and norm in _NORMS:
        args["normalization"] = _NORMS[norm]
        args["apply_layernorm_1p"] = norm == "layernorm1p"
    groups = config.get("num_query_groups")
    if isinstance(groups, int) and groups != config.get("num_attention_heads"):
        args["group_query_attention"], args["num_query_groups"] = True, groups
    share = config.get("share_embeddings_and_output_weights")
    if isinstance(share, bool):
        args["untie_embeddings_and_output_weights"] = not share
    precision = str(config.get("precision", ""))
    args["bf16"] = precision.startswith("bf16")
    args["fp16"] = precision in ("16", "16-mixed", "fp16")
    return args


def read_yaml(path: str) -> dict[str, Any]:
    """``flat_yaml`` of a config file ({} if it cannot be read)."""
    try:
        with fs.open_binary(path) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return {}
    if len(data) > MAX_CONFIG_BYTES:
        return {}
    return flat_yaml(data.decode("utf-8", "replace"))


_LINE = re.compile(r"^( *)([A-Za-z_][\w.-]*|'[^'\n]*'|\"[^\"\n]*\"):(?:[ \t]+(.*))?$")
_INT = re.compile(r"^[-+]?\d+$")
_FLOAT = re.compile(r"^[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?$")
MAX_DEPTH = 4


def flat_yaml(text: str) -> dict[str, Any]:
    """The ``key: scalar`` entries of a block-style YAML mapping, nested keys
    dotted (``tokenizer.library``): plain scalars as YAML 1.2's core schema
    reads them (null, true/false, ints, floats, strings), quoted strings
    unquoted. Lists, flow collections, block scalars, anchors and tags are
    skipped, never built."""
    out: dict[str, Any] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    skip_above: int | None = None  # a block scalar's indent: its lines skipped
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("#", "- ", "---")) or line == "-":
            continue
        m = _LINE.match(line.rstrip())
        indent = len(line) - len(line.lstrip(" "))
        if skip_above is not None and indent > skip_above:
            continue
        skip_above = None
        if m is None:
            continue
        key = m.group(2).strip("'\"")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if len(stack) >= MAX_DEPTH:
            continue
        dotted = ".".join([*(k for _, k in stack), key])
        raw = _uncomment(m.group(3) or "")
        if not raw:
            stack.append((indent, key))
            continue
        if raw[0] in "|>":
            skip_above = indent
            continue
        if raw[0] in "[{&*!":
            continue
        out[dotted] = _scalar(raw)
    return out


def _uncomment(raw: str) -> str:
    if raw[:1] in ("'", '"'):
        end = raw.find(raw[0], 1)
        return raw[:end + 1] if end > 0 else raw
    return raw.split(" #", 1)[0].strip()


def _scalar(raw: str) -> Any:
    if raw[:1] in ("'", '"') and len(raw) >= 2 and raw[-1] == raw[0]:
        return raw[1:-1]
    if raw in ("null", "Null", "NULL", "~"):
        return None
    if raw in ("true", "True", "TRUE", "false", "False", "FALSE"):
        return raw.lower() == "true"
    if len(raw) > 40:  # (no config number is longer; int() refuses 4300 digits)
        return raw
    if _INT.match(raw):
        return int(raw)
    if _FLOAT.match(raw):
        return float(raw)
    return raw
