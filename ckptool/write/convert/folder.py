"""The framework folder around a model written as a directory (``convert
--format hf``/``hf-bin``, ``fix`` of a sharded folder): which of its files
are written beside the new weights, so that the framework loads the output
as it loaded the input, which are not, and why.

Copied, byte for byte (``Extra``): the configs, the tokenizer, a
processor's config, a chat template, the custom code an ``auto_map`` names
(only copied: ckptool never imports or runs a ``.py`` file), a
sentence-transformers model's ``modules.json`` and every module's folder
(``2_Dense/`` with its config and weights), an ``onnx/`` export, and any
file or folder ckptool has no role for (listed in a note, never dropped
silently). Not copied, each named in a note with why: the model's weights
(the output holds them converted), its other forms and variants, what
resuming training reads (a Trainer's ``optimizer.pt``, ``rng_state.pth``,
``training_args.bin``; accelerate's ``random_states_0.pkl``; DeepSpeed tag
folders), other checkpoint and pickle files, a folder holding checkpoints
of its own (a Trainer's ``checkpoint-N/``, PEFT's base model), hidden
folders (``.git/``, ``.cache/``), and a pickle whose verdict is unsafe.

With ``--dtype``, the copied ``config.json`` of a transformers model says
the new dtype (``config_with_dtype``), under the key its version writes:
``dtype`` (transformers >= 4.56) or ``torch_dtype``; transformers 5 loads
a model in the dtype its config says. The input's config is never changed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from ckptool.model import Checkpoint
from ckptool.read import fs
from ckptool.read.layouts import contents, framework, journal, loaders
from ckptool.read.layouts.names import is_checkpoint_file
from ckptool.write.outdir import AtomicDirectory

# a framework's own name for its weights (hf, hf-bin)
STEMS = {"diffusers": "diffusion_pytorch_model", "peft": "adapter_model"}
SHOWN = 16  # names a note lists
COPY_BUFFER = 8 << 20  # bytes a copied file is read by
_TRAINING = "training state, which resuming reads from the input: the output is the model"
_OTHER_FORM = "the model's weights in another form or a variant: the output holds them converted"
_CHECKPOINT = "checkpoints or pickles that are not the model converted: convert each by name"
_FLAGGED = "pickles that name globals which run code: never copied"
_HIDDEN = "a repository's or a download's records"
# frameworks whose configs record no dtype: how their loader picks one (diffusers
# 0.39, peft 0.21)
NO_DTYPE = {
    "diffusers": "a diffusers config records no dtype: from_pretrained(OUT, "
                 "torch_dtype=torch.{dtype}) loads the weights as {dtype} (without it, as "
                 "float32)",
    "peft": "adapter_config.json records no dtype: PeftModel.from_pretrained keeps LoRA "
            "weights in float32 (autocast_adapter_dtype=True, its default), or with "
            "autocast_adapter_dtype=False in the base model's dtype",
}


@dataclass(frozen=True)
class Extra:
    """A file written beside the weights: a copy of ``path``, or ``data``."""

    name: str  # its path in the output: "config.json", "2_Dense/model.safetensors"
    path: str  # the file it copies
    data: bytes | None = None  # written instead of the file (a config with its dtype)

    def open(self) -> IO[bytes]:
        return io.BytesIO(self.data) if self.data is not None else fs.open_binary(self.path)


def top_names(extras: Iterable[Extra]) -> set[str]:
    """The names ``extras`` put at the top of the output (a module's folder)."""
    return {e.name.split("/", 1)[0] for e in extras}


@dataclass
class Folder:
    """What a directory output takes from the folder it was read from."""

    stem: str | None = None  # the weights' file stem; None: transformers'
    extras: list[Extra] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_folder(source: Checkpoint, dtype: str | None = None) -> Folder:
    """The files of ``source``'s framework folder written beside its weights
    (``dtype``: what ``--dtype`` cast them to), and notes saying what was
    copied and what was not."""
    fw = source.framework
    if fw is None:
        return Folder()
    directory = fw.directory
    out = Folder(STEMS.get(fw.kind))
    own = _own_files(source, directory)
    flagged = {c.path for c in fw.companions if c.unsafe}
    try:
        entries = sorted((name, is_dir) for name, is_dir, _ in fs.entries(directory))
    except OSError:
        return out
    files = [n for n, is_dir in entries if not is_dir]
    dirs = [n for n, is_dir in entries if is_dir]
    known: list[str] = []
    unknown: list[str] = []
    folders: list[str] = []  # named first: a module's folder is easily missed
    strange: list[str] = []  # folders of no known kind
    weights: list[str] = []  # a sentence-transformers module's, copied as they are
    adapters: list[str] = []  # a PEFT folder's other adapters, copied
    left: dict[str, list[str]] = {}
    for name in files:
        full = os.path.join(directory, name)
        role = framework.role_of(name)
        if name in own or journal.is_temporary(name) or not fs.isfile(full):
            continue
        if loaders.parse(name) is not None or (role or "").startswith("the model for"):
            left.setdefault(_OTHER_FORM, []).append(name)
        elif role in framework.TRAINING_STATE:
            left.setdefault(_TRAINING, []).append(name)
        elif name in flagged:
            left.setdefault(_FLAGGED, []).append(name)
        elif contents.PICKLE_NAME.search(name) or is_checkpoint_file(full):
            left.setdefault(_CHECKPOINT, []).append(name)
        else:
            out.extras.append(Extra(name, full))
            (known if role else unknown).append(name)
    for sub in contents.subfolders(directory, dirs):
        if any(o.startswith(sub.name + "/") for o in own):
            continue  # the model itself is in it
        adapter = sub.adapter and fw.kind == "peft"  # PEFT's named adapter: copied as it is
        why = _TRAINING if sub.training else _HIDDEN if sub.name.startswith(".") else \
            sub.role if sub.checkpoints and not sub.module and not adapter else \
            f"more than {contents.MAX_WALKED} files" if sub.more else None
        if why is not None:
            left.setdefault(why, []).append(sub.name + "/")
            continue
        for f in sub.files:
            rel = f"{sub.name}/{f}"
            if rel in flagged:
                left.setdefault(_FLAGGED, []).append(rel)
            else:
                out.extras.append(Extra(rel, os.path.join(directory, sub.name, f)))
        if adapter:
            adapters.append(sub.name)
        if sub.module:
            weights += [f"{sub.name}/{f}" for f in sub.checkpoints
                        if f"{sub.name}/{f}" not in flagged]
        shown = f"{sub.name}/ ({len(sub.files)} file{'s' if len(sub.files) != 1 else ''})"
        (strange if sub.role == "folder" else folders).append(shown)
    if dtype is not None and fw.kind in NO_DTYPE:
        out.notes.append(NO_DTYPE[fw.kind].format(dtype=dtype))
    elif dtype is not None:
        out.extras = [_with_dtype(e, dtype, out.notes) if e.name == "config.json" else e
                      for e in out.extras]
    if dtype is not None and weights:
        out.notes.append(f"{_names(weights)}: a module's weights, copied as they are (not cast "
                         f"to {dtype}); SentenceTransformer casts its modules to the "
                         "transformer's dtype as it loads them")
    out.notes[:0] = _copied_notes(directory, files, folders + known, strange + unknown, left)
    if adapters:
        out.notes.append(_adapters_copied(adapters))
    return out


def _adapters_copied(names: list[str]) -> str:
    """What a PEFT folder's other adapters, copied as they are, are."""
    many = len(names) > 1
    return (f"the other PEFT adapter{'s' if many else ''} {_names(n + '/' for n in names)} "
            f"{'are' if many else 'is'} copied as {'they are' if many else 'it is'}, not "
            "converted (format and dtype as in the input): peft_model.load_adapter("
            f"OUT/{names[0]}, adapter_name={names[0]!r}) loads {'each' if many else 'it'}")


def adapters_note(source: Checkpoint, output: str) -> str | None:
    """What an ``output`` ("one file") of a PEFT folder's adapter leaves out:
    the folder's other adapters (PEFT's ``beta/``)."""
    fw = source.framework
    others = [a["name"] for a in fw.adapters if a["name"] != "default"] if fw else []
    if fw is None or fw.kind != "peft" or not others:
        return None
    many = len(others) > 1
    return (f"{output} holds the adapter read ({fw.adapters[0]['name']}) only: the other PEFT "
            f"adapter{'s' if many else ''} {_names(n + '/' for n in others)} of "
            f"{fw.directory} {'are' if many else 'is'} not converted; `--format hf` writes the "
            f"folder with {'them' if many else 'it'} (copied), or convert "
            f"{'each' if many else 'it'} by name")


def modules_note(source: Checkpoint, output: str) -> str | None:
    """What an ``output`` ("one file") of a sentence-transformers model
    leaves out: its modules."""
    fw = source.framework  # (a file named directly: its folder's modules.json all the same)
    if fw is None:
        return None
    modules = contents.st_modules(fw.directory)
    if not modules:
        return None
    return (f"{output} holds the transformer only: the sentence-transformers modules "
            f"{_names(m + '/' for m in modules)} are not in it, so SentenceTransformer would "
            "not load this model; `--format hf` writes the whole model folder")


def write_extras(extras: Iterable[Extra], outdir: AtomicDirectory) -> list[str]:
    """Write ``extras`` into ``outdir`` (each through its atomic output,
    folders made as needed); returns their names."""
    names = []
    for extra in extras:
        os.makedirs(os.path.dirname(os.path.join(outdir.path, extra.name)), exist_ok=True)
        with extra.open() as f, outdir.file(extra.name) as out:
            # (large reads: a remote file's each read is a request)
            shutil.copyfileobj(f, out.file, COPY_BUFFER)
            out.file.flush()
            out.commit()
        names.append(extra.name)
    return names


def config_with_dtype(data: bytes, dtype: str) -> tuple[bytes | None, str]:
    """A transformers ``config.json`` saying ``dtype`` (each of ``dtype`` and
    ``torch_dtype`` it has, nested configs' too; neither: the key its
    ``transformers_version`` writes), and what changed; None and why not."""
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, "config.json is not JSON: its dtype is left as it was"
    if not isinstance(config, dict) or "_class_name" in config or not (
            "model_type" in config or "architectures" in config):
        return None, "config.json is not a transformers config: its dtype is left as it was"
    changed = _set_dtype(config, dtype, "", 0)
    if not changed:
        key = "dtype" if _version(config.get("transformers_version")) >= (4, 56) \
            else "torch_dtype"
        config[key] = dtype
        changed = [f"{key} {dtype} (it had none)"]
    return (json.dumps(config, indent=2) + "\n").encode(), "; ".join(changed)


def _set_dtype(config: dict[str, Any], dtype: str, where: str, depth: int) -> list[str]:
    """Set each dtype key of ``config`` and of its nested model configs (a
    composite model's ``text_config``...); what each said before."""
    changed = []
    for key in ("dtype", "torch_dtype"):
        if key in config and (config[key] is None or isinstance(config[key], str)):
            changed.append(f"{where}{key} {config[key]} → {dtype}")
            config[key] = dtype
    for name, value in config.items():
        if depth < 3 and isinstance(value, dict) and "model_type" in value:
            changed += _set_dtype(value, dtype, f"{where}{name}.", depth + 1)
    return changed


def _version(text: Any) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", text) if isinstance(text, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _with_dtype(extra: Extra, dtype: str, notes: list[str]) -> Extra:
    """The model's ``config.json``, saying ``dtype``."""
    if fs.getsize(extra.path) > framework.MAX_JSON_BYTES:
        notes.append("config.json is too large to read: its dtype is left as it was")
        return extra
    with fs.open_binary(extra.path) as f:
        data, said = config_with_dtype(f.read(), dtype)
    if data is None:
        notes.append(said)
        return extra
    notes.append(f"config.json: {said}, as the weights are now, so that from_pretrained loads "
                 f"them as {dtype} (the input's config.json is unchanged)")
    return Extra(extra.name, extra.path, data)


def _own_files(source: Checkpoint, directory: str) -> set[str]:
    """The files of ``source`` itself, relative to ``directory``."""
    paths = [source.path] if source.directory is None else \
        [os.path.join(source.directory, f.path) for f in source.files]
    base = os.path.abspath(directory)
    return {os.path.relpath(os.path.abspath(p), base) for p in paths}


def _copied_notes(directory: str, files: list[str], known: list[str], unknown: list[str],
                  left: dict[str, list[str]]) -> list[str]:
    notes = []
    code = contents.remote_code(directory, files)
    if known:
        notes.append(f"copied {_names(known)} from {directory}, so that the framework "
                     "loads the output as it loads the input")
    if unknown:
        notes.append(f"copied {_names(unknown)} too, as they are: ckptool knows no role for "
                     f"{'them' if len(unknown) > 1 else 'it'}")
    notes += contents.code_lines(code, directory)  # what trust_remote_code runs
    for why, names in left.items():
        notes.append(f"not copied: {_names(names)} ({why})")
    return notes


def _names(names: Iterable[str]) -> str:
    shown = list(names)
    more = len(shown) - SHOWN
    return ", ".join(shown[:SHOWN]) + (f", … {more} more" if more > 0 else "")
