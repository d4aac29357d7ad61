"""What each global named by a pickle becomes: never the real object.

``resolve_global`` maps a dotted name (already classified by
``ckptool.read.pickle.policy``) to a safe torch rebuild function, an inert value, or a
recording ``StandIn``. Inside ``faithful()`` (reads for a rewrite) tensor
rebuilds also record their call and nothing is decoded, so that
``ckptool.write.repickle`` can write the pickle back exactly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from ckptool.read import constructors, tensors, values
from ckptool.read.pickle import policy

_faithful = contextvars.ContextVar("ckptool_faithful", default=False)


@contextlib.contextmanager
def faithful() -> Iterator[None]:
    """Read for a rewrite: keep what is needed to write the pickle back as is.

    Tensor rebuilds record their call (``TensorRecord.origin``), and every
    other global but dtypes, storage types and ``OrderedDict`` stays a
    recording stand-in: no value is decoded (a numpy scalar stays a call,
    not an int), so writing the tree back reproduces the file's own pickle.
    """
    token = _faithful.set(True)
    try:
        yield
    finally:
        _faithful.reset(token)


def is_faithful() -> bool:
    """Whether this read is one for a rewrite (inside ``faithful()``)."""
    return _faithful.get()


def resolve_global(module: str, name: str, verdict: policy.Verdict) -> Any:
    """What a global becomes: never the real object, except inert builtins."""
    dotted = f"{module}.{name}"
    if _faithful.get() and verdict.category != policy.UNSAFE:
        if dotted in tensors.REBUILDERS:
            return tensors.traced(dotted)
        if module in ("torch", "torch.storage") and tensors.storage_type(name) is not None:
            return tensors.storage_type(name)
        if module == "torch" and isinstance(values.torch_value(name), values.TorchDtype):
            return values.torch_value(name)
        if dotted == "collections.OrderedDict":
            return constructors.safe_callable(dotted)
        return values.standin_class(dotted, verdict.category)
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
        safe = constructors.safe_callable(dotted)
        if safe is not None:
            return safe
    return values.standin_class(dotted, verdict.category)
