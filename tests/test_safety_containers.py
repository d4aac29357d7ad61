"""Every payload in every container ckptool reads (issue 25, item 9).

``test_safety_corpus`` places the payloads in raw pickles, torch zips,
trailing pickles and legacy files; this adds the containers left: the raw
protocols 1, 3 and 4, a torch zip whose data.pkl runs the payload and pops
its result before the real object (so the file still loads as a state
dict), each of a legacy file's three header pickles, an HF ``.bin`` shard,
a DCP ``.metadata`` and a DCP BYTE_IO item, and a DeepSpeed model-states
file. Each container starts from what a real writer wrote (torch.save,
transformers, dcp.save, DeepSpeed) and is changed the way an attacker
would, opcode by opcode.

For each: ckptool flags the payload's globals or refuses the file naming
one (exit 3), the canary file proves nothing ran, and fix / convert refuse
it and write nothing.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptool
from ckptool.cli import main
from tests.test_malicious import split
from tests.test_safety_corpus import CORPUS, flagged_or_refused

FIXTURES = Path(__file__).parent / "fixtures"
HF_SHARDED = FIXTURES / "frameworks" / "llama_tied_bin_sharded"
DEEPSPEED = FIXTURES / "deepspeed" / "z1_fp32"


def inject(payload: bytes, victim: bytes) -> bytes:
    """``victim`` (one pickle) running ``payload`` first and popping its
    result: the stream still ends with the victim's object."""
    _, body = split(payload)
    header = victim[:2] if victim[:1] == b"\x80" else b""
    return header + body + b"0" + victim[len(header):]


def first_pickle_end(data: bytes, start: int = 0) -> int:
    stream = io.BytesIO(data)
    stream.seek(start)
    for op, _, pos in pickletools.genops(stream):
        if op.name == "STOP":
            assert pos is not None
            return pos + 1
    raise AssertionError("no STOP")


def zip_injected(payload: bytes, src: Path, dst: Path) -> None:
    """A torch zip whose data.pkl runs the payload first (records in order,
    stored, as torch writes them)."""
    with zipfile.ZipFile(src) as z_in, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z_out:
        for info in z_in.infolist():
            data = z_in.read(info)
            if info.filename.endswith("/data.pkl"):
                data = inject(payload, data)
            z_out.writestr(info.filename, data)


def legacy_slot(payload: bytes, template: Path, slot: int) -> bytes:
    """A legacy torch file with its ``slot``-th pickle (0 magic, 1 protocol
    version, 2 sys_info) running the payload first."""
    data = template.read_bytes()
    start = 0
    for _ in range(slot):
        start = first_pickle_end(data, start)
    end = first_pickle_end(data, start)
    return data[:start] + inject(payload, data[start:end]) + data[end:]


# -- the containers: each writes the checkpoint to open and returns its path --

Container = Callable[[bytes, Path, dict[str, Path]], Path]


def _raw(proto: int) -> Container:
    def make(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
        _, body = split(payload)
        path = tmp / "evil.pkl"
        path.write_bytes((bytes([0x80, proto]) if proto >= 2 else b"") + body + b".")
        return path
    return make


def _zip_injected(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
    path = tmp / "evil.pth"
    zip_injected(payload, t["zip"], path)
    return path


def _legacy(slot: int) -> Container:
    def make(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
        path = tmp / "evil.pth"
        path.write_bytes(legacy_slot(payload, t["legacy"], slot))
        return path
    return make


def _hf_shard(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
    folder = tmp / "model"
    shutil.copytree(HF_SHARDED, folder)
    shard = sorted(folder.glob("pytorch_model-*.bin"))[-1]
    clean = tmp / "clean.bin"
    shard.rename(clean)
    zip_injected(payload, clean, shard)
    return folder


def _dcp(tmp: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "args": "lr=0.1"},
                 checkpoint_id=str(folder))
    return folder


def _dcp_metadata(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
    folder = _dcp(tmp)
    meta = folder / ".metadata"
    meta.write_bytes(inject(payload, meta.read_bytes()))
    return folder


def _dcp_byte_io(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
    """The BYTE_IO item (torch.save of 'lr=0.1') rewritten to
    run the payload; the items after it and .metadata's offsets move."""
    folder = _dcp(tmp)
    meta_path = folder / ".metadata"
    # our own file, just written by dcp.save: safe to unpickle
    meta = pickle.loads(meta_path.read_bytes())
    target = next(k for k in meta.storage_data if k.fqn == "args")
    info = meta.storage_data[target]
    distcp = folder / info.relative_path
    data = distcp.read_bytes()
    item = data[info.offset:info.offset + info.length]
    src, dst = tmp / "item_in.pt", tmp / "item_out.pt"
    src.write_bytes(item)
    zip_injected(payload, src, dst)
    new_item = dst.read_bytes()
    grow = len(new_item) - info.length
    distcp.write_bytes(data[:info.offset] + new_item + data[info.offset + info.length:])
    for key, other in meta.storage_data.items():
        if other.relative_path != info.relative_path:
            continue
        if key == target:
            other.length = len(new_item)
        elif other.offset > info.offset:
            other.offset += grow
    meta_path.write_bytes(pickle.dumps(meta))
    return folder


def _deepspeed(payload: bytes, tmp: Path, t: dict[str, Path]) -> Path:
    folder = tmp / "ds"
    shutil.copytree(DEEPSPEED, folder)
    states = next(folder.glob("global_step*/mp_rank_00_model_states.pt"))
    clean = tmp / "clean_states.pt"
    states.rename(clean)
    zip_injected(payload, clean, states)
    return folder


CONTAINERS: dict[str, Container] = {
    "protocol1": _raw(1),
    "protocol3": _raw(3),
    "protocol4": _raw(4),
    "zip_injected_popped": _zip_injected,
    "legacy_magic": _legacy(0),
    "legacy_protocol": _legacy(1),
    "legacy_sys_info_popped": _legacy(2),
    "hf_bin_shard": _hf_shard,
    "dcp_metadata": _dcp_metadata,
    "dcp_byte_io": _dcp_byte_io,
    "deepspeed_model_states": _deepspeed,
}


def test_the_containers_are_what_real_loaders_read(tmp_path: Path,
                                                   torch_files: dict[str, Path]) -> None:
    """Control: with a harmless payload (a ``set()`` call the loaders allow)
    each rewritten container still loads with its real loader, so the
    payloads below sit where a loader runs them."""
    import torch.distributed.checkpoint as dcp

    harmless = b"\x80\x02cbuiltins\nset\n)R."  # builtins.set(): weights_only allows it
    for name, make in CONTAINERS.items():
        where = tmp_path / name
        where.mkdir()
        path = make(harmless, where, torch_files)
        if name.startswith("protocol"):
            assert pickle.loads(path.read_bytes()) == set()
        elif name in ("zip_injected_popped",) or name.startswith("legacy"):
            assert torch.equal(torch.load(path, weights_only=False)["b"], torch.zeros(3))
        elif name == "hf_bin_shard":
            for shard in path.glob("pytorch_model-*.bin"):
                assert torch.load(shard, weights_only=False)
        elif name.startswith("dcp"):
            sd: dict[str, object] = {"w": torch.zeros(2, 3), "args": ""}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, checkpoint_id=str(path))
            assert sd["args"] == "lr=0.1"
        else:
            states = next(path.glob("global_step*/mp_rank_00_model_states.pt"))
            assert "module" in torch.load(states, weights_only=False)
        ckpt = ckptool.open(path)
        assert ckpt.unsafe_globals == [], name
        if name.startswith("legacy") or name == "zip_injected_popped":
            # read as torch reads it: the state dict after the popped value
            assert set(ckpt.state_dict()) == {"w", "b"}, name


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("name", sorted(CORPUS))  # every payload kind
def test_never_clean_never_run(name: str, container: str, tmp_path: Path,
                               torch_files: dict[str, Path]) -> None:
    payload = CORPUS[name]
    canary = tmp_path / "CANARY"
    path = CONTAINERS[container](payload.build(canary), tmp_path, torch_files)
    flagged_or_refused(path, payload.unsafe)
    assert not canary.exists(), "the payload ran"


def snapshot(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("name", ["os_system", "functools_partial", "unknown_function"])
def test_writers_refuse_every_container(name: str, container: str, tmp_path: Path,
                                        torch_files: dict[str, Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """fix and convert exit 3 naming a global, write nothing, change nothing."""
    payload = CORPUS[name]
    canary = tmp_path / "CANARY"
    path = CONTAINERS[container](payload.build(canary), tmp_path, torch_files)
    before = snapshot(path)
    outs = tmp_path / "outs"
    outs.mkdir()
    runs = [["convert", str(path), str(outs / "out.safetensors")],
            ["convert", str(path), str(outs / "out.pth")]]
    if path.is_file():
        runs.append(["fix", str(path), "--to", "cpu", "-o", str(outs / "fixed.pth")])
    for args in runs:
        code = main(args)
        err = capsys.readouterr().err
        assert code == 3, (args, code, err)
        assert any(n in err for n in payload.unsafe), err
        assert "Traceback" not in err
    assert list(outs.iterdir()) == []
    assert snapshot(path) == before
    assert not canary.exists()


def test_salvage_of_a_popped_payload_writes_only_the_weights(
        tmp_path: Path, torch_files: dict[str, Path]) -> None:
    """The opt-in: the state dict that followed the payload comes out,
    written by ckptool, and the output is clean."""
    canary = tmp_path / "CANARY"
    path = _zip_injected(CORPUS["os_system"].build(canary), tmp_path, torch_files)
    out = tmp_path / "salvaged.pth"
    assert main(["fix", str(path), "--salvage", "-o", str(out)]) == 0
    assert ckptool.open(out).unsafe_globals == []
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == {"w", "b"} and torch.equal(loaded["b"], torch.zeros(3))
    assert not canary.exists()


def zero_crc(path: Path, suffix: str) -> None:
    """Zero the CRC-32 of the record ending in ``suffix``, in its local
    header and its central directory entry (picklescan's CRC bypass)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    data[info.header_offset + 14:info.header_offset + 18] = bytes(4)
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        length = int.from_bytes(data[pos + 28:pos + 30], "little")
        if bytes(data[pos + 46:pos + 46 + length]).endswith(suffix.encode()):
            data[pos + 16:pos + 20] = bytes(4)
        pos = data.find(b"PK\x01\x02", pos + 4)
    path.write_bytes(bytes(data))


def test_torch_ignores_a_record_checksum(tmp_path: Path,
                                         torch_files: dict[str, Path]) -> None:
    """Control: torch.load reads a data.pkl whose CRC is wrong as it is."""
    path = _zip_injected(b"\x80\x02cbuiltins\nset\n)R.", tmp_path, torch_files)
    zero_crc(path, "/data.pkl")
    assert torch.equal(torch.load(path, weights_only=False)["b"], torch.zeros(3))


@pytest.mark.parametrize("name", ["os_system", "builtins_eval", "functools_partial",
                                  "unknown_function", "torch_load_from_bytes"])
def test_a_record_with_a_wrong_checksum_is_refused_naming_what_it_runs(
        name: str, tmp_path: Path, torch_files: dict[str, Path]) -> None:
    payload = CORPUS[name]
    canary = tmp_path / "CANARY"
    path = _zip_injected(payload.build(canary), tmp_path, torch_files)
    zero_crc(path, "/data.pkl")
    assert flagged_or_refused(path, payload.unsafe) == "refused"
    assert not canary.exists()


@pytest.mark.parametrize("evil_first", [False, True], ids=["evil_last", "evil_first"])
def test_a_repeated_record_name_is_refused(evil_first: bool, tmp_path: Path,
                                           torch_files: dict[str, Path]) -> None:
    """Two records named data.pkl: torch loads one of them (the last, with
    this torch), a dict keyed by name another; the archive is refused."""
    canary = tmp_path / "CANARY"
    evil = CORPUS["os_system"].build(canary)
    path = tmp_path / "twice.pth"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile: "Duplicate name"
        with zipfile.ZipFile(torch_files["zip"]) as src, zipfile.ZipFile(path, "w") as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename.endswith("/data.pkl"):
                    pair = [evil, data] if evil_first else [data, evil]
                    for blob in pair:
                        dst.writestr(info.filename, blob)
                else:
                    dst.writestr(info.filename, data)
    with pytest.raises(ckptool.CkptoolError, match="more than one record named") as exc:
        ckptool.open(path)
    assert exc.value.exit_code == 3
    assert main(["convert", str(path), str(tmp_path / "out.safetensors")]) == 3
    assert not (tmp_path / "out.safetensors").exists()
    assert not canary.exists()


def test_a_dcp_value_stored_through_a_transform_is_not_vouched_for(tmp_path: Path) -> None:
    """dcp.load undoes a value's transform (stream.zstd) and unpickles it;
    ckptool does not undo it, so the value is unsafe (fail closed), named,
    and the writers refuse the checkpoint. Tensors stored through one are
    data, not pickles: they stay no alarm."""
    folder = _dcp(tmp_path)
    meta_path = folder / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())  # our own file, just written
    for key, info in meta.storage_data.items():
        if key.fqn == "args":
            info.transform_descriptors = ["stream.zstd/1"]
    meta_path.write_bytes(pickle.dumps(meta))
    ckpt = ckptool.open(folder)
    assert [g for g in ckpt.unsafe_globals if "transform" in g], ckpt.unsafe_globals
    glob = next(g for g in ckpt.globals if g.category == "unsafe")
    assert "stream.zstd/1" in glob.reason and "weights_only=False" in glob.reason
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(folder), str(out)]) == 3 and not out.exists()


def test_every_fix_diagnose_prints_for_a_flagged_folder_salvages(tmp_path: Path) -> None:
    """A model whose folder holds a flagged file (a Trainer's rng_state.pth):
    fix refuses without --salvage, so every fix command diagnose prints has
    it, the prefix fix that comes later included, and the command runs."""
    from tests.helpers import SAMPLES

    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(SAMPLES / "dataparallel_cuda2.pth", folder / "model.pth")
    clean = tmp_path / "clean.pt"
    torch.save({"a": 1}, clean)
    zip_injected(CORPUS["os_system"].build(tmp_path / "CANARY"), clean, folder / "rng_state.pth")
    diagnosis = ckptool.diagnose(ckptool.open(folder))
    fixes = [f.fix for f in diagnosis.findings if f.fix and f.fix.startswith("ckptool fix ")]
    assert any("--strip-module" in f for f in fixes)
    assert fixes and all("--salvage" in f for f in fixes), fixes
    assert diagnosis.fix_command is not None and "--salvage" in diagnosis.fix_command
    out = tmp_path / "fixed.pth"
    assert main(["fix", str(folder / "model.pth"), "--strip-module", "--salvage", "-o",
                 str(out), "-q"]) == 0
    assert ckptool.open(out).unsafe_globals == []
    assert not (tmp_path / "CANARY").exists()


def test_a_pickle_shaped_like_msgpack_is_read_as_the_pickle_it_is(tmp_path: Path) -> None:
    """0x8c opens a msgpack map and is pickle's SHORT_BINUNICODE: a file the
    C unpickler runs is read as a pickle, not waved off as Flax msgpack."""
    canary = tmp_path / "CANARY"
    path = tmp_path / "params.pkl"
    path.write_bytes(b"\x8c\xa6params" + 160 * b"x" + b"0" + CORPUS["os_system"].build(canary)[2:])
    pickle.loads(path.read_bytes())  # the control: the C unpickler runs it
    assert canary.exists()
    canary.unlink()
    assert flagged_or_refused(path, CORPUS["os_system"].unsafe) == "flagged"
    assert not canary.exists()


def test_a_salvaged_dcp_copies_no_flagged_extra(tmp_path: Path) -> None:
    """Lightning's meta.pt is copied into a fixed DCP checkpoint as it is:
    flagged, fix refuses it, and a salvage leaves it out."""
    folder = tmp_path / "lightning.ckpt"
    shutil.copytree(FIXTURES / "multifile" / "lightning_fsdp.ckpt", folder)
    clean = tmp_path / "meta_clean.pt"
    (folder / "meta.pt").rename(clean)
    zip_injected(CORPUS["os_system"].build(tmp_path / "CANARY"), clean, folder / "meta.pt")
    out = tmp_path / "fixed.ckpt"
    assert main(["fix", str(folder), "--add-prefix", "x.", "-o", str(out), "-q"]) == 3
    assert not out.exists()
    assert main(["fix", str(folder), "--add-prefix", "x.", "--salvage", "-o", str(out),
                 "-q"]) == 0
    assert not (out / "meta.pt").exists()
    assert ckptool.open(out).unsafe_globals == []
    assert not (tmp_path / "CANARY").exists()


def test_a_pickle_after_an_extra_records_stop_is_read(tmp_path: Path,
                                                     torch_files: dict[str, Path]) -> None:
    """One policy for every pickle: what follows the STOP of a pickle record
    torch does not read is read too."""
    path = tmp_path / "extra.pth"
    with zipfile.ZipFile(torch_files["zip"]) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        dst.writestr("model_0/extra.pkl", pickle.dumps({"a": 1}, 2)
                     + CORPUS["os_system"].build(tmp_path / "CANARY"))
    assert "os.system" in ckptool.open(path).unsafe_globals
    assert not (tmp_path / "CANARY").exists()
