"""The C unpickler's fast path (``ckptool.read.fastpickle``): each point of
its safety argument, and that it reads exactly what the ordinary read does.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool.errors import CorruptCheckpointError
from ckptool.read import constructors, fastpickle, pickles
from ckptool.read.pickle.unpickler import SafeUnpickler
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef, StorageType, TensorRecord

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def data_pkl(obj: Any, tmp_path: Path, **save: Any) -> bytes:
    _REFS.clear()
    path = tmp_path / "x.pt"
    torch.save(obj, path, **save)
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


_REFS: dict[str, StorageRef] = {}


def persistent(pid: tuple[Any, ...]) -> StorageRef:
    """As a format reader's: one record per storage key."""
    _, stype, key, location, numel = pid
    return _REFS.setdefault(key, StorageRef(key, stype.dtype, location, numel))


def both(data: bytes) -> tuple[Any, Any, GlobalsSeen, GlobalsSeen]:
    """The fast read (asserted to be taken) and the ordinary one."""
    fast_seen, slow_seen = GlobalsSeen(), GlobalsSeen()
    assert fastpickle.load(io.BytesIO(data), persistent) is not None, "not taken"
    fast = pickles.load(data, persistent, fast_seen)
    slow = SafeUnpickler(io.BytesIO(data), persistent, slow_seen).load()
    return fast, slow, fast_seen, slow_seen


def same(a: Any, b: Any) -> None:
    """Equal trees: same types, keys, values, records and sharing."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        assert vars(a) == vars(b) if hasattr(a, "__dict__") else True
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, TensorRecord):
        assert (a.shape, a.dtype, a.stride, a.storage_offset, a.location, a.requires_grad,
                a.is_parameter, a.extra) == (b.shape, b.dtype, b.stride, b.storage_offset,
                                             b.location, b.requires_grad, b.is_parameter,
                                             b.extra)
        assert (a.storage.key, a.storage.dtype, a.storage.numel) == (
            b.storage.key, b.storage.dtype, b.storage.numel)
    else:
        assert a == b


def seen_equal(a: GlobalsSeen, b: GlobalsSeen) -> None:
    assert a.counts == b.counts and a.verdicts == b.verdicts and a.where == b.where


# -- it reads what torch.save writes, exactly as the ordinary read ------------

def optimizer_state() -> dict[str, Any]:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.99))
    net(torch.randn(5, 3)).sum().backward()
    opt.step()
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
            "loss": 0.25, "name": "run", "flags": [True, None], "shape": (2, 3)}


@pytest.mark.parametrize("make", [
    lambda: OrderedDict(a=torch.zeros(2, 3), b=torch.ones(3).t(), s=torch.tensor(1.0)),
    lambda: torch.nn.Linear(4, 5).state_dict(),
    lambda: {"w": torch.nn.Parameter(torch.ones(2, 2)), "v": torch.zeros(4, 4)[1:, ::2]},
    optimizer_state,
    lambda: {"x": torch.zeros(2, 3, 4, 5, 6), "y": torch.zeros(0), "big": torch.zeros(300)},
], ids=["ordered", "linear", "param-view", "optimizer", "dims"])
def test_torch_save_reads_the_same_both_ways(make: Any, tmp_path: Path) -> None:
    data = data_pkl(make(), tmp_path)
    fast, slow, fast_seen, slow_seen = both(data)
    same(fast, slow)
    seen_equal(fast_seen, slow_seen)


def test_sharing_survives(tmp_path: Path) -> None:
    base = torch.zeros(4, 4)
    fast, _, _, _ = both(data_pkl({"a": base, "b": base[1:], "c": base}, tmp_path))
    assert fast["a"].storage is fast["b"].storage
    assert fast["a"] is fast["c"]


def test_every_sample_inspects_the_same_with_and_without(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.cli.inspect import inspect_dict

    files = [p for p in sorted((ROOT / "samples").iterdir())
             if p.suffix in (".pth", ".pt", ".ckpt")]
    files += sorted((ROOT / "tests" / "fixtures").rglob("*.pt"))[:40]
    taken = []
    real = fastpickle.load

    def spy(stream: io.BytesIO, pers: Any) -> Any:
        out = real(stream, pers)
        taken.append(out is not None)
        return out

    for path in files:
        monkeypatch.setattr(fastpickle, "load", spy)
        try:
            fast = inspect_dict(ckptool.open(path))
        except ckptool.CkptoolError as exc:
            fast = str(exc)
        monkeypatch.setattr(fastpickle, "load", lambda stream, pers: None)
        try:
            slow = inspect_dict(ckptool.open(path))
        except ckptool.CkptoolError as exc:
            slow = str(exc)
        assert fast == slow, path
    assert any(taken) and not all(taken)  # both ways were exercised


# -- 1. only the grammar: no EXT, no copyreg cache ----------------------------

TORCH_PREFIX = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01"


def test_ext_opcodes_never_go_fast_nor_reach_copyregs_cache() -> None:
    code = 0xF3
    copyreg.add_extension("builtins", "print", code)
    try:
        assert pickle.loads(b"\x80\x02\x82\xf3.") is print  # the cache now holds print
        data = TORCH_PREFIX + b"\x82\xf3u."
        assert fastpickle.scan(data) is None
        seen = GlobalsSeen()
        obj = pickles.load(data, persistent, seen)
        assert obj["a"] is not print
        assert "builtins.print" in seen.counts  # named by the registry, as a stand-in
    finally:
        copyreg.remove_extension("builtins", "print", code)


@pytest.mark.parametrize("op", [b"\x81", b"\x92", b"o", b"i", b"2", b"\x8f", b"\x91", b"\x90",
                                b"\x97", b"\x98", b"\x96", b"I1\n", b"V\n", b"S''\n"])
def test_opcodes_outside_the_grammar_go_the_ordinary_way(op: bytes) -> None:
    assert fastpickle.scan(TORCH_PREFIX + op + b"u.") is None


def test_the_grammar_reads_a_whole_torch_pickle(tmp_path: Path) -> None:
    data = data_pkl(optimizer_state(), tmp_path)
    assert fastpickle.scan(data) == len(data) - 1


# -- 2. bounded hashing -------------------------------------------------------

def test_deep_tuple_key_is_refused_without_a_crash(tmp_path: Path) -> None:
    """A tuple nested 1,000,000 deep as a key: the C unpickler would crash the
    process hashing it; the scan sends it the ordinary way, which refuses it."""
    data = b"\x80\x02}q\x00)" + b"\x85" * 1_000_000 + b"K\x01s."
    assert fastpickle.scan(data) is None
    script = ("import sys; from ckptool.read import pickles; from ckptool.read.seen import "
              "GlobalsSeen\ntry:\n    pickles.load(open(sys.argv[1], 'rb').read(), "
              "lambda p: None, GlobalsSeen())\nexcept Exception as e:\n    print(type(e).__name__)")
    path = tmp_path / "deep.pkl"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "CorruptCheckpointError", out


def test_tuples_of_fetched_items_are_not_fast() -> None:
    # (t, t) at each level through the memo: 2**depth to hash
    doubling = b"".join(b"h%cq%c" % (i, i + 1) + b"h%c\x86q%c" % (i + 1, i + 1)
                        for i in range(1, 60))
    assert fastpickle.scan(b"\x80\x02}q\x00K\x01\x85q\x01" + doubling + b"K\x01s.") is None
    assert fastpickle.scan(b"\x80\x02}q\x00h\x00h\x00\x86K\x01s.") is None
    assert fastpickle.scan(b"\x80\x02}q\x00(h\x00tK\x01s.") is None


def test_flat_tuple_keys_and_values_are_fast() -> None:
    data = b"\x80\x02}q\x00(K\x01K\x02\x86q\x01X\x01\x00\x00\x00vK\x01K\x02K\x03\x87G?\xe0" \
           b"\x00\x00\x00\x00\x00\x00\x85\x88\x89N\x87(K\x01K\x02K\x03K\x04tu."
    fast, slow, _, _ = both(data)
    same(fast, slow)
    assert fast == {(1, 2): "v", (1, 2, 3): (0.5,), (True, False, None): (1, 2, 3, 4)}


# -- 3. the memo --------------------------------------------------------------

def test_memo_indices_are_bounded_by_the_pickles_size() -> None:
    assert fastpickle.memo_bits(100) == 16
    assert fastpickle.memo_bits(1 << 20) == 20
    assert fastpickle.memo_bits((1 << 21) - 1) == 20
    assert fastpickle.memo_bits(1 << 40) == 32
    small = b"\x80\x02}r" + struct.pack("<I", (1 << 16) - 1) + b"."
    assert fastpickle.scan(small) == len(small) - 1
    for index in (1 << 16, 1 << 24, 1 << 30, (1 << 32) - 1):
        assert fastpickle.scan(b"\x80\x02}r" + struct.pack("<I", index) + b".") is None
    padded = b"\x80\x02}r" + struct.pack("<I", (1 << 20) - 1) + b"N0" * (1 << 19) + b"."
    assert fastpickle.scan(padded) is not None  # a 1 MiB pickle may index 2**20


# -- 4. globals ---------------------------------------------------------------

def test_other_globals_go_the_ordinary_way_and_count_once(tmp_path: Path) -> None:
    import argparse

    data = data_pkl({"args": argparse.Namespace(lr=0.1), "w": torch.zeros(2)}, tmp_path)
    stream = io.BytesIO(data)
    assert fastpickle.load(stream, persistent) is None and stream.tell() == 0
    seen = GlobalsSeen()
    pickles.load(data, persistent, seen)
    assert seen.counts["argparse.Namespace"] == 1
    assert seen.counts["torch._utils._rebuild_tensor_v2"] == 1


def test_unsafe_globals_are_never_resolved_by_the_fast_path() -> None:
    data = b"\x80\x02}q\x00(X\x01\x00\x00\x00acos\nsystem\nq\x01u."
    assert fastpickle.scan(data) is not None  # GLOBAL is in the grammar...
    assert fastpickle.load(io.BytesIO(data), persistent) is None  # ...os.system is not
    seen = GlobalsSeen()
    assert pickles.load(data, persistent, seen)["a"] is not __import__("os").system
    # named by the ordinary read; only referenced, it is data (nothing calls it)
    assert "os.system" in seen.counts and seen.unsafe() == []


# -- 5. BUILD -----------------------------------------------------------------

ORDERED = b"ccollections\nOrderedDict\nq\x01"


def test_build_on_a_global_is_refused() -> None:
    target = constructors.safe_callable("collections.OrderedDict")
    data = b"\x80\x02}q\x00(X\x01\x00\x00\x00a" + ORDERED + b"}X\x01\x00\x00\x00xK\x01sbu."
    assert fastpickle.load(io.BytesIO(data), persistent) is None
    with pytest.raises(CorruptCheckpointError):
        pickles.load(data, persistent, GlobalsSeen())
    assert not hasattr(target, "x")


def test_build_sets_metadata_on_an_ordered_dict_it_made(tmp_path: Path) -> None:
    sd = torch.nn.Linear(2, 2).state_dict()
    fast, slow, _, _ = both(data_pkl(sd, tmp_path))
    assert fast._metadata == slow._metadata == sd._metadata


def test_records_refuse_state() -> None:
    ref = StorageRef("0", "float32", "cpu", 4)
    rec = TensorRecord((2,), "float32", (1,), 0, ref, "cpu")
    for obj in (ref, rec, StorageType("FloatStorage", "float32")):
        with pytest.raises(pickle.UnpicklingError):
            obj.__setstate__((None, {"shape": (1 << 40,)}))
    assert rec.shape == (2,)


def test_build_on_a_tensor_record_goes_the_ordinary_way(tmp_path: Path) -> None:
    data = data_pkl({"w": torch.zeros(2)}, tmp_path)
    # set the record's shape through BUILD's slot state, right after its REDUCE
    at = data.rindex(b"R") + 1
    data = data[:at] + b"}X\x05\x00\x00\x00shape(J\x00\x00\x00\x40tsb" + data[at:]
    assert fastpickle.scan(data) is not None  # the grammar lets it by: the record refuses
    assert fastpickle.load(io.BytesIO(data), persistent) is None
    with pytest.raises(CorruptCheckpointError, match="sets state"):
        pickles.load(data, persistent, GlobalsSeen())


# -- 6. leaks -----------------------------------------------------------------

def test_a_global_kept_as_a_value_goes_the_ordinary_way() -> None:
    data = b"\x80\x02}q\x00(X\x01\x00\x00\x00a" + ORDERED + b"u."
    assert fastpickle.scan(data) is not None
    assert fastpickle.load(io.BytesIO(data), persistent) is None
    obj = pickles.load(data, persistent, GlobalsSeen())
    assert obj["a"] is constructors.safe_callable("collections.OrderedDict")


def test_a_fast_read_leaves_the_stream_after_its_stop(tmp_path: Path) -> None:
    data = data_pkl({"w": torch.zeros(2)}, tmp_path)
    stream = io.BytesIO(b"junk" + data + b"tail")
    stream.seek(4)
    assert fastpickle.load(stream, persistent) is not None
    assert stream.read() == b"tail"


def test_not_taken_for_rewrites_and_observed_reads(tmp_path: Path) -> None:
    from ckptool.read import observe, resolve

    data = data_pkl({"w": torch.zeros(2)}, tmp_path)
    with resolve.faithful():
        assert fastpickle.load(io.BytesIO(data), persistent) is None
    with observe.observe(lambda path, pairs: None):
        assert fastpickle.load(io.BytesIO(data), persistent) is None
