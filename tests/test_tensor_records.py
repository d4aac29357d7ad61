"""A tensor's record, as the rebuild calls of a pickle make it: every view
must lie inside its storage, whatever the sizes, strides and dtypes claim."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from ckptool.errors import CorruptCheckpointError
from ckptool.read import tensors
from ckptool.read.values import TorchDtype


def storage(dtype: str = "float32", numel: int = 16) -> tensors.StorageRef:
    return tensors.StorageRef("0", dtype, "cpu", numel, "archive/data/0")


@pytest.mark.parametrize(("offset", "size", "stride"), [
    (0, (4, 4), (4, 1)),  # the whole storage
    (15, (1,), (1,)),  # its last element
    (0, (4, 4), (1, 4)),  # transposed
    (0, (16, 1000), (1, 0)),  # expanded: zero strides touch nothing new
    (16, (0, 5), (5, 1)),  # empty: touches nothing, wherever it starts
    (3, (), ()),  # a scalar
])
def test_views_inside_the_storage_are_records(offset: int, size: tuple[int, ...],
                                             stride: tuple[int, ...]) -> None:
    ref = storage()
    rec = tensors.rebuild_tensor_v2(ref, offset, size, stride, True, OrderedDict())
    assert (rec.shape, rec.stride, rec.storage_offset, rec.dtype, rec.storage, rec.location,
            rec.requires_grad, rec.extra) == (size, stride, offset, "float32", ref, "cpu",
                                              True, None)


@pytest.mark.parametrize(("offset", "size", "stride"), [
    (1, (4, 4), (4, 1)),  # one element past the end
    (16, (1,), (1,)),
    (0, (4, 5), (4, 1)),
    (0, (2, 4), (13, 1)),  # a stride that jumps past it
])
def test_a_view_past_its_storage_is_refused(offset: int, size: tuple[int, ...],
                                            stride: tuple[int, ...]) -> None:
    with pytest.raises(CorruptCheckpointError, match="reaches past the end of storage 0"):
        tensors.rebuild_tensor_v2(storage(), offset, size, stride, False, OrderedDict())


def test_a_typed_view_of_bytes_is_measured_in_bytes() -> None:
    raw = storage("uint8", 64)  # 64 bytes: 16 float32 elements
    rec = tensors.rebuild_tensor_v3(raw, 0, (4, 4), (4, 1), False, OrderedDict(),
                                    TorchDtype("float32"))
    assert rec.dtype == "float32"
    with pytest.raises(CorruptCheckpointError, match="reaches past"):
        tensors.rebuild_tensor_v3(raw, 1, (4, 4), (4, 1), False, OrderedDict(),
                                  TorchDtype("float32"))
    with pytest.raises(CorruptCheckpointError, match="reaches past"):  # 8 bytes a float64
        tensors.rebuild_tensor_v3(raw, 0, (3, 3), (3, 1), False, OrderedDict(),
                                  TorchDtype("float64"))


@pytest.mark.parametrize(("offset", "size", "stride", "message"), [
    (-1, (1,), (1,), "bad tensor storage offset"),
    (0, (2, 2), (1,), "differ in length"),
    (0, (2, -1), (1, 1), "not a tuple of sizes"),
    (0, (2, 1.0), (1, 1), "not a tuple of sizes"),
    (0, (2**40, 2**40), (0, 0), "more elements than torch can index"),
    ("0", (1,), (1,), "bad tensor storage offset"),
])
def test_bad_sizes_are_refused(offset: object, size: tuple[object, ...],
                               stride: tuple[object, ...], message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        tensors.rebuild_tensor_v2(storage(), offset, size, stride, False, OrderedDict())


def test_state_and_schemes_go_to_a_records_own_extra() -> None:
    plain = tensors.rebuild_tensor_v2(storage(), 0, (2,), (1,), False, OrderedDict())
    other = tensors.rebuild_tensor_v2(storage(), 0, (2,), (1,), False, OrderedDict())
    assert plain.extra is None
    kept = tensors.rebuild_parameter(plain, True, OrderedDict(), {"note": 1})
    assert kept.extra == {"state": {"note": 1}} and other.extra is None
