"""The framework folder a checkpoint was read from, and every other file in
it: a Trainer's optimizer, scheduler, RNG state and training arguments,
accelerate's random states, configs. Each pickle among them is read the
way the model is (safely: nothing runs), so that the folder's verdict
covers every file a framework would ``torch.load`` when resuming.

``framework_of`` is called by ``ckptool.read.reader`` once the model is
read: for a directory, with its companions; for a file the frameworks name
(``model.safetensors``, ``pytorch_model.bin``, ``adapter_model.safetensors``,
a shard), with its folder's config (or accelerate's ``random_states_0.pkl``) only.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from ckptool.errors import CkptoolError
from ckptool.model import Checkpoint, Companion, Framework
from ckptool.read import dispatch, fs, optim, prefixes
from ckptool.read.layouts import framework, loaders, recognise  # (journal, nested: a folder's)
from ckptool.read.layouts import names as names_mod
from ckptool.read.layouts.layout import DS_UNIVERSAL
from ckptool.read.layouts.names import SHARD_NAME
from ckptool.read.pickle import policy
from ckptool.read.tensors import TensorRecord

# files read as pickles (or torch files) to scan them: by name or by bytes
PICKLE_NAMES = re.compile(r"\.(pt|pth|bin|pkl|pickle|ckpt|safetensors)$")
# what an unreadable pickle beside the model is called in its verdict: torch
# or pickle would read it all the same, so ckptool cannot vouch for it
UNREADABLE = "<a file ckptool cannot read: torch.load would unpickle it all the same>"


def framework_of(path: str, layout: recognise.Layout | None,
                 ckpt: Checkpoint) -> Framework | None:
    """What the folder at (or around) ``path`` says about ``ckpt``."""
    if layout is None:  # a file named directly: its folder's config, if a framework named it
        name = os.path.basename(path)
        if name not in framework.MODEL_FILES and loaders.parse(name) is None \
                and not SHARD_NAME.search(name):
            return None
        directory = os.path.dirname(path) or "."
        names = [n for n in ("config.json", "adapter_config.json", "random_states_0.pkl") if
                 fs.isfile(os.path.join(directory, n))]  # (accelerate's: its names)
        facts = framework.folder_facts(directory, names, []) if names else None
        return _with_names(_with_adapters(facts), ckpt) if facts else None
    from ckptool.read.layouts import journal

    try:
        entries = sorted(fs.entries(path))
    except OSError:
        return None
    files = [n for n, _, is_file in entries if is_file and not journal.is_temporary(n)]
    dirs = [n for n, is_dir, _ in entries if is_dir]
    own = _own_files(path, layout, ckpt)
    others = [n for n in files if n not in own]
    read = os.path.basename(layout.file) if layout.file is not None else layout.index
    # every file: a payload in the 65th rank's file is as live as in the first
    found = [c for c in (_companion(path, n, read) for n in others) if c is not None]
    found += [c for n in _deepspeed_files(path, files, dirs, layout)
              if (c := _companion(path, n, read)) is not None]
    facts = framework.folder_facts(path, files, dirs)
    if facts is None:
        if not any(c.format or c.error for c in found):
            return None  # a plain folder with one checkpoint and a few notes in it
        here = fs.basename(path) + "/"
        facts = Framework("folder", path, f"a folder holding the model and "
                          f"{len(found)} other file{'s' if len(found) != 1 else ''} ({here})")
    if facts.kind == "sentence-transformers":
        found += _modules(path)
    return _with_names(_with_adapters(replace(facts, companions=tuple(found))), ckpt)


def _with_adapters(facts: Framework) -> Framework:
    """A PEFT folder's facts with every adapter in it (named ones in subfolders)."""
    if facts.kind != "peft":
        return facts
    from ckptool.read.layouts import nested

    return replace(facts, adapters=tuple(a.as_dict() for a in
                                         nested.peft_adapters(facts.directory)))


def _modules(directory: str) -> list[Companion]:
    """The weights of a sentence-transformers model's modules beyond the
    first (a ``Dense`` layer in ``2_Dense/``), each read and listed: the
    model is more than the transformer at the top."""
    listed = framework.json_file(directory, "modules.json")
    out = []
    for module in listed if isinstance(listed, list) else []:
        sub = module.get("path") if isinstance(module, dict) else None
        if not isinstance(sub, str) or not sub or "/" in sub or sub.startswith("."):
            continue
        folder = os.path.join(directory, sub)
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] or "module"
        for name in sorted(recognise.listing(folder))[:recognise.MAX_SNIFFED]:
            full = os.path.join(folder, name)
            if not recognise.is_checkpoint_file(full):
                continue
            role = f"module {module.get('name', sub)} ({kind}) weights"
            try:
                raw = dispatch.read(full)
            except CkptoolError as exc:
                out.append(Companion(f"{sub}/{name}", role, fs.getsize(full),
                                     error=exc.message.removeprefix(f"{full}: ")))
                continue
            shapes = [f"{k} {'x'.join(map(str, v.shape)) or 'scalar'}"
                      for k, v in raw.root.items() if isinstance(k, str)
                      and isinstance(v, TensorRecord)] if isinstance(raw.root, dict) else []
            verdicts = raw.seen.final()
            out.append(Companion(
                f"{sub}/{name}", role, fs.getsize(full), raw.format,
                tuple(n for n, v in verdicts.items() if v.category == policy.UNSAFE),
                tuple(n for n, v in verdicts.items() if v.category == policy.CUSTOM),
                detail=f"{len(shapes)} tensor{'s' if len(shapes) != 1 else ''}: "
                       f"{', '.join(shapes[:6])}{' …' if len(shapes) > 6 else ''}"))
    return out


def _own_files(path: str, layout: recognise.Layout, ckpt: Checkpoint) -> set[str]:
    """The files of ``path`` that are the checkpoint itself."""
    if layout.file is not None:
        return {os.path.basename(layout.file)}
    if os.path.abspath(layout.directory) == os.path.abspath(path):
        return {f.path for f in ckpt.files} | set(layout.extras)
    return set()


def _deepspeed_files(path: str, files: list[str], dirs: list[str],
                     layout: recognise.Layout) -> list[str]:
    """The files of the DeepSpeed tag directories beside the model (a
    Trainer's ``checkpoint-N/global_step10/``, and the one ``latest`` names,
    nested or not), which resuming ``torch.load``s: each read as a companion."""
    if layout.kind in (recognise.DEEPSPEED, DS_UNIVERSAL):
        return []  # the checkpoint read is itself DeepSpeed's
    tags = [d for d in dirs if names_mod.is_deepspeed_tag(os.path.join(path, d))]
    tag = names_mod.latest(path) if names_mod.LATEST in files else None
    if tag is not None and tag not in tags and names_mod.is_deepspeed_tag(
            os.path.join(path, tag)):
        tags.append(tag)
    return [f"{d}/{n}" for d in tags for n in sorted(recognise.listing(os.path.join(path, d)))
            if PICKLE_NAMES.search(n)]


def _companion(directory: str, name: str, read: str | None = None) -> Companion | None:
    """A file beside the model, read if it is a pickle (and ``scan``); None
    for one that is neither known to a framework nor a checkpoint. The
    framework's other weights are named beside ``read``, the model read (a
    variant of it, the same model in another format)."""
    full = os.path.join(directory, name)
    try:
        size = fs.getsize(full)
    except OSError:
        return None
    role = framework.role_of(name) or (loaders.role(name, read) if read else None)
    if role in framework.NOT_PICKLES and not _pickle_or_zip(full):
        # another runtime's raw bytes: nothing unpickles them (a pickle so
        # named is read as any other)
        return Companion(name, role, size)
    if not PICKLE_NAMES.search(name) and not (role is None and recognise.is_checkpoint_file(full)):
        return Companion(name, role, size) if role else None
    if size == 0:
        return Companion(name, role or "empty file", size, error="empty (0 bytes)")
    try:
        raw = dispatch.read(full)
    except CkptoolError as exc:
        why = exc.message.removeprefix(f"{full}: ")
        if name.endswith(".safetensors"):  # no pickle: loading it runs nothing
            return Companion(name, role or "a safetensors file", size, error=why)
        if role is None and not PICKLE_NAMES.search(name):
            return None  # a file that is no pickle by its name or its bytes
        # torch.load (or pickle) of it would read whatever it holds: unknown,
        # which fails closed (a PROTO 1 header, a pre-0.4 tar, a damaged file)
        return Companion(name, role or "a pickle or checkpoint file", size,
                         unsafe=(UNREADABLE,), error=why)
    verdicts = raw.seen.final()
    unsafe = tuple(n for n, v in verdicts.items() if v.category == policy.UNSAFE)
    custom = tuple(n for n, v in verdicts.items() if v.category == policy.CUSTOM)
    states = optim.find(raw.root)
    detail = optim.summary(states[0]) if states else None
    return Companion(name, role or "another checkpoint file (not the model read)", size,
                     raw.format, unsafe, custom, detail=detail)


def _pickle_or_zip(path: str) -> bool:
    """Whether ``path`` starts as a pickle (a protocol opcode) or a zip does:
    what torch.load would read, whatever the file is named."""
    try:
        with fs.open_binary(path) as f:
            head = f.read(2)
    except OSError:
        return True  # unreadable: read as any other, which says why
    return head[:1] == b"\x80" or head == b"PK"


def _with_names(facts: Framework, ckpt: Checkpoint) -> Framework:
    """``facts`` with the part of the state dict's prefix that is the
    framework's own naming: what a config says is the architecture's
    (``model.`` of a Llama), or PEFT's ``base_model.model.``."""
    sd = ckpt.main_state_dict
    if sd is None or not facts.evidence:
        return replace(facts, own_prefix="")
    prefix, entry = sd.prefix, ckpt.metadata.get("state_dict_entry")
    if isinstance(entry, str) and prefix.startswith(entry + "."):  # DCP's {"model": sd}
        prefix = prefix[len(entry) + 1:]
    _, rest = prefixes.split_wrappers(prefix)
    own = framework.own_naming(facts.kind, facts.model_type, rest)
    return replace(facts, own_prefix=rest if own else "")


def model_beside(path: str) -> str | None:
    """The model file a framework would load from the folder holding
    ``path`` (an optimizer's state, say): its path, or None."""
    directory = os.path.dirname(path) or "."
    try:
        names = sorted(fs.listdir(directory))
    except OSError:
        return None
    mine = os.path.basename(path)
    found = [n for n in names[:recognise.MAX_SNIFFED] if n != mine
             and recognise.is_checkpoint_file(os.path.join(directory, n))]
    model = framework.pick_model(found, framework.configures_model(names))
    return os.path.join(directory, model) if model else None


def why_no_weights(ckpt: Checkpoint) -> str:
    """Why ``ckpt`` has no state dict: an optimizer's state (and where the
    model is), or no dict of tensors at all."""
    states = [optim.OptimizerState.from_dict(s)
              for s in ckpt.metadata.get("optimizer_states") or ()]
    if not states:
        return ("no state dict found: no dict of tensors a model could load, so there are "
                "no keys to compare with a model")
    beside = model_beside(ckpt.path)
    where = (f"; the model's weights are in {beside}, beside it" if beside else
             "; the model's weights are saved in another file")
    return f"the file is {optim.wording(states)}, not a model's weights{where}"
