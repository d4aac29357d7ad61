"""A large ``.metadata`` read by the C unpickler (``ckptool.read.fastrecords``
and ``layouts.dcp_fast``): the same result as the ordinary read, Python work
that does not grow with the pickle's opcodes, and each point of the safety
argument in ``fastrecords``' docstring (anything it cannot vouch for is read
the ordinary way, whose result or error is the one that counts).
"""

from __future__ import annotations

import os
import pickle
import pickletools
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptool.errors import CkptoolError
from ckptool.read import fastrecords
from ckptool.read.layouts import dcp_fast, dcp_metadata
from ckptool.read.seen import GlobalsSeen

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "multifile"
MODULE = "torch.distributed.checkpoint.metadata"


@pytest.fixture(autouse=True)
def every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_fast, "FAST_FROM", 0)  # the fast read for small files too


def synthetic(folder: Path, tensors: int, chunks: int = 8, values: int = 2) -> Path:
    """A ``.metadata`` pickled from torch's own classes as ``FileSystemWriter``
    pickles it: row-sharded tensors, values, nested planner paths, a Path."""
    folder.mkdir(parents=True, exist_ok=True)
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for i in range(tensors):
        fqn = f"model.layers.{i}.weight"
        step = 4
        boxes = []
        for j in range(chunks):
            offsets = torch.Size([j * step, 0])
            boxes.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([step, 3])))
            storage[MetadataIndex(fqn, list(offsets), j)] = _StorageInfo(
                f"__{j}_0.distcp", i * 100 + j, 60)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                         torch.Size([chunks * step, 3]), boxes)
        planner[fqn] = ("model", f"layers.{i}.weight")
    for k in range(values):
        sdm[f"optim.step{k}"] = BytesStorageMetadata()
        storage[MetadataIndex(f"optim.step{k}")] = _StorageInfo("__0_0.distcp", 9000 + k, 30)
        planner[f"optim.step{k}"] = ("optim", f"step{k}")
    md = Metadata(sdm, planner, storage, StorageMeta(checkpoint_id=folder), "1.0.0")
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return folder


def read(folder: Path, fast: bool, name: str = ".metadata") -> tuple[Any, GlobalsSeen, bool]:
    """(Metadata or the error's message, what was recorded, whether the fast read was taken)."""
    seen, taken = GlobalsSeen(), []
    real = dcp_fast.read

    def spy(*args: Any) -> Any:
        found = real(*args) if fast else None
        taken.append(found is not None)
        return found

    dcp_fast.read = spy  # type: ignore[assignment]
    try:
        out: Any = dcp_metadata.parse(str(folder), name, seen)
    except CkptoolError as exc:
        out = exc.message
    finally:
        dcp_fast.read = real  # type: ignore[assignment]
    return out, seen, bool(taken and taken[0])


def recorded(seen: GlobalsSeen) -> tuple[Any, ...]:
    return seen.counts, seen.verdicts, seen.uses, seen.where


CASES = [FIXTURES / "dcp_4ranks", FIXTURES / "accelerate_fsdp" / "optimizer_0",
         FIXTURES / "accelerate_fsdp" / "pytorch_model_fsdp_0", FIXTURES / "lightning_fsdp.ckpt"]


@pytest.mark.parametrize("folder", CASES, ids=lambda p: p.name)
def test_torch_written_metadata_reads_as_the_ordinary_read_does(folder: Path) -> None:
    fast, fast_seen, taken = read(folder, fast=True)
    slow, slow_seen, _ = read(folder, fast=False)
    assert taken
    assert fast == slow and recorded(fast_seen) == recorded(slow_seen)


def test_many_ranks_metadata_reads_as_the_ordinary_read_does(tmp_path: Path) -> None:
    folder = synthetic(tmp_path / "dcp", tensors=40)
    fast, fast_seen, taken = read(folder, fast=True)
    slow, slow_seen, _ = read(folder, fast=False)
    assert taken
    assert fast == slow and recorded(fast_seen) == recorded(slow_seen)
    assert len(fast.tensors) == 40 and len(fast.values) == 2
    assert fast.planner["optim.step1"] == ("optim", "step1")


def python_calls(work: Callable[[], Any]) -> int:
    """How many Python functions ``work`` calls (C functions not counted)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


def test_the_read_makes_a_few_python_calls_a_chunk_not_some_an_opcode(tmp_path: Path) -> None:
    """The work that grows with the file runs in C. A chunk is ~60 opcodes
    (its record, its storage index and record, two sizes): read here, it
    costs three Python calls (each record's ``__setstate__``), a tensor of 8
    chunks a few more; the ordinary read makes ~450 a chunk (a call or more
    an opcode, and the checks of each BUILD). Counted, not timed: 32 tensors
    against 8, so the start-up (the grammar's compiling) cancels out."""
    counts = []
    for tensors in (8, 8, 32):  # (the first compiles the grammar)
        folder = synthetic(tmp_path / f"dcp{tensors}", tensors=tensors, values=0)
        counts.append(python_calls(lambda f=folder: dcp_metadata.parse(
            str(f), ".metadata", GlobalsSeen())))
    per_chunk = (counts[2] - counts[1]) / ((32 - 8) * 8)
    assert per_chunk <= 5, counts


# -- hand-made pickles: each point of the safety argument ---------------------------

class Program:
    """A protocol 4 pickle written opcode by opcode, memo indices counted."""

    def __init__(self) -> None:
        self.out, self.memo = bytearray(), 0

    def op(self, code: bytes) -> Program:
        self.out += code
        return self

    def put(self) -> int:
        self.out += b"\x94"
        self.memo += 1
        return self.memo - 1

    def text(self, value: str, memo: bool = True) -> None:
        raw = value.encode()
        self.out += b"\x8c" + bytes([len(raw)]) + raw
        if memo:
            self.put()

    def get(self, index: int) -> Program:
        return self.op(b"h" + bytes([index]) if index < 256 else b"j" + struct.pack(
            "<I", index))

    def glob(self, module: str, name: str) -> int:
        self.text(module)
        self.text(name)
        return self.op(b"\x93").put()


def framed(body: bytes, cuts: tuple[int, ...] = ()) -> bytes:
    """Protocol 4: ``body`` in frames that end at ``cuts``."""
    ends = [*cuts, len(body)]
    starts = [0, *cuts]
    return b"\x80\x04" + b"".join(b"\x95" + struct.pack("<Q", e - s) + body[s:e]
                                   for s, e in zip(starts, ends, strict=True))


def metadata(planner: Callable[[Program], None] | None = None,
             storage: Callable[[Program], None] | None = None,
             state: Callable[[Program], None] | None = None) -> bytes:
    """A Metadata: empty but for what the callbacks write into its planner
    dict, its storage dict and its own state (after version)."""
    p = Program()
    p.glob(MODULE, "Metadata")
    p.op(b")\x81").put()
    p.op(b"}").put()
    p.op(b"(")
    p.text("state_dict_metadata")
    p.op(b"}").put()
    p.text("planner_data")
    p.op(b"}").put()
    if planner:
        p.op(b"(")
        planner(p)
        p.op(b"u")
    p.text("storage_data")
    p.op(b"}").put()
    if storage:
        storage(p)
    p.text("version")
    p.text("1.0.0")
    if state:
        state(p)
    p.op(b"ub.")
    return framed(bytes(p.out))


def fast_read(data: bytes) -> Any:
    return fastrecords.read(data, 0, dcp_fast.NAMES, dcp_fast.TUPLE_KEY)


def test_the_hand_made_metadata_is_read_the_fast_way(tmp_path: Path) -> None:
    """(The baseline of the tests below: each breaks one thing of this.)"""
    (tmp_path / ".metadata").write_bytes(metadata())
    fast, _, taken = read(tmp_path, fast=True)
    assert taken and fast == read(tmp_path, fast=False)[0]


def chain(depth: int) -> Callable[[Program], None]:
    """Planner entries whose tuples each hold the last one, from the memo."""

    def entries(p: Program) -> None:
        last = -1
        for i in range(depth):
            p.text(f"k{i}", memo=False)
            if last < 0:
                p.op(b"K\x01\x85")
            else:
                p.get(last).op(b"\x85")
            last = p.put()
        entries.last = last  # type: ignore[attr-defined]

    return entries


def test_a_tuple_nested_through_the_memo_cannot_crash_the_read(tmp_path: Path) -> None:
    """Hashing a tuple nested 200,000 deep overflows the C stack (a crash no
    ``except`` catches): such a tuple under planner_data, then a dict key.
    Each tuple there is memoized as a float instead, so the C unpickler's
    read holds none: it ends, the read falls back, and the ordinary read
    refuses the key."""
    entries = chain(200_000)
    data = metadata(entries, lambda p: p.op(b"(").get(entries.last).op(b"Nu"))
    (tmp_path / ".metadata").write_bytes(data)
    code = ("import sys; from ckptool.read.layouts import dcp_fast, dcp_metadata\n"
            "from ckptool.read.seen import GlobalsSeen\n"
            "from ckptool.errors import CorruptCheckpointError\n"
            "dcp_fast.FAST_FROM = 0\n"
            "try:\n"
            f"    dcp_metadata.parse({str(tmp_path)!r}, '.metadata', GlobalsSeen())\n"
            "except CorruptCheckpointError as exc:\n"
            "    print(exc.message)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nests more than 100 levels deep" in done.stdout


def test_tuples_under_planner_data_are_memoized_as_floats() -> None:
    entries = chain(3)
    data = metadata(entries, lambda p: p.op(b"(").get(entries.last).op(b"Nu"))
    loaded = fast_read(data)
    key = next(iter(loaded.root.state["storage_data"]))
    assert isinstance(key, float)  # the memo's slot held a float, not the tuple
    assert dcp_fast.read(data, "", GlobalsSeen()) is None  # and the read falls back


@pytest.mark.parametrize("inside", [1, 5, 13])  # the opcode, its length, its string
def test_a_frame_that_ends_inside_an_opcode_means_the_ordinary_read(tmp_path: Path,
                                                                  inside: int) -> None:
    body = metadata(chain(5))[11:]  # (the one frame's opcodes)
    data = framed(body, (body.index(b"\x8c\x0cplanner_data") + inside,))
    assert fast_read(data) is None
    (tmp_path / ".metadata").write_bytes(data)
    assert "frame ends inside an opcode" in read(tmp_path, fast=True)[0]


def test_a_frame_that_ends_inside_an_opcode_the_grammar_reads_across_cannot_run_code(
        tmp_path: Path) -> None:
    """A frame that ends right after LONG1: the grammar, over the frames'
    joined contents, reads LONG1's length from the next frame; the C
    unpickler, given a marker there, would read the marker as that length
    and go on reading, as opcodes, bytes the grammar read as a string's
    (here: a tuple nested a million deep, then hashed: a crash). Every frame
    must end where an opcode does before the C unpickler runs."""
    strings = [b"\x8c\xff" + b"A" * 111 + b"()" + b"\x85" * 141 + b"M"]
    strings += [b"\x8c\xff0" + b"\x85" * 253 + b"M"] * 4200
    strings.append(b"\x8c\xff0\x91" + b"N" * 253)
    second = b"\x00" + b"".join(strings) + b"."
    data = (b"\x80\x04\x95" + struct.pack("<Q", 1) + b"\x8a"
            + b"\x95" + struct.pack("<Q", len(second)) + second)
    assert len(data) > 1 << 20  # the size the fast read is for
    (tmp_path / ".metadata").write_bytes(data)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(64))
    done = subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "frame ends inside an opcode" in done.stderr


def test_frames_that_end_between_opcodes_are_read_the_fast_way() -> None:
    body = metadata()[11:]  # the one frame's opcodes
    cut = body.index(b"\x8c\x0cplanner_data")
    assert fast_read(framed(body, (cut, cut + 14))) is not None


def test_a_marker_named_by_the_file_is_not_a_frame() -> None:
    """The file cannot name the marker: its module is a nonce made for the read."""
    def state(p: Program) -> None:
        p.text("x")
        p.glob("0123456789abcdef", fastrecords.FRAME_NAME)
    assert fast_read(metadata(state=state)) is None


@pytest.mark.parametrize("opcodes", [
    b"\x82\x01",  # EXT1: copyreg's cache of live objects
    b"i__main__\nX\n",  # INST
    b"(\x8c\x01a\x94o",  # OBJ
    b"\x8f\x94",  # EMPTY_SET
    b"G\x00\x00\x00\x00\x00\x00\x00\x00",  # BINFLOAT: a float is a trap's
    b"P1\n",  # PERSID
    b"N2",  # DUP
    b"q\x05",  # BINPUT at protocol 4 (which memoizes with MEMOIZE)
    b"X\x00\x01\x00\x00" + b"a" * 256,  # a string of 256 bytes
    b"\x8a\x09" + b"\x01" * 9,  # an int of 9 bytes
])
def test_opcodes_outside_the_grammar_mean_the_ordinary_read(opcodes: bytes) -> None:
    def state(p: Program) -> None:
        p.text("x")
        p.op(opcodes)
    assert fast_read(metadata()) is not None
    assert fast_read(metadata(state=state)) is None


@pytest.mark.parametrize("index", [5, 1 << 20, 1 << 31])
def test_a_memo_index_past_the_pickles_size_is_refused_unread(index: int) -> None:
    """Protocols 2 and 3 memoize with (LONG_)BINPUT; LONG_BINPUT of 2**31
    would make the C unpickler zero 32 GiB of memo. An index is allowed
    below the pickle's size (so the memo costs at most 16 bytes a byte)."""
    def state(p: Program) -> None:
        p.text("x", memo=False)
        p.op(b"\x8c\x01y" + b"r" + struct.pack("<I", index))
    data = b"\x80\x02" + metadata(state=state)[11:].replace(b"\x94", b"")  # (no MEMOIZE)
    assert (fast_read(data) is not None) == (index < (1 << 16))


@pytest.mark.parametrize("value", [
    lambda p: p.glob("builtins", "eval"),  # a global outside the table
    lambda p: p.glob("os", "system") and p.op(b"\x8c\x02ls\x94\x85R"),
    lambda p: p.glob(MODULE, "ChunkStorageMetadata") and p.op(b")R"),  # a class called
    lambda p: p.glob("torch", "float32") and p.op(b"}b"),  # BUILD on a global
    lambda p: p.glob("torch", "Size") and p.op(b"}b"),
    lambda p: p.glob("torch.serialization", "_get_layout") and p.op(b"\x8c\x01x\x85R}b"),
    lambda p: p.glob(MODULE, "ChunkStorageMetadata") and p.op(b")\x81(t\x94b"),  # tuple state
])
def test_what_the_globals_become_refuses_all_but_their_use(value: Callable[[Program], Any]
                                                          ) -> None:
    def state(p: Program) -> None:
        p.text("x")
        value(p)
    assert fast_read(metadata(state=state)) is None


def test_a_state_tuple_holds_plain_values_only() -> None:
    """TensorProperties' state is a tuple: one holding a tuple (deeper and
    deeper through the memo) is refused when BUILD hands it over."""
    def state(p: Program) -> None:
        p.text("x")
        p.glob(MODULE, "TensorProperties")
        p.op(b")\x81").put()
        p.op(b"(K\x01K\x02\x86t").put()
        p.op(b"b")
    assert fast_read(metadata(state=state)) is None


def test_a_record_holding_a_global_is_read_the_ordinary_way(tmp_path: Path) -> None:
    """A field that is a global's callable (``torch.Size`` itself): the
    ordinary read records that loading may call it; this path does not
    vouch for that, so the ordinary read decides, and its record counts."""
    folder = synthetic(tmp_path / "dcp", tensors=2)
    body = (folder / ".metadata").read_bytes()[11:]  # (one frame)
    ops = list(pickletools.genops(body))
    memo, size, strings = 0, -1, []
    for i, (op, arg, _) in enumerate(ops):
        if op.name == "MEMOIZE":
            memo += 1
        elif op.name == "STACK_GLOBAL" and strings[-2:] == ["torch", "Size"]:
            size = memo  # (the MEMOIZE right after it)
        elif op.name == "SHORT_BINUNICODE":
            strings.append(arg)
            if arg == "offsets":  # the first chunk's offsets: GET callee ... REDUCE MEMOIZE
                start = ops[i + 2][2]
                end = next(pos for op2, _, pos in ops[i + 2:] if op2.name == "REDUCE") + 2
                break
    body = body[:start] + b"h" + bytes([size]) + body[end:]
    (folder / ".metadata").write_bytes(framed(body))
    fast, fast_seen, taken = read(folder, fast=True)
    slow, slow_seen, _ = read(folder, fast=False)
    assert not taken and fast == slow and recorded(fast_seen) == recorded(slow_seen)


def test_a_record_given_state_and_dropped_is_read_the_ordinary_way(tmp_path: Path) -> None:
    """Two entries under one name: the first is dropped from the dict, but
    BUILD gave it state, which the ordinary read looked at. Every record
    given state must be in the tree, once."""
    folder = synthetic(tmp_path / "dcp", tensors=2)
    data = (folder / ".metadata").read_bytes()
    second = b"model.layers.1.weight"
    data = data.replace(second, b"model.layers.0.weight", 1)  # (its first mention: sdm's key)
    (folder / ".metadata").write_bytes(data)
    fast, fast_seen, taken = read(folder, fast=True)
    slow, slow_seen, _ = read(folder, fast=False)
    assert not taken and fast == slow and recorded(fast_seen) == recorded(slow_seen)
