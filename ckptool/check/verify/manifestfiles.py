"""The files' part of checking a manifest (``manifest.check_manifest``):
each file it lists, missing, of another size, or of another sha256 (hashed
on ``jobs`` threads), and the checkpoint's files it does not list.

Two cases are not damage. A lone file renamed since the manifest was
written (``last.ckpt`` now ``epoch=3.ckpt``: one file each side, the same
layout and size) is compared under its new name, with a warning. A
manifest of the same model in another layout (a checkpoint and its
conversion) has other files by nature: the file differences are warnings,
and the tensors are compared one for one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptool.check.verify.filehash import Hashing, same_file
from ckptool.check.verify.problems import Problem
from ckptool.read import fs


def checkpoint_files(manifest: dict[str, Any], layout: str, root: str, manifest_path: str,
                     jobs: int, present: list[str]) -> list[Problem]:
    """The file problems of a checkpoint of ``layout`` whose files under
    ``root`` are ``present``, against ``manifest``."""
    same_layout = manifest["layout"] == layout
    files, renamed = renamed_file(manifest["files"], present, root, same_layout)
    problems = [Problem("manifest-file", f"the manifest names it {renamed}: compared under "
                        "its name here", file=present[0], severity="warning")] if renamed else []
    problems += file_problems(files, root, manifest_path, jobs, present)
    if same_layout:
        return problems
    said = Problem("manifest-file", f"the manifest is of a {manifest['layout']} checkpoint, "
                   f"this is {layout}: its files differ by nature, its tensors are compared "
                   "one for one", severity="warning")
    return [said, *(replace(p, severity="warning") for p in problems)]


def renamed_file(recorded: dict[str, Any], present: list[str], root: str,
                 same_layout: bool) -> tuple[dict[str, Any], str | None]:
    """A manifest's files as they are to be checked, and the name it gives
    a lone file renamed since (``last.ckpt`` now ``epoch=3.ckpt``: one file
    each side, the same layout and size), else None."""
    listed = list(recorded)
    if len(present) != 1 or len(listed) != 1 or present == listed or not same_layout:
        return recorded, None
    try:
        size = fs.getsize(fs.join(root, present[0]))
    except OSError:
        return recorded, None
    if size != recorded[listed[0]].get("size"):
        return recorded, None
    return {present[0]: recorded[listed[0]]}, listed[0]


def file_problems(recorded: dict[str, dict[str, Any]], root: str, manifest_path: str,
                  jobs: int, present: list[str] | None) -> list[Problem]:
    """Each file of ``recorded`` missing, of another size or sha256 under
    ``root``, and each of ``present`` it does not list."""
    problems: list[Problem] = []
    with Hashing(_sizes(recorded, root, problems), jobs) as hashing:
        _hashes(hashing, recorded, problems)
    problems += [Problem("manifest-extra", "not in the manifest", file=n) for n in present or ()
                 if n not in recorded and not same_file(fs.join(root, n), manifest_path)]
    return problems


def _sizes(recorded: dict[str, dict[str, Any]], root: str,
           problems: list[Problem]) -> dict[str, str]:
    """Files missing or of another size than recorded (as problems); the
    paths of the others, to hash."""
    paths: dict[str, str] = {}
    for name, entry in sorted(recorded.items()):
        path = fs.join(root, name)
        try:
            size = fs.getsize(path)
        except FileNotFoundError:
            problems.append(Problem("manifest-missing", f"missing: the manifest lists it "
                                    f"({entry['size']} bytes)", file=name))
            continue
        except OSError as exc:
            problems.append(Problem("unreadable", f"cannot read it ({exc.strerror})", file=name))
            continue
        if size != entry["size"]:
            problems.append(Problem("manifest-file", f"{size} bytes, the manifest says "
                                    f"{entry['size']}", file=name))
            continue
        paths[name] = path
    return paths


def _hashes(hashing: Hashing, recorded: dict[str, dict[str, Any]],
            problems: list[Problem]) -> None:
    """Files whose sha256 is not the one recorded (as problems)."""
    for name in sorted(hashing.paths):
        try:
            _, sha = hashing.result(name)
        except OSError as exc:
            problems.append(Problem("unreadable", f"cannot read it ({exc.strerror})", file=name))
            continue
        then = recorded[name]["sha256"]
        if sha != then:
            problems.append(Problem("manifest-file", f"content differs from the manifest "
                                    f"(sha256 {sha[:12]}…, the manifest says {then[:12]}…)",
                                    file=name))


