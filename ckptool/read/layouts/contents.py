"""What a framework folder holds beyond the model and the files beside it
(``ckptool.read.companions``): the custom code its configs name, and its
subfolders.

- ``remote_code``: the classes a config's ``auto_map`` names (``config.json``,
  ``tokenizer_config.json``, a processor's config), which
  ``from_pretrained(..., trust_remote_code=True)`` imports and runs, from a
  ``.py`` file of the folder (``modeling_tiny.TinyForCausalLM``) or from
  another repository (``org/repo--modeling_x.X``). ckptool only names them:
  no Python file is ever imported or run.
- ``subfolders``: each folder inside, with what it is (a sentence-transformers
  module that ``modules.json`` names, an ONNX export, a DeepSpeed tag, a
  Trainer ``checkpoint-N/``, a PEFT adapter that ``save_pretrained`` wrote
  in a subfolder named for it, a folder holding checkpoint files of its own),
  its files and their size.

Only names, sizes, a file's first bytes and small JSON files are read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from ckptool.read import fs
from ckptool.read.layouts import framework, journal, nested
from ckptool.read.layouts.names import holds_dcp, is_checkpoint_file, is_deepspeed_tag, listing

# the configs whose auto_map trust_remote_code follows
CODE_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json",
                "preprocessor_config.json")
MAX_WALKED = 10_000  # files counted in one subfolder
# files taken as pickles or checkpoints by name (their bytes may be any pickle)
PICKLE_NAME = re.compile(r"\.(pt|pth|pkl|pickle|ckpt)$")
_REFERENCE = re.compile(r"^(?:(?P<repo>[\w.-]+/[\w.-]+)--)?(?P<module>[\w.]+)\.(?P<cls>\w+)$")


# transformers' generate() imports custom_generate/generate.py of a model
# folder loaded with trust_remote_code=True, and calls it in its place
CUSTOM_GENERATE = ("custom generate code: from_pretrained(..., trust_remote_code=True) "
                   "imports custom_generate/generate.py and generate() runs it "
                   "(ckptool never does)")


@dataclass(frozen=True)
class RemoteCode:
    """One class an ``auto_map`` names."""

    config: str  # the file that names it: "config.json"
    auto: str  # the auto class it serves: "AutoModelForCausalLM"
    reference: str  # as written: "modeling_tiny.TinyForCausalLM"
    file: str | None  # its module in this folder ("modeling_tiny.py"); None: another repo's
    repo: str | None = None  # the repository it is downloaded from ("org/repo")
    present: bool = True  # whether ``file`` is in the folder


@dataclass(frozen=True)
class Subfolder:
    """A folder inside a framework folder."""

    name: str
    role: str
    files: tuple[str, ...]  # relative to the subfolder (at most MAX_WALKED)
    size: int
    checkpoints: tuple[str, ...] = ()  # its checkpoint or pickle files, relative to it
    module: bool = False  # a sentence-transformers module modules.json names
    training: bool = False  # what resuming training reads (a DeepSpeed tag)
    more: bool = False  # more files than MAX_WALKED
    adapter: bool = False  # a PEFT adapter other than the folder's own (PEFT's beta/)


def remote_code(directory: str, files: list[str] | None = None) -> list[RemoteCode]:
    """Every class the folder's configs name in ``auto_map`` (``files``: the
    folder's, if listed already)."""
    if files is None:
        files = [n for n in listing(directory) if fs.isfile(os.path.join(directory, n))]
    out = []
    for config in CODE_CONFIGS:
        data = framework.json_file(directory, config) if config in files else None
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if not isinstance(auto_map, dict):
            continue
        for auto, value in auto_map.items():
            refs = value if isinstance(value, list) else [value]  # a tokenizer's (slow, fast)
            for ref in refs:
                m = _REFERENCE.match(ref) if isinstance(ref, str) else None
                if m is None or not isinstance(auto, str):
                    continue
                module = m.group("module").rsplit(".", 1)[-1] if m.group("repo") else \
                    m.group("module")
                file = None if m.group("repo") else module.replace(".", "/") + ".py"
                out.append(RemoteCode(config, auto[:100], ref[:200], file, m.group("repo"),
                                      file is None or file in files))
    return out


def code_files(code: list[RemoteCode]) -> list[str]:
    """The folder's files that ``code`` names, once each, in order."""
    return list(dict.fromkeys(c.file for c in code if c.file is not None))


def code_lines(code: list[RemoteCode], where: str = "the folder") -> list[str]:
    """What ``code`` means for a user, a line for each kind: the folder's
    files that trust_remote_code runs, those named but missing, and code
    from other repositories."""
    def autos(found: list[RemoteCode]) -> str:
        by: dict[str, list[str]] = {}
        for c in found:
            by.setdefault(c.config, []).append(c.auto)
        return "; ".join(f"{config}: {', '.join(dict.fromkeys(a))}" for config, a in by.items())

    lines = []
    here = [c for c in code if c.file is not None and c.present]
    if here:
        lines.append(f"{', '.join(code_files(here))}: custom code that auto_map names "
                     f"({autos(here)}); from_pretrained(..., trust_remote_code=True) imports "
                     "and runs it (ckptool never does)")
    missing = [c for c in code if c.file is not None and not c.present]
    if missing:
        lines.append(f"{', '.join(code_files(missing))}: named by auto_map ({autos(missing)}) "
                     f"but not in {where}: trust_remote_code=True fails without it")
    other = [c for c in code if c.repo is not None]
    if other:
        repos = ", ".join(dict.fromkeys(c.repo for c in other if c.repo))
        lines.append(f"auto_map names code in {repos} ({autos(other)}): "
                     "from_pretrained(..., trust_remote_code=True) downloads and runs it")
    return lines


def st_modules(directory: str) -> dict[str, str]:
    """A sentence-transformers folder's modules by folder: ``{"2_Dense":
    "module 2 (Dense)"}`` (the module at the top, path "", left out)."""
    listed = framework.json_file(directory, "modules.json")
    out = {}
    for module in listed if isinstance(listed, list) else []:
        sub = module.get("path") if isinstance(module, dict) else None
        if not isinstance(sub, str) or not sub or "/" in sub or sub.startswith("."):
            continue
        kind = str(module.get("type", "")).rsplit(".", 1)[-1][:100] or "module"
        out[sub] = f"sentence-transformers module {str(module.get('name', sub))[:100]} ({kind})"
    return out


def subfolders(directory: str, dirs: list[str] | None = None) -> list[Subfolder]:
    """Each folder in ``directory`` (``dirs``, if listed already), with what it is."""
    if dirs is None:
        dirs = [n for n in listing(directory) if fs.isdir(os.path.join(directory, n))]
    modules = st_modules(directory) if fs.isfile(
        os.path.join(directory, "modules.json")) else {}
    out = []
    for name in sorted(dirs):
        path = os.path.join(directory, name)
        if fs.islink(path) or journal.is_temporary(name):
            continue
        files, size, more = _walk(path)
        dcp = holds_dcp(path)
        found = files if dcp else tuple(f for f in files if PICKLE_NAME.search(f)
                                        or is_checkpoint_file(os.path.join(path, f)))
        training = is_deepspeed_tag(path)
        if name in modules:
            role = modules[name]
        elif training:
            role = "a DeepSpeed checkpoint (training state)"
        elif name.startswith("."):
            role = "hidden: a repository's or a download's records"
        elif dcp:
            role = "a DCP checkpoint of its own"
        elif re.match(r"^checkpoint-\d+$", name):
            role = "a Trainer checkpoint of its own"
        elif found and (adapter := nested.adapter_in(path, "", name)) is not None:
            role = f"PEFT adapter {name!r} ({adapter.peft_type}), as save_pretrained names it"
        elif found:
            role = "holds checkpoint files of its own"
        elif any(f.endswith((".onnx", ".onnx_data")) for f in files):
            role = "ONNX export"
        elif name == "additional_chat_templates":
            role = "chat templates"
        elif name == "custom_generate" and "generate.py" in files:
            role = CUSTOM_GENERATE
        else:
            role = "folder"
        out.append(Subfolder(name, role, files, size, found, name in modules, training, more,
                             role.startswith("PEFT adapter")))
    return out


def _walk(path: str) -> tuple[tuple[str, ...], int, bool]:
    """The regular files under ``path`` (relative to it; links to files
    followed, as a Hugging Face cache's snapshot links its blobs; links to
    folders not), their total size, and whether there were more than
    MAX_WALKED."""
    files: list[str] = []
    size = 0
    for rel, n, full in _files_under(path):
        if journal.is_temporary(n) or not fs.regular(full):
            continue
        if len(files) == MAX_WALKED:
            return tuple(files), size, True
        files.append(rel)
        size += fs.getsize(full)
    return tuple(files), size, False


def _files_under(path: str) -> Iterator[tuple[str, str, str]]:
    """(path relative to ``path``, name, full path) of each file below it, in
    order; a link to a folder is not followed."""
    if fs.is_remote(path):
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            here = fs.join(path, rel_dir) if rel_dir else path
            listed = sorted(fs.entries(here))
            for n, is_dir, _ in listed:
                if not is_dir:
                    rel = f"{rel_dir}/{n}" if rel_dir else n
                    yield rel, n, fs.join(path, rel)
            stack.extend(f"{rel_dir}/{n}" if rel_dir else n
                         for n, is_dir, _ in reversed(listed) if is_dir)
        return
    for root, dirnames, names in os.walk(path):
        dirnames.sort()
        for n in sorted(names):
            full = os.path.join(root, n)
            yield os.path.relpath(full, path), n, full
