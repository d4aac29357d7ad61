"""Where ``ckptool.load`` and ``load_state_dict`` put each storage:
``map_location`` as torch takes it (a device, a dict of saved tag to tag, a
callable), and, with none, the saved device when this machine has it, else
a ``LoadError`` saying which is missing and how to map it. Also the view of
a storage as a tensor both build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptool.errors import CkptoolError

if TYPE_CHECKING:
    import torch

MapLocation = Any  # str | torch.device | dict[str, str] | Callable | None


class LoadError(CkptoolError):
    """``ckptool.load`` refused a checkpoint, or could not place it."""


class Placement:
    """Where each storage goes, as ``map_location`` says (see ``load``)."""

    def __init__(self, map_location: MapLocation) -> None:
        self.map_location = map_location

    def target(self, tag: str) -> str | None:
        """The device a storage saved on ``tag`` goes to (None: a callable decides)."""
        import torch

        ml = self.map_location
        if ml is None:
            _check_available(tag)
            return tag
        if isinstance(ml, (str, torch.device)):
            return str(ml)
        if isinstance(ml, dict):
            to = ml.get(tag, tag)
            if to == tag:
                _check_available(tag)
            return str(to)
        if callable(ml):
            return None
        raise LoadError(f"map_location {ml!r} is not a device, a dict or a callable",
                        "pass 'cpu', torch.device('cuda:0'), {'cuda:2': 'cuda:0'} or a function")

    def storage(self, storage: torch.UntypedStorage, tag: str) -> torch.UntypedStorage:
        target = self.target(tag)
        if target is None:
            fn: Callable[[Any, str], Any] = self.map_location
            moved = fn(storage, tag)
            return storage if moved is None else moved
        if target == "cpu":
            return storage
        return storage.to(device=target)

    def tensor(self, value: torch.Tensor, tag: str) -> torch.Tensor:
        target = self.target(tag)
        if target is None:
            storage = self.storage(value.untyped_storage(), tag)
            return view(storage, value.dtype, tuple(value.shape), tuple(value.stride()),
                         int(value.storage_offset()))
        return value if target == "cpu" else value.to(target)


def _check_available(tag: str) -> None:
    import torch

    kind, _, index = tag.partition(":")
    if kind == "cpu" or kind == "meta":
        return
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index or 0) < count:
            return
        raise LoadError(
            f"the checkpoint was saved on {tag}, and this machine has "
            f"{'no CUDA GPU' if count == 0 else f'{count} CUDA GPU(s)'}",
            "pass map_location='cpu', or map the tag: map_location={" + repr(tag) + ": 'cuda:0'}")
    backend = getattr(torch.backends, kind, None)
    available = getattr(backend, "is_available", None)
    if not (callable(available) and available()):
        raise LoadError(f"the checkpoint was saved on {tag}, which this machine does not have",
                        f"pass map_location='cpu', or map the tag: map_location={{{tag!r}: 'cpu'}}")


def view(storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple[int, ...],
          stride: tuple[int, ...], offset: int) -> torch.Tensor:
    import torch

    t = torch.empty((0,), dtype=dtype, device=storage.device)
    t.set_(storage, offset, shape, stride)
    return t
