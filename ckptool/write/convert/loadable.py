"""The shards ``convert`` writes into a framework's folder, as its loader
reads them (``ckptool.read.layouts.loaders`` models each loader's order):

- PEFT's ``load_peft_weights`` reads one file, ``adapter_model.safetensors``
  (or ``.bin``), and never an index: an adapter is written as one file
  whatever its size, as PEFT's ``save_pretrained`` writes it, and a
  ``--max-shard-size`` that would split it is refused;
- diffusers' ``from_pretrained`` reads a ``.bin`` shard index only when told
  ``use_safetensors=False``: the output says so, with the call that loads it.
"""

from __future__ import annotations

from ckptool.describe import human_bytes
from ckptool.errors import UsageError
from ckptool.model import Checkpoint
from ckptool.read.layouts import loaders
from ckptool.write import shards
from ckptool.write.convert.plan import Written

PEFT_STEM = "adapter_model"
ONE_FILE = 1 << 62  # no shard limit: every tensor in one file


def plan_shards(written: Written, kind: str, max_shard_size: int | None,
                stem: str | None) -> list[shards.Shard]:
    """The shards of an hf or hf-bin output, with ``stem`` its framework's
    file stem (None: transformers'); a PEFT adapter in one file."""
    if stem != PEFT_STEM:
        return shards.plan(written, kind, max_shard_size or shards.DEFAULT_MAX, stem)
    planned = shards.plan(written, kind, ONE_FILE, stem)
    if max_shard_size is not None and planned[0].nbytes > max_shard_size:
        raise UsageError(
            f"--max-shard-size {human_bytes(max_shard_size)} would split this PEFT adapter "
            f"({human_bytes(planned[0].nbytes)}) into shards, and PEFT's from_pretrained "
            f"loads one file only ({planned[0].name}, never an index)",
            "leave out --max-shard-size: the adapter is written as one file, as PEFT's "
            "save_pretrained writes it")
    return planned


def loader_notes(source: Checkpoint, dst: str, kind: str, planned: list[shards.Shard],
                 stem: str | None) -> list[str]:
    """What the output's framework loader must be told to read it (diffusers'
    ``use_safetensors=False`` for ``.bin`` shards), as notes."""
    fw = source.framework
    if fw is None or stem is None or stem == PEFT_STEM:
        return []
    names = [s.name for s in planned]
    if len(planned) > 1:
        names.append(shards.index_name(kind, stem))
    choice = loaders.choose(names)
    if choice is None or choice.name is None or not choice.needs:
        return []
    flags = ", ".join(choice.needs)
    cls = fw.model_class or "ModelMixin"
    other = " (--format hf writes safetensors shards, which it reads as they are)" \
        if kind == "hf-bin" else ""
    return [f"{choice.loader} reads {choice.name} only when told {flags}: load the output "
            f"with {cls}.from_pretrained({dst!r}, {flags}){other}"]
