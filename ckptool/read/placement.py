"""Where ``ckptool.load`` and ``load_state_dict`` put each storage:
``map_location`` as torch takes it (a device, a dict of saved tag to tag, a
callable), and, with none, the saved device when this machine has it, else
a ``LoadError`` saying which is missing and how to map it. A device named as
the destination is checked the same way before torch is asked to move
anything (no GPU, an index past the count, a kind this build lacks, a
malformed string), so every layout fails alike. Also the view of a storage
as a tensor both build.
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
        import torch

        self.map_location = map_location
        self._usable: set[str] = set()  # devices checked to be on this machine
        if isinstance(map_location, (str, torch.device)):
            self._check_target(str(map_location))  # before any byte is read

    def target(self, tag: str) -> str | None:
        """The device a storage saved on ``tag`` goes to (None: a callable decides)."""
        import torch

        ml = self.map_location
        if ml is None:
            self._check_saved(tag)
            return tag
        if isinstance(ml, (str, torch.device)):
            return str(ml)
        if isinstance(ml, dict):
            to = ml.get(tag, tag)
            if str(to) == tag:
                self._check_saved(tag)
            else:
                self._check_target(str(to))
            return str(to)
        if callable(ml):
            return None
        raise LoadError(f"map_location {ml!r} is not a device, a dict or a callable",
                        "pass 'cpu', torch.device('cuda:0'), {'cuda:2': 'cuda:0'} or a function")

    def _check_saved(self, tag: str) -> None:
        if tag in self._usable:
            return
        missing = unusable(tag)
        if missing:
            raise LoadError(f"the checkpoint was saved on {tag}: {missing}",
                            "pass map_location='cpu', or map the tag: map_location={"
                            + repr(tag) + ": " + repr(_instead(tag)) + "}")
        self._usable.add(tag)

    def _check_target(self, device: str) -> None:
        if device in self._usable:
            return
        missing = unusable(device)
        if missing:
            raise LoadError(f"map_location {device!r}: {missing}",
                            f"pass map_location={_instead(device)!r}")
        self._usable.add(device)

    def storage(self, storage: torch.UntypedStorage, tag: str) -> torch.UntypedStorage:
        target = self.target(tag)
        if target is None:
            fn: Callable[[Any, str], Any] = self.map_location
            try:
                moved = fn(storage, tag)
            except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
                # torch's own: a device this machine lacks, said as torch says it
                raise LoadError(f"map_location's function failed on a storage saved on "
                                f"{tag}: {type(exc).__name__}: {exc}",
                                "return a storage on a device this machine has (`ckptool "
                                "devices` lists them), or pass map_location='cpu'") from exc
            return storage if moved is None else moved
        if target == "cpu":
            return storage
        if target == "meta":  # (storage.to refuses it: "META device module is not loaded")
            import torch

            return torch.UntypedStorage(storage.nbytes(), device="meta")
        return storage.to(device=target)

    def tensor(self, value: torch.Tensor, tag: str) -> torch.Tensor:
        target = self.target(tag)
        if target is None:
            storage = self.storage(value.untyped_storage(), tag)
            return view(storage, value.dtype, tuple(value.shape), tuple(value.stride()),
                         int(value.storage_offset()))
        return value if target == "cpu" else value.to(target)


def unusable(device: str) -> str:
    """Why torch cannot put a storage on ``device`` on this machine ("" when
    it can): not a device string torch knows, a kind this machine has none
    of, an index past its count."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return "not a device torch knows ('cpu', 'cuda:0', 'mps'...)"
    kind, index = parsed.type, parsed.index
    if kind in ("cpu", "meta"):
        return ""
    backend = getattr(torch, kind, None)
    available = getattr(backend, "is_available", None)
    count_of = getattr(backend, "device_count", None)
    count = 0
    if callable(available) and available():
        count = int(count_of()) if callable(count_of) else 1
    name = kind.upper() if kind in ("cuda", "mps", "xpu", "hpu", "mtia") else repr(kind)
    if count == 0:
        return f"this machine has no {name} device"
    if index is not None and index >= count:
        shown = ", ".join(f"{kind}:{i}" for i in range(min(count, 4)))
        more = ", ..." if count > 4 else ""
        return f"this machine has {count} {name} device{'s' if count > 1 else ''} ({shown}{more})"
    return ""


def _instead(device: str) -> str:
    """The device to suggest in place of ``device``: its kind's first one,
    when this machine has it, else the CPU."""
    kind = device.partition(":")[0]
    first = f"{kind}:0"
    if kind not in ("cpu", "meta") and kind != device and not unusable(first):
        return first
    return "cpu"


def view(storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple[int, ...],
          stride: tuple[int, ...], offset: int) -> torch.Tensor:
    import torch

    t = torch.empty((0,), dtype=dtype, device=storage.device)
    t.set_(storage, offset, shape, stride)
    return t
