"""How a checkpoint of many files loads, for ``diagnose`` (text, JSON) and
the browser: the loader that takes it, what its saved devices mean, the
names its state dict is loaded under, and what ``ckptool`` can repair today.

- Hugging Face ``.bin`` shards are ``torch.save`` files: each remembers the
  device its tensors were saved on, and a plain ``torch.load`` of a shard
  fails where that device is missing, as a single file does.
  huggingface_hub's ``load_torch_model`` and transformers' ``from_pretrained``
  map shards to the CPU themselves.
- safetensors shards record no device: the loader picks it.
- DCP records no device: ``torch.distributed.checkpoint.load`` reads into
  the state dict it is given, onto the devices of that state dict's tensors.
  Its model's keys carry the top-level entry it was saved under
  (``{"model": model.state_dict()}`` gives ``model.fc.weight``): that is how
  it is loaded (``dcp.load({"model": sd})``), not a wrapper to take off.

- A DeepSpeed checkpoint loads only into a DeepSpeed engine of the same
  world size (``engine.load_checkpoint``): ``torch.load`` of its files gives
  partitions (and, under ZeRO 3, 0-element placeholders), not a state dict.
  ``ckptool convert`` writes the consolidated weights as one file; its
  devices do not matter (the file records none).

``ckptool fix`` takes a directory of shards (``ckptool.write.fix.shards``):
diagnose's command writes a fixed copy beside it; a DCP directory is
consolidated by ``convert`` first, as a DeepSpeed one always is.
"""

from __future__ import annotations

from ckptool.describe import plural, shell_word
from ckptool.model import Checkpoint
from ckptool.read.layouts.hf_storage import HF_STORAGE
from ckptool.read.layouts.per_rank import PER_RANK

HF_BIN, HF_SAFETENSORS, DCP, DEEPSPEED = "hf-bin", "hf-safetensors", "dcp", "deepspeed"
# (the formats of layouts.ds_universal and megatron.legacy: their readers not imported)
MEGATRON, UNIVERSAL = "megatron", "deepspeed-universal"



def loader(ckpt: Checkpoint) -> str:
    """The call that loads ``ckpt`` (what "will take it" means)."""
    if ckpt.format == DEEPSPEED:
        return "a DeepSpeed engine's load_checkpoint"
    if ckpt.format == DCP:
        return "torch.distributed.checkpoint.load"
    if ckpt.format in (HF_BIN, HF_SAFETENSORS):
        return "huggingface_hub.load_torch_model"
    if ckpt.format == PER_RANK:
        return "torch.load of each rank's file (its shards)"
    if ckpt.format == MEGATRON:
        return "Megatron's load_checkpoint with the same parallel sizes"
    if ckpt.format == UNIVERSAL:
        return "a DeepSpeed engine's load_checkpoint with load_universal"
    if ckpt.format == HF_STORAGE:
        return "torch.distributed.checkpoint.load with a HuggingFaceStorageReader"
    return "torch.load"


def no_problems(ckpt: Checkpoint) -> str:
    """What diagnose says when it finds nothing."""
    fw = ckpt.framework
    if fw is not None and fw.kind == "peft":  # names without the adapter's: PEFT's loaders
        return ("no problems found: PeftModel.from_pretrained(base_model, "
                f"{shell_word(fw.directory)}) loads this adapter, and "
                "set_peft_model_state_dict(peft_model, sd) takes its state dict; a plain "
                "load_state_dict does not (its names lack the adapter's name and the base "
                "model's weights)")
    if ckpt.is_multifile:
        return (f"no problems found: {loader(ckpt)} and load_state_dict will take this "
                "checkpoint")
    return "no problems found: plain torch.load and load_state_dict will take this file"


def load_label(ckpt: Checkpoint) -> str:
    """The label of the row saying how loading goes."""
    return {DCP: "dcp.load", HF_SAFETENSORS: "loading", HF_STORAGE: "dcp.load"}.get(
        ckpt.format, "torch.load")


def loads_text(ckpt: Checkpoint) -> str:
    """That row when nothing fails."""
    if ckpt.format == DEEPSPEED:
        meta = ckpt.metadata
        ranks = plural(meta.get("world_size") or 1, "rank")
        return (f"its files hold the ZeRO {meta.get('zero_stage')} partitions of {ranks}: "
                "only a DeepSpeed engine of as many ranks loads them")
    if ckpt.format == DCP:
        return ("no device recorded (DCP saves none): tensors load into the state dict "
                "you pass, on its tensors' devices")
    if ckpt.format in (HF_SAFETENSORS, HF_STORAGE):
        return "safetensors shards record no device: the loader picks it (map_location=...)"
    if ckpt.format == HF_BIN:
        return f"loads each of its {len(shards(ckpt))} shards"
    if ckpt.format == PER_RANK:
        return ("each rank's file loads alone (after `import torch.distributed.tensor`) as "
                "that rank's shards")
    if ckpt.format == MEGATRON:
        if (ckpt.metadata.get("megatron") or {}).get("format") == "nemo-ranks":
            return ("each rank's model_weights.ckpt loads alone as that rank's slices of the "
                    "model; NeMo's restore_from joins them on as many ranks")
        return ("each rank's file loads alone (weights_only=False: its args Namespace) as "
                "that rank's slices of the model")
    if ckpt.format == UNIVERSAL:
        return ("each parameter's fp32.pt loads alone; a DeepSpeed engine with "
                "load_universal loads them all, at any parallel sizes")
    return "loads"


def fails_prefix(ckpt: Checkpoint) -> str:
    return "fails on its shards: " if ckpt.format == HF_BIN else "fails: "


def landing_header(ckpt: Checkpoint) -> str:
    """The header of the devices table's last column."""
    return "torch.load of a shard here" if ckpt.format == HF_BIN else "plain torch.load here"


def records_devices(ckpt: Checkpoint) -> bool:
    """Whether saved devices mean anything: not for DCP, nor for DeepSpeed
    (its weights are converted into a file that records none)."""
    return ckpt.format not in (DCP, DEEPSPEED, HF_STORAGE, UNIVERSAL)


def entry_prefix(ckpt: Checkpoint) -> str:
    """``"model."`` when the state dict's keys carry the DCP entry they were
    saved under, else ``""``."""
    sd, entry = ckpt.main_state_dict, ckpt.metadata.get("state_dict_entry")
    if sd is None or sd.path or not ckpt.is_multifile or not isinstance(entry, str):
        return ""
    prefix = entry + "."
    return prefix if all(k.startswith(prefix) for k in sd.keys) else ""


def state_dict_place(ckpt: Checkpoint, whole: str = "the file itself") -> str:
    """Where the main state dict is: ``'state_dict'``, the DCP entry, or the
    whole checkpoint (``whole`` for a single file)."""
    sd = ckpt.main_state_dict
    if sd is not None and sd.path:
        return f"'{sd.path}'"
    if ckpt.format == DEEPSPEED:
        return "the fp32 master weights (consolidated)"
    if entry_prefix(ckpt):
        return f"the '{ckpt.metadata['state_dict_entry']}' entry"
    return "the whole checkpoint" if ckpt.is_multifile else whole


def load_snippet(ckpt: Checkpoint, device: str) -> str:
    """The Python call that loads ``ckpt`` with its tensors on ``device``."""
    path = repr(ckpt.path)
    if ckpt.format == HF_BIN:
        return (f"huggingface_hub.load_torch_model(model, {path}, safe=False, "
                f"weights_only=True, map_location={device!r})")
    if ckpt.format == HF_SAFETENSORS:
        return f"huggingface_hub.load_torch_model(model, {path}, map_location={device!r})"
    if ckpt.format == DCP:
        return f"torch.distributed.checkpoint.load(state_dict, checkpoint_id={path})"
    if ckpt.format == DEEPSPEED:
        return f"safetensors.torch.load_file({path[:-1] + '.safetensors' + path[-1]})"
    return f"torch.load({path}, map_location={device!r})"


def shards(ckpt: Checkpoint) -> list[str]:
    return [f.path for f in ckpt.files if f.role == "shard"]
