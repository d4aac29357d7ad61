"""Tensors sent while a pickle is read (``open_checkpoint(path, on_tensors=...)``).

Every partial TensorInfo must be one the finished read lists, under the same
key and equal to it; the finished read must be the same with or without the
callback; and where the main state dict sits in plain dicts, the partial
batches must cover it. Files are the bundled samples, files torch.save writes
here, and a few pickles written opcode by opcode.
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import struct
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SAMPLES, saved_on
from nets import Net

from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import observe
from ckptool.read.pickle import unpickler
from ckptool.read.reader import open_checkpoint
from ckptool.read.seen import GlobalsSeen

SAMPLE_FILES = sorted(p for p in SAMPLES.iterdir() if p.suffix != ".py")
# samples whose main state dict is a dict the stack places: their partial batches cover it
COVERED_SAMPLES = {"dataparallel_cuda2.pth", "finetuned_v2.pth", "hostile_runs_code.pth",
                   "legacy_compiled_ddp.pth", "lightning.ckpt"}


def read_partial(path: Path) -> tuple[Checkpoint, list[list[TensorInfo]]]:
    batches: list[list[TensorInfo]] = []
    ckpt = open_checkpoint(path, on_tensors=batches.append)
    return ckpt, batches


def check_partial(ckpt: Checkpoint, batches: list[list[TensorInfo]]) -> list[TensorInfo]:
    """Each partial tensor is the finished read's tensor of that key; none is sent twice."""
    assert all(batches), "an empty batch was sent"
    partial = [t for batch in batches for t in batch]
    final = {t.key: t for t in ckpt.tensors}
    keys = [t.key for t in partial]
    assert len(keys) == len(set(keys)), "a tensor was sent twice"
    assert [k for k in keys if k not in final] == []
    for t in partial:
        assert t == final[t.key], t.key
    return partial


def assert_covers_main_state_dict(ckpt: Checkpoint, partial: list[TensorInfo]) -> None:
    sd = ckpt.main_state_dict
    assert sd is not None and sd.kind == "dict"
    expected = {sd.tensor_key(k) for k in sd.keys} & {t.key for t in ckpt.tensors}
    assert expected
    assert expected <= {t.key for t in partial}


def assert_same_read(a: Checkpoint, b: Checkpoint) -> None:
    for f in fields(Checkpoint):
        if f.name != "root":  # inert objects: equal only to themselves
            assert getattr(a, f.name) == getattr(b, f.name), f.name


def check_file(path: Path) -> tuple[Checkpoint, list[TensorInfo]]:
    ckpt, batches = read_partial(path)
    partial = check_partial(ckpt, batches)
    assert_same_read(ckpt, open_checkpoint(path))
    return ckpt, partial


def state_dict(n: int = 3, prefix: str = "") -> collections.OrderedDict[str, torch.Tensor]:
    return collections.OrderedDict(
        (f"{prefix}layers.{i}.weight", torch.full((2, i + 1), float(i))) for i in range(n))


# -- the bundled samples ----------------------------------------------------


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.name)
def test_samples(path: Path) -> None:
    ckpt, partial = check_file(path)
    if path.name in COVERED_SAMPLES:
        assert_covers_main_state_dict(ckpt, partial)


def test_hostile_sample_reads_identically_with_an_observer() -> None:
    path = SAMPLES / "hostile_runs_code.pth"
    plain = open_checkpoint(path)
    observed, batches = read_partial(path)
    assert_same_read(observed, plain)
    assert observed.unsafe_globals == plain.unsafe_globals != []
    check_partial(observed, batches)


# -- files torch.save writes ------------------------------------------------


def _optimizer_state(model: torch.nn.Module) -> dict[str, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 3, 4, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("partial")
    model = Net(8)
    sd = model.state_dict()
    big = state_dict(3500, "module.")
    files: dict[str, Any] = {
        "root": sd,
        "nested": {"epoch": 3, "state_dict": sd, "args": argparse.Namespace(lr=0.1)},
        "model_optimizer": {"model": sd, "optimizer": _optimizer_state(model)},
        "whole_module": model,
        "big": {"epoch": 1, "state_dict": big, "optimizer": {"state": {}}},
    }
    paths = {}
    for name, obj in files.items():
        paths[name] = folder / f"{name}.pth"
        with saved_on("cuda:1"):
            torch.save(obj, paths[name])
    paths["legacy"] = folder / "legacy.pth"
    torch.save({"epoch": 3, "state_dict": sd}, paths["legacy"],
               _use_new_zipfile_serialization=False)
    paths["plain_pickle"] = folder / "plain.pkl"
    with open(paths["plain_pickle"], "wb") as f:
        pickle.dump({"epoch": 3, "state_dict": sd}, f, protocol=2)
    return paths


@pytest.mark.parametrize("name", ["root", "nested", "model_optimizer", "legacy", "big",
                                  "plain_pickle"])
def test_partial_tensors_cover_the_state_dict(saved: dict[str, Path], name: str) -> None:
    ckpt, partial = check_file(saved[name])
    assert_covers_main_state_dict(ckpt, partial)


def test_big_state_dict_arrives_in_several_batches(saved: dict[str, Path]) -> None:
    ckpt, batches = read_partial(saved["big"])
    check_partial(ckpt, batches)
    assert len(batches) >= 4  # 3500 tensors, 1000 per SETITEMS
    assert sum(map(len, batches)) == 3500
    assert all(t.location == "cuda:1" for batch in batches for t in batch)


def test_whole_module_sends_nothing(saved: dict[str, Path]) -> None:
    # its tensors sit in BUILD states, which the stack cannot place
    ckpt, batches = read_partial(saved["whole_module"])
    assert batches == []
    assert ckpt.tensors


def test_optimizer_state_under_int_keys_is_not_sent(saved: dict[str, Path]) -> None:
    ckpt, batches = read_partial(saved["model_optimizer"])
    partial = check_partial(ckpt, batches)
    assert {t.key.split("/")[0] for t in partial} == {"model"}
    assert any(t.key.startswith("optimizer/") for t in ckpt.tensors)


# -- shapes the stack could misread: what is sent must still be right --------


class Call:
    """Pickles as Call(*args): a ("k", d) in them is a call's arguments, not dict items."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (Call, self.args)


def _shapes() -> dict[str, Any]:
    sd = state_dict()
    return {
        "empty_dict_before": {"cfg": {}, "state_dict": sd},
        "dict_before": {"cfg": {"lr": 0.1, "bs": 2}, "state_dict": sd},
        "single_item_chain": {"a": {"b": {"c": sd}}},
        "list_of_dicts": [sd, state_dict(2, "b.")],
        "tuple_of_4": {"a": (1, "k", "j", sd)},
        "tuple_after_empty_dict": {"a": [{}, ("p", "q", "k", sd)]},
        "namespace_before": {"args": argparse.Namespace(a=1), "model": sd},
        "call_arguments": {"e": 1, "a": Call("k", sd)},
        # the key's MARK follows a finished dict: not a batch of that dict
        "call_in_a_key": {"x": {"a": 1}, (Call(1, "k", sd), 2, 3, 4): 0},
        "class_value_before": {"cls": collections.OrderedDict, "model": sd},
        "slash_and_empty_keys": {"a/b": {"c/d": torch.zeros(1)}, "": {"": torch.ones(1)}},
        "batch_boundary": {"m": state_dict(1001)},
        "int_keys": {0: sd, "x": {1: torch.zeros(1)}},
        "same_dict_twice": {"a": sd, "b": sd},
        "storage_alone": {"s": torch.zeros(3).untyped_storage(), "t": torch.ones(2)},
    }


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("shape", sorted(_shapes()))
def test_what_is_sent_is_right(tmp_path: Path, shape: str, protocol: int) -> None:
    path = tmp_path / f"{shape}.pth"
    torch.save(_shapes()[shape], path, pickle_protocol=protocol)
    ckpt, partial = check_file(path)
    if shape in ("single_item_chain", "batch_boundary", "dict_before", "namespace_before"):
        assert_covers_main_state_dict(ckpt, partial)


@pytest.mark.xfail(strict=True, reason="TUPLE1-3 come after their items: a dict that "
                   "becomes an item of a short tuple is sent where it sat on the stack")
@pytest.mark.parametrize("shape", ["pair_at_root", "triple_in_dict"])
def test_blind_spot_short_tuples(tmp_path: Path, shape: str) -> None:
    sd = state_dict()
    obj = (sd, {"lr": 0.1}) if shape == "pair_at_root" else {"e": 1, "a": (1, "k", sd)}
    torch.save(obj, tmp_path / "t.pth")
    check_file(tmp_path / "t.pth")


# -- no observer, other threads, errors ---------------------------------------


def test_nothing_is_called_without_an_observer(saved: dict[str, Path]) -> None:
    calls: list[Any] = []
    with observe.observe(lambda path, pairs: calls.append(path)):
        pass
    open_checkpoint(saved["nested"])
    assert calls == []
    reader = unpickler.SafeUnpickler(io.BytesIO(), lambda pid: None, GlobalsSeen())
    assert reader._dispatch is unpickler.SafeUnpickler.dispatch


def test_an_observer_sees_only_its_own_thread(saved: dict[str, Path]) -> None:
    calls: list[Any] = []
    other: list[Checkpoint] = []
    with observe.observe(lambda path, pairs: calls.append(path)):
        thread = threading.Thread(target=lambda: other.append(open_checkpoint(saved["nested"])))
        thread.start()
        thread.join()
    assert other and other[0].tensors
    assert calls == []


def test_an_observer_error_propagates_as_is(saved: dict[str, Path]) -> None:
    class Boom(Exception):
        pass

    def fail(batch: list[TensorInfo]) -> None:
        raise Boom

    def lookup(batch: list[TensorInfo]) -> None:
        raise KeyError(batch[0].key)

    with pytest.raises(Boom):
        open_checkpoint(saved["nested"], on_tensors=fail)
    with pytest.raises(KeyError):  # not turned into "cannot read pickle"
        open_checkpoint(saved["nested"], on_tensors=lookup)


def test_legacy_header_pickles_are_not_observed(saved: dict[str, Path]) -> None:
    from ckptool.read import dispatch

    seen: list[tuple[tuple[str, ...], list[Any]]] = []
    with observe.observe(lambda path, pairs: seen.append((path, [k for k, _ in pairs]))):
        dispatch.read(str(saved["legacy"]))
    keys = {k for _, ks in seen for k in ks}
    assert "protocol_version" not in keys  # sys_info, the third of five pickles
    assert {"epoch", "state_dict"} <= keys


# -- pickles written opcode by opcode -------------------------------------------


def g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def meta_tensor(n: int) -> bytes:
    """_rebuild_meta_tensor_no_storage(float32, (n,), (1,)): a tensor with no storage."""
    return (g("torch._utils", "_rebuild_meta_tensor_no_storage") + g("torch", "float32")
            + b"K" + bytes([n]) + b"\x85" + b"K\x01\x85" + b"\x87R")


MARK, EMPTY_DICT, SETITEMS, SETITEM, DICT = b"(", b"}", b"u", b"s", b"d"


def put(n: int) -> bytes:
    return b"q" + bytes([n])


def get(n: int) -> bytes:
    return b"h" + bytes([n])


def write_pickle(tmp_path: Path, body: bytes) -> Path:
    path = tmp_path / "hand.pkl"
    path.write_bytes(b"\x80\x02" + body + b".")
    return path


def test_dict_opcode_results_are_sent(tmp_path: Path) -> None:
    path = write_pickle(tmp_path, MARK + s("w") + meta_tensor(2) + s("b") + meta_tensor(3) + DICT)
    ckpt, batches = read_partial(path)
    partial = check_partial(ckpt, batches)
    assert [t.key for t in partial] == ["w", "b"]
    assert partial[0].location == "meta"


def test_a_dict_filled_again_from_the_memo_is_not_sent(tmp_path: Path) -> None:
    # {"a": d, "b": d}, then keys set on d where it sits as "b": the finished
    # read lists them under "a" (where d was first made), so "b/w" must not be sent
    body = (EMPTY_DICT + put(0) + MARK + s("a") + EMPTY_DICT + put(1) + s("b") + get(1)
            + MARK + s("w") + meta_tensor(2) + s("v") + meta_tensor(1) + SETITEMS + SETITEMS)
    ckpt, batches = read_partial(write_pickle(tmp_path, body))
    check_partial(ckpt, batches)
    assert batches == []
    assert {t.key for t in ckpt.tensors} == {"a/w", "a/v"}


def test_a_key_set_twice_stops_reports(tmp_path: Path) -> None:
    body = (EMPTY_DICT + MARK + s("w") + meta_tensor(2) + s("w") + meta_tensor(3) + SETITEMS
            + s("v") + meta_tensor(1) + SETITEM)
    ckpt, batches = read_partial(write_pickle(tmp_path, body))
    assert batches == []
    assert {t.key: t.shape for t in ckpt.tensors} == {"w": (3,), "v": (1,)}


def test_embedded_legacy_files_do_not_report(tmp_path: Path) -> None:
    # a plain pickle holding a legacy torch file read by torch.storage._load_from_bytes:
    # the embedded file's own dict ("w") sits under "x" in the finished read
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    body = (EMPTY_DICT + s("x") + g("torch.storage", "_load_from_bytes")
            + b"B" + struct.pack("<I", len(data)) + data + b"\x85R" + SETITEM)
    ckpt, batches = read_partial(write_pickle(tmp_path, body))
    check_partial(ckpt, batches)
    assert batches == []
    assert [t.key for t in ckpt.tensors] == ["x/w"]
