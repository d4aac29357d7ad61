"""ckptool: inspect, diagnose and fix PyTorch checkpoints safely.

``ckptool.open(path)`` reads any checkpoint's metadata into a pure data
model without running code from the file, reading tensor bytes, or
importing torch, click, rich or textual.
"""

from ckptool.errors import CkptoolError
from ckptool.model import Checkpoint, Entry, GlobalInfo, StateDictInfo, StorageInfo, TensorInfo
from ckptool.reader import open_checkpoint as open

__version__ = "0.1.0"
__all__ = [
    "Checkpoint", "CkptoolError", "Entry", "GlobalInfo", "StateDictInfo",
    "StorageInfo", "TensorInfo", "__version__", "open",
]
