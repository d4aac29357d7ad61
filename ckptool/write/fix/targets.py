"""Where ``fix`` may write: never over its input, over a file only with
``--force``, and in its input's format (an output named for the other
format is a mistake that only shows when the file will not load).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptool.errors import UsageError
from ckptool.read.formats.safetensors_fmt import SAFETENSORS

# what checkpoint files end with: ".fixed" goes before all of them (x.pth.tar)
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".tar", ".safetensors", ".pkl",
                       ".pickle", ".model", ".weights")


def check_target(src: str, target: str, force: bool) -> None:
    """The output path must not be the input, nor a file to keep."""
    if not os.path.lexists(target):
        return
    if os.path.exists(target) and os.path.samefile(target, src):
        raise UsageError("the output would overwrite the input",
                         "choose another path with -o, or pass --in-place")
    if not force:
        raise UsageError(f"{target} already exists",
                         "pass --force to overwrite it, or -o to choose another path")


def check_suffix(fmt: str, target: str) -> None:
    """fix writes its input's format: an output named for the other one is a
    mistake that only shows when the file will not load."""
    suffix = Path(target).suffix.lower()
    torch_name = suffix in (".pth", ".pt", ".bin", ".ckpt", ".tar", ".pkl")
    if (fmt == SAFETENSORS and torch_name) or (fmt != SAFETENSORS and suffix == ".safetensors"):
        wants = "torch" if torch_name else "safetensors"
        raise UsageError(
            f"fix writes {fmt}, as its input is, and {Path(target).name} is named for {wants}",
            f"to change formats use `ckptool convert IN {Path(target).name}`; or name the "
            f"output for {fmt}")
