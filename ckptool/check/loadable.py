"""Whether a framework folder's own loader finds its weights: the finding
``diagnose`` gives a transformers, PEFT or diffusers model folder whose
``from_pretrained`` would find nothing it reads (PEFT's adapter as shards and
an index; a diffusers model saved as ``model.safetensors``; a transformers
config beside ``weights.pt``), or would read it only when told (diffusers'
``.bin`` shard index, read only with ``use_safetensors=False``).

What each loader looks for, in its order, is ``ckptool.read.layouts.loaders``'
model of it; only the folder's file names are looked at here. A folder that
holds the model only as a variant loads when the variant is named (a note
of ``inspect``'s, not a problem); a folder without the framework's config
(a bare ``model.safetensors``) is no framework's folder, and not judged.
"""

from __future__ import annotations

import os

from ckptool.check.findings import ERROR, WARNING, Finding
from ckptool.describe import plural, shell_word
from ckptool.model import Checkpoint
from ckptool.read.layouts import framework, journal, loaders
from ckptool.read.layouts.loaders import DIFFUSERS, PEFT, TRANSFORMERS

CANNOT_LOAD, NEEDS_FLAG = "framework-cannot-load", "framework-load-flag"
FAMILIES = {"transformers": TRANSFORMERS, "peft": PEFT, "diffusers": DIFFUSERS}
CALLS = {TRANSFORMERS: "AutoModel.from_pretrained({})",
         PEFT: "PeftModel.from_pretrained(base_model, {})",
         DIFFUSERS: "ModelMixin.from_pretrained({})"}


def loader_findings(ckpt: Checkpoint) -> list[Finding]:
    """A finding where the folder's framework loader cannot read its weights
    (error), or reads them only when passed a flag (warning)."""
    fw = ckpt.framework
    if fw is None or fw.kind not in FAMILIES or (fw.kind == "diffusers"
                                                  and fw.evidence != "config.json"):
        return []  # (a diffusers pipeline's models are its component folders)
    family = FAMILIES[fw.kind]
    names = _file_names(fw.directory)
    if names is None:
        return []
    config = framework.json_file(fw.directory, "config.json") \
        if family == TRANSFORMERS and "config.json" in names else None
    explicit = config.get("transformers_weights") if isinstance(config, dict) else None
    ours = [n for n in names if ((p := loaders.parse(n)) is not None and p.family == family)
            or n == explicit]
    choice = loaders.choose(ours, explicit if isinstance(explicit, str) else None,
                            peft=family == PEFT)
    folder = fw.directory.rstrip("/\\") or fw.directory
    loader = loaders.LOADER[family]
    fix = f"ckptool convert {shell_word(folder)} {shell_word(folder + '.fixed')} --format hf"
    if choice is None:
        return [Finding(
            CANNOT_LOAD, ERROR,
            f"{loader} cannot load {folder}/: it reads {_looks_for(family)}, and the folder "
            f"holds the weights as {_held(ckpt, folder)}",
            fix, _call(fw.model_class, family, repr(folder + ".fixed")))]
    flags = [n for n in choice.needs if not n.startswith("variant=")]
    if choice.name is None or not flags:
        return []  # loads; a variant is loaded when it is named (inspect says so)
    call = _call(fw.model_class, family, ", ".join((repr(folder), *flags)))
    return [Finding(
        NEEDS_FLAG, WARNING,
        f"{loader} reads {choice.name} only when told {', '.join(flags)}: a plain "
        f"from_pretrained({folder!r}) finds no weights (--format hf writes safetensors, "
        "which it reads as they are)", fix, call)]


def _call(model_class: str | None, family: str, args: str) -> str:
    """The loader's call on ``args``, with the folder's model class where it names one."""
    if model_class is not None and family != PEFT:
        return f"{model_class}.from_pretrained({args})"
    return CALLS[family].format(args)


def _file_names(directory: str) -> list[str] | None:
    try:
        with os.scandir(directory) as it:
            return sorted(e.name for e in it if e.is_file() and not journal.is_temporary(e.name))
    except OSError:
        return None


def _looks_for(family: str) -> str:
    """The names ``family``'s loader looks for, in its order."""
    plain = [n for n, needs in loaders.order(family, None) if needs is None]
    told = [f"{n} only with {needs}" for n, needs in loaders.order(family, None) if needs]
    said = ", ".join(plain[:-1]) + f" or {plain[-1]}" if len(plain) > 1 else plain[0]
    if family == PEFT:
        said += " (one file: never an index or shards)"
    return said + "".join(f" ({t})" for t in told)


def _held(ckpt: Checkpoint, folder: str) -> str:
    """The weights the folder holds, as ckptool read them."""
    shards = [f.path for f in ckpt.files if f.role == "shard"]
    index = next((f.path for f in ckpt.files if f.role == "index"), None)
    if index is not None:
        return f"{index} and its {plural(len(shards), 'shard')}"
    if ckpt.files:
        return ", ".join(f.path for f in ckpt.files[:4])
    return os.path.relpath(ckpt.path, folder) if ckpt.path.startswith(folder) \
        else os.path.basename(ckpt.path)
