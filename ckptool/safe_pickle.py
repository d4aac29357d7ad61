"""A pickle reader that never imports or calls anything the file names.

``SafeUnpickler.find_class`` resolves each global to one of: a safe torch
rebuild function (``ckptool.tensors``), an inert value (``ckptool.values``),
or a ``StandIn`` class for that dotted name. Every global is recorded with
its ``ckptool.policy`` verdict, so callers can report unsafe ones.
Persistent ids (torch storages) go to a callback given by the format reader,
which turns them into ``StorageRef``s without reading any tensor byte.
"""

from __future__ import annotations

import _compat_pickle
import gc
import io
import pickle
from collections import Counter
from collections.abc import Callable
from typing import IO, Any

from ckptool import policy, tensors, values
from ckptool.errors import CorruptCheckpointError

PersistentLoader = Callable[[tuple[Any, ...]], Any]


class GlobalsSeen:
    """Every global a file named, with its verdict and how often."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.verdicts: dict[str, policy.Verdict] = {}

    def add(self, dotted: str, verdict: policy.Verdict) -> None:
        self.counts[dotted] += 1
        self.verdicts.setdefault(dotted, verdict)

    def unsafe(self) -> list[str]:
        return sorted(n for n, v in self.verdicts.items() if v.category == policy.UNSAFE)


class SafeUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], persistent: PersistentLoader | None,
                 seen: GlobalsSeen, embedded: dict[str, Any] | None = None) -> None:
        super().__init__(file)
        self._persistent = persistent
        self.seen = seen
        # storages of tensors pickled with plain pickle, keyed by storage id
        self.embedded = embedded if embedded is not None else {}

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise CorruptCheckpointError("pickle names a global that is not a string")
        # protocol 0-2 files written by Python 2 use old module names
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        dotted = f"{module}.{name}"
        verdict = policy.classify(module, name)
        self.seen.add(dotted, verdict)
        if dotted == "torch.storage._load_from_bytes":
            return self._load_from_bytes
        return resolve_global(module, name, verdict)

    def _load_from_bytes(self, data: Any) -> Any:
        """A storage pickled with plain pickle: an embedded legacy torch file."""
        from ckptool.formats import torch_legacy  # the format imports this module

        if not isinstance(data, bytes):
            raise CorruptCheckpointError("embedded storage is not bytes")
        raw = torch_legacy.read_bytes(data, f"embedded{len(self.embedded)}/")
        self.embedded.update(raw.storages)
        for name, count in raw.seen.counts.items():
            self.seen.counts[name] += count
            self.seen.verdicts.setdefault(name, raw.seen.verdicts[name])
        return raw.root

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CorruptCheckpointError("pickle refers to external data it does not carry")
        if not isinstance(pid, tuple):
            raise CorruptCheckpointError(f"unexpected persistent id: {pid!r:.80}")
        return self._persistent(pid)


def resolve_global(module: str, name: str, verdict: policy.Verdict) -> Any:
    """What a global becomes: never the real object, except inert builtins."""
    dotted = f"{module}.{name}"
    if verdict.category != policy.UNSAFE:
        rebuild = tensors.REBUILDERS.get(dotted)
        if rebuild is not None:
            return rebuild
        if module in ("torch", "torch.storage"):
            st = tensors.storage_type(name)
            if st is not None:
                return st
        if module == "torch":
            value = values.torch_value(name)
            if value is not None:
                return value
        if dotted == "torch.serialization._get_layout":
            return values.TorchConstant
        safe = values.safe_callable(dotted)
        if safe is not None:
            return safe
    return values.standin_class(dotted, verdict.category)


def load(data: bytes | IO[bytes], persistent: PersistentLoader | None,
         seen: GlobalsSeen, embedded: dict[str, Any] | None = None) -> Any:
    """Unpickle one object from ``data`` safely; format errors become CorruptCheckpointError."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    # unpickling makes many small objects and no cycles worth collecting:
    # the collector's passes over them cost more than the read itself
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return SafeUnpickler(stream, persistent, seen, embedded).load()
    except CorruptCheckpointError:
        raise
    except RecursionError as exc:
        raise CorruptCheckpointError("pickle nests too deeply to read") from exc
    except MemoryError as exc:
        raise CorruptCheckpointError("pickle asks for more memory than it could hold") from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
            IndexError, AttributeError, OverflowError, UnicodeDecodeError) as exc:
        # any of these is a malformed or truncated stream, or a hostile one
        # trying to use an inert stand-in in a way real data never does
        raise CorruptCheckpointError(f"cannot read pickle: {exc}") from exc
    finally:
        if gc_was_enabled:
            gc.enable()
