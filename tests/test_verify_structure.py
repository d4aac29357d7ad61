"""``ckptool verify``'s structure and CRC checks (issue 28 items 1 and 5):
every layout written by its real writer (torch.save, safetensors,
huggingface_hub, dcp.save, the DeepSpeed and per-rank fixtures) reads as
whole, and each kind of damage (a truncated file, a flipped byte in tensor
data, in a header, in a pickle, a missing or extra file, a DCP chunk
moved) is found and named, never as a crash."""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch

from ckptool.check.verify.problems import Report
from ckptool.check.verify.structure import check
from ckptool.errors import InputError
from ckptool.read.ziparchive import ZipArchive

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RANKS = FIXTURES / "multifile" / "per_rank_dtensor"
DEEPSPEED = FIXTURES / "deepspeed"


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def cut(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def data_at(path: Path, suffix: str) -> tuple[int, int]:
    """Where the data of the zip record whose name ends with ``suffix`` lies."""
    with open(path, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(path))
        member = next(m for m in archive.members.values() if m.name.endswith(suffix))
        return archive.data_offset(member), member.size


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def found(report: Report) -> set[tuple[str, str | None, str | None]]:
    return {(p.kind, p.file, p.tensor) for p in report.problems}


def whole(path: Path) -> Report:
    report = check(str(path), 2)
    assert report.ok and not report.problems, report.problems
    return report


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small state dict in every single-file format, and as HF shards
    (safetensors and .bin) and a DCP directory, by their own writers."""
    import huggingface_hub
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("verify")
    torch.manual_seed(0)
    sd = {"w": torch.randn(64, 32), "b": torch.randn(32), "emb.weight": torch.randn(100, 16)}
    torch.save(sd, folder / "model.pt")
    torch.save(sd, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    with open(folder / "plain.pkl", "wb") as f:
        pickle.dump({"w": sd["w"], "lr": 0.1}, f, protocol=4)
    save_file(sd, str(folder / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit deprecated; .bin shards "unsafe"
        torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3)), str(folder / "script.pt"))
        (folder / "hf").mkdir()
        (folder / "hfbin").mkdir()
        huggingface_hub.save_torch_state_dict(sd, str(folder / "hf"), max_shard_size="5KB")
        huggingface_hub.save_torch_state_dict(sd, str(folder / "hfbin"), max_shard_size="5KB",
                                              safe_serialization=False)
        dcp.save({"model": sd, "step": 3}, checkpoint_id=folder / "dcp", no_dist=True)
    return folder


@pytest.mark.parametrize("name,layout,tensors", [
    ("model.pt", "torch-zip", 3), ("legacy.pt", "torch-legacy", 3), ("plain.pkl", "pickle", 1),
    ("model.safetensors", "safetensors", 3), ("script.pt", "torchscript", 2),
    ("hf", "hf-safetensors", 3), ("hfbin", "hf-bin", 3), ("dcp", "dcp", 3)])
def test_what_real_writers_write_is_whole(saved: Path, name: str, layout: str,
                                           tensors: int) -> None:
    report = whole(saved / name)
    assert (report.layout, report.tensors) == (layout, tensors)
    zipped = name in ("model.pt", "script.pt", "hfbin", "dcp")
    # every tensor byte, when CRC'd (the script's Linear(4, 3): 15 floats)
    assert (report.bytes_checked >= (15 * 4 if name == "script.pt" else 100 * 16 * 4)) == zipped
    assert bool(report.notes) != zipped  # no checksum: said


@pytest.mark.parametrize("path", [
    DEEPSPEED / "z0_fp32", DEEPSPEED / "z1_ws4", DEEPSPEED / "z2_align", DEEPSPEED / "bf16opt",
    DEEPSPEED / "z3_bf16_ws4", DEEPSPEED / "lightning_z3.ckpt", RANKS / "fsdp1_ws2",
    RANKS / "mesh2d_ws4", RANKS / "optim_ws2", FIXTURES / "multifile" / "dcp_4ranks",
    FIXTURES / "multifile" / "dcp_2ranks_nocollectives",
    FIXTURES / "multifile" / "accelerate_fsdp", FIXTURES / "multifile" / "lightning_fsdp.ckpt",
    FIXTURES / "multifile" / "hf_storage" / "fqn_map", FIXTURES / "frameworks" / "accelerate_state",
    FIXTURES / "frameworks" / "llama_tied_bin_sharded"])
def test_the_fixtures_of_every_layout_are_whole(path: Path) -> None:
    report = whole(path)
    assert report.tensors and report.files
    if "hf_storage" not in str(path):
        assert report.bytes_checked > 0


# -- one torch file ---------------------------------------------------------

def test_a_flipped_tensor_byte_is_a_crc_problem_naming_the_tensor(saved: Path,
                                                                  tmp_path: Path) -> None:
    path = copy(saved / "model.pt", tmp_path)
    whole(path)
    start, size = data_at(path, "data/0")
    flip(path, start + size // 2)
    report = check(str(path), 2)
    assert found(report) == {("crc", "model.pt", "w")}
    assert "does not match its CRC-32" in report.problems[0].message


def test_a_torch_file_cut_short_is_truncated(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "model.pt", tmp_path)
    cut(path, os.path.getsize(path) // 2)
    assert found(check(str(path), 1)) == {("truncated", "model.pt", None)}


def test_a_flipped_pickle_byte_is_found_by_its_record_crc(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "model.pt", tmp_path)
    start, size = data_at(path, "data.pkl")
    flip(path, start + size // 2)
    report = check(str(path), 1)
    assert found(report) == {("crc", "model.pt", None)}
    assert "data.pkl" in report.problems[0].message


def test_every_flipped_byte_a_loader_reads_is_found_and_none_crashes(tmp_path: Path) -> None:
    """Bytes of every record's data, of each record's name (local and
    central), and of the central directory's CRC-32, sizes and offsets:
    found; a flip anywhere else is never a crash (exit 3 only where the
    magic number no longer says zip)."""
    src = tmp_path / "tiny.pt"
    torch.save({"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(2)}, src)
    data = src.read_bytes()
    must: set[int] = set()
    with open(src, "rb") as f:
        archive = ZipArchive(f, len(data))
        for m in archive.members.values():
            start = archive.data_offset(m)
            must |= {start, start + m.size - 1, m.header_offset + 30}  # data, local name
        at = archive.end_of_records
        while data[at:at + 4] == b"PK\x01\x02":  # central entries
            nlen, xlen, clen = struct.unpack_from("<HHH", data, at + 28)
            must |= {at + 16, at + 20, at + 24, at + 42, at + 46}  # crc, sizes, offset, name
            at += 46 + nlen + xlen + clen
    path = tmp_path / "flipped.pt"
    for i in sorted(must | set(range(0, len(data), 13))):
        damaged = bytearray(data)
        damaged[i] ^= 0x01
        path.write_bytes(damaged)
        try:
            report = check(str(path), 1)
        except InputError:
            assert i < 4, i  # PK\x03\x04 no more: no checkpoint at all
            continue
        assert i not in must or not report.ok, i


def test_legacy_and_plain_pickles_cut_or_flipped(saved: Path, tmp_path: Path) -> None:
    legacy = copy(saved / "legacy.pt", tmp_path)
    cut(legacy, os.path.getsize(legacy) - 100)
    assert found(check(str(legacy), 1)) == {("truncated", "legacy.pt", None)}
    plain = copy(saved / "plain.pkl", tmp_path)
    cut(plain, 40)
    (kind, file, _), = found(check(str(plain), 1))
    assert (kind, file) in {("pickle", "plain.pkl"), ("truncated", "plain.pkl")}


def test_torchscript_damage(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "script.pt", tmp_path)
    start, _ = data_at(path, "data/0")
    flip(path, start)
    assert found(check(str(path), 1)) == {("crc", "script.pt", "weight")}


# -- safetensors --------------------------------------------------------------

def test_safetensors_damage(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "model.safetensors", tmp_path)
    flip(path, 12)  # inside the JSON header
    assert found(check(str(path), 1)) == {("header", "model.safetensors", None)}
    shutil.copy(saved / "model.safetensors", path)
    cut(path, os.path.getsize(path) - 10)
    report = check(str(path), 1)
    assert found(report) == {("truncated", "model.safetensors", None)}
    assert any(f"'{k}'" in report.problems[0].message for k in ("w", "b", "emb.weight"))


def test_a_flipped_safetensors_data_byte_is_said_to_need_a_manifest(saved: Path,
                                                                     tmp_path: Path) -> None:
    """safetensors records no checksum: its tensor bytes can only be
    checked against a manifest, and the report says so."""
    path = copy(saved / "model.safetensors", tmp_path)
    flip(path, os.path.getsize(path) - 5)
    report = check(str(path), 1)
    assert report.ok and report.bytes_checked == 0
    assert any("no checksum" in n and "--manifest" in n for n in report.notes)


# -- Hugging Face shards ------------------------------------------------------

def test_hf_shards_every_damage_at_once(saved: Path, tmp_path: Path) -> None:
    """A shard missing, another cut short, a shard file nothing names: all
    three said (the index's reader stops at the first)."""
    path = copy(saved / "hf", tmp_path)
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    os.remove(path / shards[1])
    cut(path / shards[0], 3000)
    shutil.copy(path / shards[2], path / "model-00009-of-00009.safetensors")
    report = check(str(path), 2)
    assert found(report) == {("missing-file", shards[1], None), ("truncated", shards[0], None),
                             ("extra-file", "model-00009-of-00009.safetensors", None)}
    missing = next(p for p in report.problems if p.kind == "missing-file")
    assert "emb.weight" in missing.message  # what it should have held


def test_hf_index_against_its_shards(saved: Path, tmp_path: Path) -> None:
    import json

    path = copy(saved / "hf", tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard_w, shard_b = index["weight_map"]["w"], index["weight_map"]["b"]
    index["weight_map"]["w"] = shard_b  # where it is not
    index["weight_map"]["ghost"] = shard_w  # stored nowhere
    del index["weight_map"]["b"]  # stored, not listed
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert found(check(str(path), 2)) == {
        ("missing-tensor", shard_b, "w"), ("missing-tensor", shard_w, "ghost"),
        ("unlisted-tensor", shard_b, "b")}


def test_hf_tensor_stored_twice(saved: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = copy(saved / "hf", tmp_path)
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    first, other = load_file(path / shards[0]), load_file(path / shards[2])
    save_file({**other, **{k: v for k, v in first.items()}}, str(path / shards[2]))
    report = check(str(path), 1)
    assert ("duplicate", shards[2], "w") in found(report)


def test_hf_damaged_index_still_checks_the_shards(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "hfbin", tmp_path)
    (path / "pytorch_model.bin.index.json").write_text('{"weight_map": {"w": ')
    shard = sorted(n for n in os.listdir(path) if n.endswith(".bin"))[0]
    start, _ = data_at(path / shard, "data/0")
    flip(path / shard, start)
    report = check(str(path), 1)
    assert report.layout == "hf-bin"
    assert found(report) == {("header", "pytorch_model.bin.index.json", None),
                             ("crc", shard, None)}


def test_hf_bin_shard_crc_names_its_tensor(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "hfbin", tmp_path)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".bin"))[0]
    start, size = data_at(path / shard, "data/0")
    flip(path / shard, start + size - 1)
    assert found(check(str(path), 1)) == {("crc", shard, "w")}


# -- DCP ------------------------------------------------------------------------

def _items(folder: Path) -> list[tuple[str, int, int]]:
    """(fqn, offset, length) of every item, in file order (our own fixture:
    torch may unpickle its .metadata)."""
    md = pickle.loads((folder / ".metadata").read_bytes())
    return sorted(((k.fqn, v.offset, v.length) for k, v in md.storage_data.items()),
                  key=lambda item: item[1])


def _edit_metadata(folder: Path, edit: object) -> None:
    md = pickle.loads((folder / ".metadata").read_bytes())
    edit(md)  # type: ignore[operator]
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def test_dcp_flipped_tensor_byte_is_found_in_its_chunk(saved: Path, tmp_path: Path) -> None:
    """Each DCP item is a whole torch.save archive: its tensor bytes carry a
    CRC-32, and a flipped byte is found in the chunk that holds it."""
    path = copy(saved / "dcp", tmp_path)
    _, offset, length = next(i for i in _items(path) if i[0] == "model.w")
    flip(path / "__0_0.distcp", offset + length // 2)
    report = check(str(path), 2)
    assert found(report) == {("crc", "__0_0.distcp", "model.w")}
    assert "its chunk at [0, 0]" in report.problems[0].message


def test_dcp_truncated_missing_renamed_and_extra_files(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "dcp", tmp_path)
    last = _items(path)[-1]
    cut(path / "__0_0.distcp", last[1] + 10)
    assert found(check(str(path), 1)) == {("truncated", "__0_0.distcp", last[0])}
    os.rename(path / "__0_0.distcp", path / "__0_1.distcp")  # renamed: one missing, one extra
    assert found(check(str(path), 1)) == {("missing-file", "__0_0.distcp", None),
                                          ("extra-file", "__0_1.distcp", None)}


def test_dcp_chunk_moved(saved: Path, tmp_path: Path) -> None:
    """.metadata pointing elsewhere: two chunks' offsets swapped, one
    shifted off the start of its archive."""
    path = copy(saved / "dcp", tmp_path)

    def swap(md: object) -> None:
        infos = {k.fqn: v for k, v in md.storage_data.items()}  # type: ignore[attr-defined]
        w, b = infos["model.w"], infos["model.b"]
        w.offset, b.offset, w.length, b.length = b.offset, w.offset, b.length, w.length

    _edit_metadata(path, swap)
    problems = found(check(str(path), 1))
    assert ("mismatch", "__0_0.distcp", "model.w") in problems
    assert ("mismatch", "__0_0.distcp", "model.b") in problems

    shutil.rmtree(path)
    path = copy(saved / "dcp", tmp_path)

    def shift(md: object) -> None:
        next(v for k, v in md.storage_data.items()  # type: ignore[attr-defined]
             if k.fqn == "model.w").offset += 8

    _edit_metadata(path, shift)
    assert ("mismatch", "__0_0.distcp", "model.w") in found(check(str(path), 1))


def test_dcp_damaged_metadata(saved: Path, tmp_path: Path) -> None:
    path = copy(saved / "dcp", tmp_path)
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[:len(data) // 2])
    report = check(str(path), 1)
    assert found(report) == {("truncated", ".metadata", None)}  # cut short: truncated
    assert report.tensors is None


def test_dcp_chunks_that_leave_a_gap_or_overlap(tmp_path: Path) -> None:
    """4 ranks' chunks (committed fixture): one chunk made larger (two hold
    one element), then the tensor made larger (no chunk holds its end)."""
    path = copy(FIXTURES / "multifile" / "dcp_4ranks", tmp_path)
    md = pickle.loads((path / ".metadata").read_bytes())
    name, tm = next((k, v) for k, v in md.state_dict_metadata.items()
                    if hasattr(v, "chunks") and len(v.chunks) > 1 and len(v.size) == 2)
    first = tm.chunks[0]
    tm.chunks[0] = type(first)(offsets=first.offsets,
                               sizes=torch.Size([first.sizes[0] + 1, first.sizes[1]]))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    assert ("coverage-overlap", ".metadata", name) in found(check(str(path), 1))
    tm.chunks[0] = first
    tm.size = torch.Size([tm.size[0] + 1, tm.size[1]])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    assert ("coverage-gap", ".metadata", name) in found(check(str(path), 1))


def test_no_flipped_byte_of_a_dcp_directory_crashes(tmp_path: Path) -> None:
    """A byte flipped anywhere in .metadata or a .distcp (a sample): a
    report every time, never an exception; one in a tensor's bytes found."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"m": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 2}, checkpoint_id=path,
                 no_dist=True)
    (_, offset, length), = [i for i in _items(path) if i[0] == "m.w"]
    for name in (".metadata", "__0_0.distcp"):
        data = (path / name).read_bytes()
        for i in range(0, len(data), 53):
            damaged = bytearray(data)
            damaged[i] ^= 0x01
            (path / name).write_bytes(damaged)
            check(str(path), 1)
        (path / name).write_bytes(data)
    data = (path / "__0_0.distcp").read_bytes()
    tensor = data.index(torch.arange(6.0).numpy().tobytes(), offset, offset + length)
    flip(path / "__0_0.distcp", tensor + 9)
    assert found(check(str(path), 1)) == {("crc", "__0_0.distcp", "m.w")}


# -- files saved per rank, DeepSpeed, HF storage shards, framework folders ----

def test_per_rank_missing_ranks_are_named(tmp_path: Path) -> None:
    path = copy(RANKS / "mesh2d_ws4", tmp_path)
    os.remove(path / "model_world_size_4_rank_1.pt")  # the directory no longer reads
    report = check(str(path), 1)
    assert found(report) == {("missing-file", "model_world_size_4_rank_1.pt", None)}
    assert report.layout == "dtensor-ranks"
    shutil.move(path / "model_world_size_4_rank_3.pt", path / "model_world_size_4_rank_1.pt")
    assert found(check(str(path), 1)) == {("missing-file", "model_world_size_4_rank_3.pt", None)}


def test_per_rank_damage_in_two_files_is_said_for_both(tmp_path: Path) -> None:
    path = copy(RANKS / "fsdp2_ws2", tmp_path)
    cut(path / "model_world_size_2_rank_0.pt", 3000)
    start, _ = data_at(path / "model_world_size_2_rank_1.pt", "data/0")
    flip(path / "model_world_size_2_rank_1.pt", start)
    assert found(check(str(path), 2)) == {
        ("truncated", "model_world_size_2_rank_0.pt", None),
        ("crc", "model_world_size_2_rank_1.pt", None)}


def test_per_rank_crc_names_the_joined_tensor(tmp_path: Path) -> None:
    path = copy(RANKS / "fsdp2_ws2", tmp_path)
    start, _ = data_at(path / "model_world_size_2_rank_1.pt", "data/0")
    flip(path / "model_world_size_2_rank_1.pt", start)
    (problem,) = check(str(path), 1).problems
    assert (problem.kind, problem.file) == ("crc", "model_world_size_2_rank_1.pt")
    assert problem.tensor is not None  # the logical tensor whose shard it holds


def test_deepspeed_damage(tmp_path: Path) -> None:
    path = copy(DEEPSPEED / "z2_fp32", tmp_path)
    tag = path / "global_step2"
    os.remove(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert found(check(str(path), 1)) == {
        ("missing-file", "zero_pp_rank_1_mp_rank_00_optim_states.pt", None)}
    source = DEEPSPEED / "z2_fp32" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(source, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    shutil.copy(source, tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")  # of no rank saved
    assert found(check(str(path), 1)) == {
        ("extra-file", "zero_pp_rank_2_mp_rank_00_optim_states.pt", None)}
    cut(tag / "mp_rank_00_model_states.pt", 1000)
    assert ("truncated", "mp_rank_00_model_states.pt", None) in found(check(str(path), 1))


def test_deepspeed_flipped_partition_byte_names_its_parameters(tmp_path: Path) -> None:
    """A flipped byte of a rank's fp32 partition: the record named, with
    the parameters whose runs lie in it."""
    path = copy(DEEPSPEED / "z2_fp32", tmp_path)
    report = check(str(path), 1)
    ckpt = report.checkpoint
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    chunk = next(c for t in ckpt.tensors for c in t.chunks if c.file == name and c.byte_length)
    flip(path / "global_step2" / name, chunk.byte_offset)
    (problem,) = check(str(path), 1).problems
    assert (problem.kind, problem.file) == ("crc", name)
    assert problem.tensor or "it holds" in problem.message


def test_hf_storage_shards_cut_or_missing(tmp_path: Path) -> None:
    path = copy(FIXTURES / "multifile" / "hf_storage" / "distributed", tmp_path)
    name = "shard-00002-model-00001-of-00001.safetensors"
    cut(path / name, os.path.getsize(path / name) - 4)
    assert found(check(str(path), 1)) == {("truncated", name, None)}
    os.remove(path / "shard-00001-model-00001-of-00001.safetensors")
    shutil.copy(FIXTURES / "multifile" / "hf_storage" / "distributed" / name, path / name)
    (problem,) = check(str(path), 1).problems
    assert problem.kind == "missing-file"


def test_framework_companions_are_checked(tmp_path: Path) -> None:
    """A Trainer's or accelerate's optimizer and scheduler states beside the
    model: checked like it."""
    path = copy(FIXTURES / "frameworks" / "accelerate_state", tmp_path)
    start, _ = data_at(path / "optimizer.bin", "data/0")
    flip(path / "optimizer.bin", start)
    cut(path / "scheduler.bin", 500)
    assert found(check(str(path), 2)) == {("crc", "optimizer.bin", None),
                                          ("truncated", "scheduler.bin", None)}


def test_a_damaged_model_does_not_hide_its_companions(tmp_path: Path) -> None:
    """The model cut short (its folder no longer reads as a framework's):
    the files beside it are still checked, each alone."""
    path = copy(FIXTURES / "frameworks" / "accelerate_state", tmp_path)
    cut(path / "model.safetensors", 3000)
    start, _ = data_at(path / "optimizer.bin", "data/0")
    flip(path / "optimizer.bin", start)
    assert found(check(str(path), 2)) == {("truncated", "model.safetensors", None),
                                          ("crc", "optimizer.bin", None)}


def test_no_checkpoint_at_all_raises(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputError):
        check(str(tmp_path / "notes.txt"), 1)
    with pytest.raises(InputError):
        check(str(tmp_path / "absent.pt"), 1)


def test_a_whole_file_that_runs_code_says_so(tmp_path: Path) -> None:
    report = check(str(Path(__file__).resolve().parent.parent / "samples" /
                       "hostile_runs_code.pth"), 1)
    assert report.ok
    assert any("weights_only=False" in n and "diagnose" in n for n in report.notes)


def test_a_dcp_save_killed_before_its_metadata_is_a_problem(saved: Path,
                                                            tmp_path: Path) -> None:
    """What a dcp.save killed mid-save leaves (its data files, no .metadata)
    is named, never a crash."""
    folder = copy(saved / "dcp", tmp_path)
    (folder / ".metadata").unlink()
    report = check(str(folder), 1)
    assert not report.ok
    assert ("missing-file", ".metadata") in [(p.kind, p.file) for p in report.problems]


def test_what_a_layout_reader_would_pass_over_is_named(tmp_path: Path) -> None:
    """Damage that leaves the rest readable: a HuggingFaceStorageWriter shard
    overwritten, one rank's file of per-rank DTensor files gone, an
    accelerate folder's model whose .metadata was never written."""
    multifile = Path(__file__).parent / "fixtures" / "multifile"
    storage = copy(multifile / "hf_storage" / "distributed", tmp_path)
    shard = next(storage.glob("shard-00002-*.safetensors"))
    with open(shard, "r+b") as f:
        f.write(b"garbage!")
    report = check(str(storage), 1)
    assert [(p.kind, p.file) for p in report.problems][:1] == [("header", shard.name)]
    ranks = copy(multifile / "per_rank_dtensor" / "fsdp2_ws2", tmp_path)
    (ranks / "model_world_size_2_rank_1.pt").unlink()
    assert ("missing-file", "model_world_size_2_rank_1.pt") in found_files(check(str(ranks), 1))
    folder = copy(multifile / "accelerate_fsdp", tmp_path)
    (folder / "pytorch_model_fsdp_0" / ".metadata").unlink()
    assert ("missing-file", "pytorch_model_fsdp_0/.metadata") in found_files(
        check(str(folder), 1))


def found_files(report: Report) -> set[tuple[str, str | None]]:
    return {(p.kind, p.file) for p in report.problems}
