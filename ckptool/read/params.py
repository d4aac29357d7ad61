"""What counts as a parameter: the number ``sum(p.numel() for p in
model.parameters())`` gives, read from a state dict without the model.

A state dict holds parameters and persistent buffers side by side, and a
tied weight (an embedding shared with the output layer) under each of its
names. Counted here:

- a tensor that shares storage, offset, shape, stride and dtype with one
  already counted is the same tensor under another name: counted once;
- in a pickled ``nn.Module`` (or any file that keeps ``nn.Parameter``), a
  parameter is exactly what was saved as one, the rest are buffers;
- elsewhere, by name and dtype: integer and boolean tensors
  (``num_batches_tracked``, ``position_ids``, masks) and the running
  statistics of normalization layers (``running_mean``, ``running_var``)
  are buffers. Other buffers (a rotary ``inv_freq``) cannot be told from
  weights without the model: they count as parameters.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from ckptool import dtypes
from ckptool.model import TensorInfo

# the last dotted name of buffers every normalization layer keeps
BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def identity(t: TensorInfo) -> Hashable:
    """Two names with the same identity are one tensor (a tie)."""
    if t.storage is None:
        return ("key", t.key)
    return (t.storage, t.storage_offset, t.shape, t.stride, t.dtype)


@dataclass
class ParameterCount:
    """Running totals over tensors added in any number of batches."""

    exact: bool = False  # parameters are known as saved (nn.Parameter), not by name
    parameters: int = 0  # elements
    buffers: int = 0  # elements
    _seen: set[Hashable] = field(default_factory=set, repr=False)

    def add(self, t: TensorInfo) -> tuple[int, int]:
        """Count ``t``: (parameter elements, buffer elements) it adds; (0, 0)
        for a second name of a tensor already counted."""
        return self.add_all((t,))

    def add_all(self, tensors: Iterable[TensorInfo]) -> tuple[int, int]:
        """Count ``tensors`` (``add`` each, in one loop: a state dict can
        hold 100,000): the (parameter, buffer) elements they add."""
        seen, exact = self._seen, self.exact
        parameters = buffers = 0
        for t in tensors:
            ident = identity(t)
            if ident in seen:
                continue
            seen.add(ident)
            if is_buffer(t, exact):
                buffers += math.prod(t.shape)
            else:
                parameters += math.prod(t.shape)
        self.parameters += parameters
        self.buffers += buffers
        return parameters, buffers


def is_buffer(t: TensorInfo, exact: bool) -> bool:
    if t.is_parameter or exact:
        return not t.is_parameter
    return not dtypes.is_floating(t.dtype) or t.key.rsplit(".", 1)[-1] in BUFFER_NAMES


def count(tensors: Iterable[TensorInfo], module: bool = False) -> ParameterCount:
    """Parameters and buffers of one state dict's tensors; ``module``: they
    are a pickled module's, whose parameters were saved as such."""
    ts = list(tensors)
    counter = ParameterCount(exact=module and any(t.is_parameter for t in ts))
    counter.add_all(ts)
    return counter
