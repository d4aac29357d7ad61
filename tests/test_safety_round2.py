"""Safety, second round (issue 25): what torch would read is what ckptool
reads, or the file is refused.

- zip records whose names differ only in case: torch's reader (miniz) finds
  records ignoring case, so a clean ``data.pkl`` beside a ``DATA.pkl`` loads
  the second (checked against torch below, with a harmless callable);
- a pickle record torch.load does not read is read all the same for what
  it names;
- a pre-POSIX (v7) tar, without the ``ustar`` magic, is a tar to torch's
  legacy loader: refused as one, never read as a pickle.

Every payload calls ``os.system`` on a canary file: nothing may create it.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool.cli import main


class Payload:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.canary}",))


def torch_file(path: Path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as z:
        return [(i, z.read(i.filename)) for i in z.infolist()]


def rewrite(path: Path, records: list[tuple[zipfile.ZipInfo, bytes]],
            extra: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for info, data in records:
            z.writestr(info, data)
        for name, data in extra.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize("twin", ["DATA.pkl", "Data.Pkl"])
def test_records_that_differ_only_in_case_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], twin: str) -> None:
    canary = tmp_path / "ran"
    records = torch_file(tmp_path / "clean.pt")
    root = records[0][0].filename.split("/")[0]
    path = rewrite(tmp_path / "twin.pt", records,
                   {f"{root}/{twin}": pickle.dumps({"w": Payload(canary)}, protocol=2)})
    for args in (["inspect", str(path)], ["diagnose", str(path)],
                 ["convert", str(path), str(tmp_path / "o.safetensors")],
                 ["fix", str(path), "-o", str(tmp_path / "o.pt")]):
        assert main(args) == 3, args
        assert "differ only in case" in capsys.readouterr().err
    assert not canary.exists()
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "o.pt").exists()


def test_torch_does_read_the_other_case(tmp_path: Path) -> None:
    """The premise, with a harmless callable: torch.load of the archive
    builds what DATA.pkl says, not data.pkl."""
    records = torch_file(tmp_path / "clean.pt")
    root = records[0][0].filename.split("/")[0]
    path = rewrite(tmp_path / "twin.pt", records,
                   {f"{root}/DATA.pkl": pickle.dumps({"marker": 42}, protocol=2)})
    assert torch.load(path, weights_only=False) == {"marker": 42}


def test_a_pickle_record_torch_does_not_read_is_scanned(tmp_path: Path) -> None:
    canary = tmp_path / "ran"
    records = torch_file(tmp_path / "clean.pt")
    root = records[0][0].filename.split("/")[0]
    path = rewrite(tmp_path / "extra.pt", records,
                   {f"{root}/extra.pkl": pickle.dumps({"w": Payload(canary)}, protocol=2)})
    ckpt = ckptool.open(path)
    assert ckpt.unsafe_globals == ["posix.system"]
    assert any("extra.pkl" in w for w in ckpt.warnings)
    assert not canary.exists()


def v7_tar(path: Path, members: dict[str, bytes]) -> Path:
    """A pre-POSIX tar: no ustar magic, each header's checksum recomputed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    raw = bytearray(buf.getvalue())
    at = 0
    while at + 512 <= len(raw) and any(raw[at:at + 512]):
        header = raw[at:at + 512]
        header[257:265] = bytes(8)
        header[148:156] = b" " * 8
        header[148:156] = b"%06o\0 " % sum(header)
        raw[at:at + 512] = header
        size = int(bytes(header[124:136]).strip(b"\0 ") or b"0", 8)
        at += 512 + (size + 511) // 512 * 512
    path.write_bytes(bytes(raw))
    return path


def test_a_v7_tar_is_a_tar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    canary = tmp_path / "ran"
    path = v7_tar(tmp_path / "old.pt", {
        "sys_info": pickle.dumps({"protocol_version": 1001}, protocol=2),
        "pickle": pickle.dumps({"w": Payload(canary)}, protocol=2),
        "storages": pickle.dumps(0, protocol=2), "tensors": pickle.dumps(0, protocol=2)})
    assert tarfile.is_tarfile(path)  # what torch's legacy loader asks
    assert main(["inspect", str(path)]) == 3
    assert "tar-format torch checkpoint" in capsys.readouterr().err
    v7_tar(tmp_path / "other.tar", {"notes.txt": b"hello"})
    assert main(["inspect", str(tmp_path / "other.tar")]) == 3
    assert "tar archive" in capsys.readouterr().err
    assert not canary.exists()


def framed(length: int, body: bytes) -> bytes:
    import struct

    return b"\x80\x04\x95" + struct.pack("<Q", length) + body


PAYLOAD_OPS = b"cposix\nsystem\n(Vtouch CANARY\ntR."


@pytest.mark.parametrize("length", [3, 10, 20, 27])
def test_a_frame_ending_inside_an_opcode_is_refused(tmp_path: Path, length: int) -> None:
    """CPython's C unpickler (torch.load, pickle.load) reads through a frame's
    end; a frame ending inside an opcode's argument is how a pickle shows one
    reader another program than the next: refused, alone or after a STOP."""
    canary = tmp_path / "ran"
    body = PAYLOAD_OPS.replace(b"CANARY", str(canary).encode())
    alone = tmp_path / "f.pkl"
    alone.write_bytes(framed(length, body))
    with pytest.raises(ckptool.CkptoolError, match="frame ends inside an opcode"):
        ckptool.open(alone)
    after = tmp_path / "after.pkl"
    after.write_bytes(pickle.dumps({"ok": 1}, protocol=2) + framed(length, body))
    with pytest.raises(ckptool.CkptoolError, match="frame ends inside an opcode"):
        ckptool.open(after)
    assert not canary.exists()


def test_frames_on_opcode_boundaries_read_as_before(tmp_path: Path) -> None:
    canary = tmp_path / "ran"
    body = PAYLOAD_OPS.replace(b"CANARY", str(canary).encode())
    path = tmp_path / "f.pkl"
    path.write_bytes(framed(14, body))  # the frame holds exactly the GLOBAL
    assert ckptool.open(path).unsafe_globals == ["posix.system"]
    for proto in (4, 5):
        path.write_bytes(pickle.dumps({"a": list(range(30000)), "b": b"x" * 200000,
                                       "c": {"n": 1.5}}, protocol=proto))
        assert ckptool.open(path).unsafe_globals == []
    assert not canary.exists()


def test_one_policy_for_every_pickle(tmp_path: Path) -> None:
    """A tensor 'rebuilt' by an arbitrary function is refused in the first
    pickle; after a STOP it is refused the same, never junk bytes."""
    rebuild = (b"ctorch._tensor\n_rebuild_from_type_v2\n(cmypkg.gadgets\nrun\n"
               b"ctorch\nTensor\n(Vx\ntNtR.")
    first = tmp_path / "first.pkl"
    first.write_bytes(b"\x80\x02" + rebuild)
    after = tmp_path / "after.pkl"
    after.write_bytes(pickle.dumps({"ok": 1}, protocol=2) + b"\x80\x02" + rebuild)
    for path in (first, after):
        with pytest.raises(ckptool.CkptoolError, match="rebuilt by an unknown function"):
            ckptool.open(path)


def test_a_whole_module_in_the_legacy_format_reads(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """torch.save(model, _use_new_zipfile_serialization=False) persists the
    module's class with its source ('module', cls, file, source): read as
    the class the pickle named, no false alarm; its weights extract."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = tmp_path / "whole.pt"
    torch.save(model, path, _use_new_zipfile_serialization=False)
    ckpt = ckptool.open(path)
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.kind == "module"
    assert set(ckpt.state_dict()) == {"0.weight", "0.bias"} and not ckpt.unsafe_globals
    out = tmp_path / "sd.pth"
    assert main(["fix", str(path), "--extract", "-o", str(out)]) == 0, capsys.readouterr().err
    assert torch.equal(torch.load(out)["0.weight"], model.state_dict()["0.weight"])


def test_a_partial_is_judged_by_what_it_wraps(tmp_path: Path) -> None:
    """functools.partial(torch.optim.Adam, lr=...) in hyper-parameters
    (Lightning, hydra, timm's norm layers) builds a partial and calls
    nothing: no alarm, nor for a partial of os.system that nothing calls. A
    partial called at load time is a call of what it wraps."""
    import functools

    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2), "opt": functools.partial(torch.optim.Adam, lr=0.1),
                "norm": functools.partial(torch.nn.LayerNorm, eps=1e-6)}, ok)
    ckpt = ckptool.open(ok)
    assert ckpt.unsafe_globals == []
    assert {g.name: g.category for g in ckpt.globals}["functools.partial"] == "data"
    stored = tmp_path / "stored.pt"  # a partial stored and never called: data
    torch.save({"bad": functools.partial(os.system, "true")}, stored)
    assert ckptool.open(stored).unsafe_globals == []
    called = tmp_path / "called.pkl"  # partial(posix.system)('true'): a call at load time
    called.write_bytes(b"\x80\x02cfunctools\npartial\ncposix\nsystem\n\x85R(Vtrue\ntR.")
    assert ckptool.open(called).unsafe_globals == ["posix.system"]


@pytest.mark.parametrize(("module", "name"), [
    ("wave", "Wave_write"), ("mailbox", "Maildir"), ("mailbox", "MMDF"), ("aifc", "open"),
    ("logging", "FileHandler"), ("zipfile", "ZipFile"), ("sqlite3", "connect"),
])
def test_standard_library_globals_not_known_harmless_are_unsafe(
        tmp_path: Path, module: str, name: str) -> None:
    """wave.Wave_write(path), mailbox.Maildir(path, create=True)... create or
    truncate files when made: the standard library is a known world, and
    what is not listed as harmless is unsafe, not "custom"."""
    path = tmp_path / "s.pkl"
    canary = tmp_path / "made"
    path.write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"(V" +
                     str(canary).encode() + b"\ntR.")
    assert f"{module}.{name}" in ckptool.open(path).unsafe_globals
    assert not canary.exists()


def test_known_harmless_standard_library_and_user_classes(tmp_path: Path) -> None:
    import random

    path = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2), "rng": random.Random(0),
                "od": __import__("collections").OrderedDict(a=1)}, path)
    ckpt = ckptool.open(path)
    assert ckpt.unsafe_globals == []
    path.write_bytes(b"\x80\x02cmypkg.nets\nResNet\n)\x81.")  # a user's class: custom
    assert [g.category for g in ckptool.open(path).globals] == ["custom"]


def test_a_large_dcp_value_is_still_read_for_what_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dcp.load unpickles a BYTE_IO item whatever its size: ckptool keeps a
    large one's value unread, but reads its pickle for the globals it names."""
    import torch.distributed.checkpoint as dcp

    from ckptool.read.layouts import dcp as dcp_layout

    canary = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "hook": Payload(canary)}, checkpoint_id=str(folder))
    monkeypatch.setattr(dcp_layout, "MAX_VALUE_BYTES", 0)
    ckpt = ckptool.open(folder)
    assert "posix.system" in ckpt.unsafe_globals
    assert not canary.exists()


def test_the_file_read_is_the_one_transformers_loads(tmp_path: Path) -> None:
    """transformers loads pytorch_model.bin before a pytorch_model.bin.index.json
    beside it: that file is the checkpoint read (the shards are scanned)."""
    import shutil

    here = Path(__file__).parent / "fixtures" / "frameworks"
    folder = tmp_path / "both"
    shutil.copytree(here / "llama_tied_bin_sharded", folder)
    shutil.copy(here / "llama_tied_bin" / "pytorch_model.bin", folder / "pytorch_model.bin")
    ckpt = ckptool.open(folder)
    assert ckpt.path.endswith("pytorch_model.bin") and not ckpt.is_multifile
    assert ckpt.framework is not None
    shards = [c for c in ckpt.framework.companions if c.path.startswith("pytorch_model-")]
    assert len(shards) == 2 and all(c.format for c in shards)


@pytest.mark.parametrize(("module", "name", "category"), [
    ("torch.utils.hooks", "RemovableHandle", "torch"),  # lazy modules keep one
    ("torch.utils.hooks", "unserializable_hook", "unsafe"),
    ("torch.utils.cpp_extension", "load", "unsafe"),
    ("torch.nn.functional", "relu", "torch"),  # self.act = F.relu in a pickled module
    ("torch.nn.modules.linear", "Linear", "torch"),
    ("torch.torch_version", "TorchVersion", "torch"),
])
def test_torch_is_a_known_world_too(module: str, name: str, category: str) -> None:
    from ckptool.read.pickle import policy

    assert policy.classify(module, name).category == category
