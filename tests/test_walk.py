"""Walking the object tree: key paths, aliases, entries, and the bounds
that keep hostile shapes cheap."""

from __future__ import annotations

import tracemalloc

from ckptool.read import summary, walk
from ckptool.read.tensors import StorageRef, TensorRecord


def tensor() -> TensorRecord:
    ref = StorageRef("0", "float32", "cpu", 4)
    return TensorRecord((4,), "float32", (1,), 0, ref, "cpu")


def test_keys_join_containers_with_slash() -> None:
    t = tensor()
    out = walk.walk({"state_dict": {"module.w": t}, "opt": [{"m": t}], "epoch": 3})
    assert [k for k, _ in out.tensors] == ["state_dict/module.w", "opt/0/m"]
    assert [k for k, _ in out.entries] == ["epoch"]
    assert [(c.path, c.names) for c in out.candidates] == [
        ("state_dict", ["module.w"]), ("opt/0", ["m"])]


def test_shared_container_is_walked_once_and_reported_as_alias() -> None:
    sd = {"w": tensor()}
    out = walk.walk({"model": sd, "ema": sd})
    assert [k for k, _ in out.tensors] == ["model/w"]
    assert out.aliases == [("ema", "model")]


def test_deep_chain_costs_linear_memory() -> None:
    depth = 9_000
    node: object = {"w": tensor()}
    for _ in range(depth):
        node = [node]
    tracemalloc.start()
    out = walk.walk(node)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    (key, _), = out.tensors
    assert key == "0/" * depth + "w"
    # quadratic path strings would need ~80 MB here; links need a few MB
    assert peak < 20_000_000


def test_plain_value_gives_up_on_large_shared_structures() -> None:
    shared = list(range(64))
    assert summary.plain_value([shared] * 64) is None  # 4,096 values > budget
    assert summary.plain_value({"lr": 0.1, "dims": [1, 2]}) == {"lr": 0.1, "dims": [1, 2]}
    assert summary.plain_value(float("nan")) == "nan"
