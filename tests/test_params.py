"""Parameter counting (``ckptool.read.params``): ``count`` over a list gives
what ``ParameterCount.add`` gives one tensor at a time (the browser adds
batches as they are read)."""

from __future__ import annotations

import random

import pytest

from ckptool.model import TensorInfo
from ckptool.read import params

DTYPES = ["float32", "bfloat16", "int64", "bool", "complex64", "uint8"]
NAMES = ["weight", "bias", "running_mean", "num_batches_tracked", "inv_freq", "a/b.c"]


def random_tensors(rng: random.Random) -> list[TensorInfo]:
    out: list[TensorInfo] = []
    for i in range(rng.randint(0, 40)):
        if out and rng.random() < 0.2:  # a second name of a tensor already listed
            twin = rng.choice(out)
            out.append(TensorInfo(f"tie{i}.{rng.choice(NAMES)}", twin.shape, twin.dtype,
                                  twin.stride, twin.storage_offset, twin.storage,
                                  twin.location, twin.nbytes, is_parameter=twin.is_parameter))
            continue
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
        storage = None if rng.random() < 0.1 else str(rng.randint(0, 5))
        out.append(TensorInfo(f"m{i}.{rng.choice(NAMES)}", shape, rng.choice(DTYPES),
                              (1,) * len(shape), rng.randint(0, 2), storage, "cpu", 0,
                              is_parameter=rng.random() < 0.3))
    return out


@pytest.mark.parametrize("seed", range(100))
def test_count_is_add_one_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    ts = random_tensors(rng)
    module = rng.random() < 0.5
    counted = params.count(ts, module=module)
    one = params.ParameterCount(exact=module and any(t.is_parameter for t in ts))
    for t in ts:
        one.add(t)
    assert (counted.parameters, counted.buffers) == (one.parameters, one.buffers)
    assert counted._seen == one._seen
