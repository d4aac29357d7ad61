"""``inspect --json``'s tensor and storage lines, written straight as text.

A report of 100,000 tensors spends more time building a dict per tensor and
encoding it than reading the file; the common tensor (a plain strided one
in one file) and storage are written here by string formatting instead,
giving exactly the text ``json.JSONEncoder`` writes for ``tensor_dict`` and
``storage_dict`` (tests/test_json_lines.py compares them on every sample).
Anything less common is encoded from its dict as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from json.encoder import encode_basestring_ascii as text
from typing import Any

from ckptool.cli.common import Encoded
from ckptool.model import StorageInfo, TensorInfo

_encode = json.JSONEncoder(default=repr).encode


def _nullable(value: str | None) -> str:
    return "null" if value is None else text(value)


def _ints(values: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(int.__repr__, values)) + "]"


def _plain(t: TensorInfo) -> bool:
    return (not t.parts and t.file is None and not t.chunks and t.stride is not None
            and type(t.storage_offset) is int and type(t.nbytes) is int
            and type(t.requires_grad) is bool and type(t.is_parameter) is bool
            and type(t.key) is str and type(t.dtype) is str and type(t.layout) is str
            and (t.subclass is None or type(t.subclass) is str))


def tensor_lines(tensors: Iterable[TensorInfo],
                 as_dict: Callable[[TensorInfo], dict[str, Any]]) -> Encoded:
    lines = Encoded()
    add = lines.append
    ints: dict[tuple[int, ...], str] = {}  # shapes and strides repeat: each written once
    for t in tensors:
        if not _plain(t):
            add(_encode(as_dict(t)))
            continue
        assert t.stride is not None
        shape = ints.get(t.shape) or ints.setdefault(t.shape, _ints(t.shape))
        stride = ints.get(t.stride) or ints.setdefault(t.stride, _ints(t.stride))
        add(f'{{"key": {text(t.key)}, "shape": {shape}, "dtype": {text(t.dtype)}, '
            f'"stride": {stride}, "storage_offset": {t.storage_offset!r}, '
            f'"storage": {_nullable(t.storage)}, "location": {_nullable(t.location)}, '
            f'"nbytes": {t.nbytes!r}, "requires_grad": {"true" if t.requires_grad else "false"}, '
            f'"is_parameter": {"true" if t.is_parameter else "false"}, '
            f'"layout": {text(t.layout)}, "subclass": {_nullable(t.subclass)}}}')
    return lines


def storage_lines(storages: Iterable[StorageInfo],
                  as_dict: Callable[[StorageInfo], dict[str, Any]]) -> Encoded:
    lines = Encoded()
    add = lines.append
    for s in storages:
        if s.file is not None or type(s.nbytes) is not int:
            add(_encode(as_dict(s)))
            continue
        keys = ", ".join(map(text, s.tensors))
        add(f'{{"id": {text(s.id)}, "dtype": {text(s.dtype)}, '
            f'"location": {_nullable(s.location)}, "nbytes": {s.nbytes!r}, '
            f'"record": {_nullable(s.record)}, "tensors": [{keys}]}}')
    return lines
