"""Folders whose checkpoints sit one level down, in subfolders named for
what they are: a Hugging Face cache repository, and PEFT's named adapters.

- huggingface_hub keeps a repository as ``models--org--name/`` with
  ``blobs/``, ``refs/main`` (the commit of the revision downloaded) and
  ``snapshots/<commit>/`` (its files, as links to the blobs): the model is
  in the snapshot ``refs/main`` names, which a path to the repository or to
  its ``snapshots/`` is refused naming.
- PEFT's ``save_pretrained`` of a model with several adapters writes the one
  named ``default`` at the top (``adapter_config.json``,
  ``adapter_model.safetensors``) and each other one in a subfolder named for
  it (``beta/adapter_config.json``...); without a ``default`` adapter the top
  holds none (``alpha/``, ``beta/``), and ``PeftModel.from_pretrained`` of
  the folder fails: ``peft_adapters`` lists them, ``refuse`` names them.
- sentence-transformers keeps each module in a folder ``modules.json``
  names (``1_Dense/``); an older model, or a Router's, keeps its transformer
  there too (``0_Transformer/``, ``query_0_Transformer/``):
  ``st_module_paths`` lists them.

Only names and small JSON files are read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ckptool.describe import plural, shell_word
from ckptool.errors import InputError
from ckptool.read import fs
from ckptool.read.layouts import framework

REPO_DIR = re.compile(r"^(models|datasets|spaces)--.+")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # as PEFT looks
SHOWN = 8  # adapters a message names


@dataclass(frozen=True)
class Adapter:
    """One PEFT adapter of a folder."""

    name: str  # "default" at the top, else its subfolder's name
    peft_type: str  # "LORA", "IA3"...
    path: str  # its weights (or config, where it has none), relative to the folder
    r: int | None = None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "peft_type": self.peft_type, "path": self.path,
                "r": self.r}


def peft_adapters(directory: str) -> tuple[Adapter, ...]:
    """Every PEFT adapter of ``directory``: its own (``default``), then each
    subfolder's, by name."""
    try:
        names = sorted(n for n, is_dir, _ in fs.entries(directory) if is_dir)
    except OSError:
        names = []
    found = [adapter_in(directory, "", "default")]
    found += [adapter_in(os.path.join(directory, n), n + "/", n) for n in names]
    return tuple(a for a in found if a is not None)


def adapter_in(folder: str, rel: str, name: str) -> Adapter | None:
    """The PEFT adapter ``folder`` holds (``rel``: the folder as its path
    starts, ``name``: what it is called), or None."""
    config = framework.json_file(folder, "adapter_config.json")
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        return None
    weights = next((w for w in ADAPTER_WEIGHTS if fs.isfile(os.path.join(folder, w))),
                   "adapter_config.json")
    r = config.get("r")
    return Adapter(name, config["peft_type"][:40], rel + weights, r if type(r) is int else None)


def refuse(path: str, dirs: list[str]) -> None:
    """Raise where ``path`` (no checkpoint of its own) holds its checkpoints
    one level down: a Hugging Face cache repository, or PEFT adapters in
    subfolders."""
    full = os.path.abspath(path)
    if REPO_DIR.match(os.path.basename(full)) and "snapshots" in dirs:
        _refuse_cache(path, full, "")
    parent = os.path.dirname(full)
    if os.path.basename(full) == "snapshots" and REPO_DIR.match(os.path.basename(parent)):
        _refuse_cache(path, parent, "snapshots/")
    adapters = [a for a in peft_adapters(path) if a.name != "default"]
    if adapters:
        named = [shell_word(os.path.join(path, a.name)) for a in adapters[:SHOWN]]
        raise InputError(
            f"{path} holds "
            f"{plural(len(adapters), 'PEFT adapter') if len(adapters) > 1 else 'a PEFT adapter'}"
            f" in {'subfolders' if len(adapters) > 1 else 'a subfolder'} "
            f"({', '.join(a.name + '/' for a in adapters[:SHOWN])}) and none at its top: "
            "PeftModel.from_pretrained of it finds no adapter_config.json",
            f"name one: ckptool inspect {', or '.join(named)}")


def _refuse_cache(path: str, repo: str, given: str) -> None:
    """The error for a cache repository ``repo`` (``path``: it, or its
    ``snapshots/``), naming the snapshot ``refs/main`` names."""
    snapshots = os.path.join(repo, "snapshots")
    try:
        found = sorted(n for n, is_dir, _ in fs.entries(snapshots) if is_dir)
    except OSError:
        found = []
    commit = _ref_main(repo)
    what = f"{path} is {'the snapshots of ' if given else ''}a Hugging Face cache repository"
    if commit in found or len(found) == 1:
        chosen = commit if commit in found else found[0]
        why = "the revision refs/main names" if commit == chosen else "its only snapshot"
        assert chosen is not None
        named = os.path.join(path, chosen) if given else os.path.join(path, "snapshots", chosen)
        raise InputError(f"{what}: its files are in snapshots/{chosen} ({why})",
                         f"name it: ckptool inspect {shell_word(named)}")
    if not found:
        raise InputError(f"{what} with no snapshot in it",
                         "download the model again (huggingface_hub.snapshot_download)")
    raise InputError(f"{what} holding {len(found)} snapshots and no refs/main naming one",
                     f"name one: ckptool inspect {shell_word(os.path.join(snapshots, found[0]))}")


def _ref_main(repo: str) -> str | None:
    """The commit ``refs/main`` names, or None."""
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            commit = f.read(100).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if commit and "/" not in commit and not commit.startswith(".") else None


def st_module_paths(path: str) -> list[str]:
    """The module folders a sentence-transformers ``modules.json`` names
    (``0_Transformer``; a Router's ``query_0_Transformer``...)."""
    listed = framework.json_file(path, "modules.json")
    out = []
    for module in listed if isinstance(listed, list) else []:
        sub = module.get("path") if isinstance(module, dict) else None
        if isinstance(sub, str) and sub and "/" not in sub and not sub.startswith("."):
            out.append(sub)
    router = framework.json_file(path, "router_config.json")  # a Router's routes
    routes = router.get("types") if isinstance(router, dict) else None
    out += [p for p in routes if isinstance(p, str) and "/" not in p
            and not p.startswith(".")] if isinstance(routes, dict) else []
    # the transformers first: what a user most likely wants to read
    return sorted(dict.fromkeys(out), key=lambda p: "Transformer" not in p)
