"""ckptool: inspect, diagnose and fix PyTorch checkpoints safely.

``ckptool.open(path)`` reads any checkpoint's metadata into a pure data
model without running code from the file, reading tensor bytes, or
importing torch, click, rich or textual. ``ckptool.diagnose``,
``ckptool.fix``, ``ckptool.convert``, ``ckptool.diff_checkpoints``,
``ckptool.load`` (a safe ``torch.load``) and ``ckptool.load_state_dict`` (the
weights a model takes) are loaded on first use, so that reading stays as
light as it is; ``open`` and the data model are too, so that what needs
neither (``ckptool --version``, ``import ckptool.errors``) loads no layer.

The package is in layers, and imports run one way, from each layer to the
ones before it (``tests/test_layers.py`` checks every import, and that no
two modules import each other round a loop):

1. the top level: this public API, ``errors``, the data model (``model``),
   ``dtypes`` and shared wording (``describe``);
2. ``read``: the safe reading layer, a file in and a ``Checkpoint`` out;
3. ``write``: rewrites as a pipeline (plan, lay out, copy, verify, commit);
4. ``check``: what is wrong, where to load it, how two files differ;
5. the views: ``tui`` (the browser), then ``cli`` (the command line, which
   starts the browser).
"""

from typing import TYPE_CHECKING, Any

from ckptool.errors import CkptoolError

if TYPE_CHECKING:
    from ckptool.model import (
        Checkpoint,
        Entry,
        GlobalInfo,
        StateDictInfo,
        StorageInfo,
        TensorInfo,
    )
    from ckptool.read.reader import open_checkpoint as open

__version__ = "0.1.0"
__all__ = [
    "Checkpoint", "CkptoolError", "Entry", "FixOptions", "GlobalInfo", "StateDictInfo",
    "StorageInfo", "TensorInfo", "__version__", "convert", "diagnose", "diff_checkpoints",
    "fix", "load", "load_state_dict", "open",
]

# loaded on first use, even ``open`` and the data model: ``ckptool --version``
# and every ``import ckptool.x`` run this file, and need neither
_LAZY = {
    "open": ("ckptool.read.reader", "open_checkpoint"),
    **{name: ("ckptool.model", name) for name in (
        "Checkpoint", "Entry", "GlobalInfo", "StateDictInfo", "StorageInfo", "TensorInfo")},
    "diagnose": ("ckptool.check.diagnosis", "diagnose"),
    "fix": ("ckptool.write.fix.run", "fix"),
    "FixOptions": ("ckptool.write.fix.plan", "FixOptions"),
    "convert": ("ckptool.write.convert.run", "convert"),
    "diff_checkpoints": ("ckptool.check.diff", "diff_checkpoints"),
    "load": ("ckptool.read.materialize", "load"),
    "load_state_dict": ("ckptool.check.loading", "load_state_dict"),
}


# modules an earlier layout had at the top level, for ``from ckptool import gpus``
_MOVED = {"gpus": "ckptool.check.gpus.machine", "modelspec": "ckptool.check.modelspec"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _MOVED:
        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'ckptool' has no attribute {name!r}")
