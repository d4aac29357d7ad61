"""Directories that do not hold together, or that try to: every one is a
one-line error with exit 3 (never a traceback, never a wrong value written,
never minutes of work), or a note where nothing is wrong. DCP layouts are
made with torch's own metadata classes, then bent."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptool

hub = pytest.importorskip("huggingface_hub")
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multifile"
Box = tuple[tuple[int, ...], tuple[int, ...], Any]


def item(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def build(folder: Path, tensors: dict[str, tuple[Any, list[Box]]],
          values: dict[str, Any] | None = None) -> Path:
    """A DCP directory of one .distcp: ``tensors`` maps a name to (the whole
    tensor, or (shape, dtype)) and its chunks (offsets, sizes, the chunk's
    tensor or None to cut it from the whole one)."""
    folder.mkdir()
    data, sdm, storage = bytearray(), {}, {}
    for fqn, (whole, chunks) in tensors.items():
        shape, dtype = (whole.shape, whole.dtype) if isinstance(whole, torch.Tensor) else whole
        metas = []
        for i, (offsets, sizes, part) in enumerate(chunks):
            if part is None:
                box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                part = whole[box].clone()
            raw = item(part)
            storage[MetadataIndex(fqn, torch.Size(offsets), i)] = _StorageInfo(
                "__0_0.distcp", len(data), len(raw))
            data += raw
            metas.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), metas)
    for fqn, value in (values or {}).items():
        raw = item(value)
        storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", len(data), len(raw))
        data += raw
        sdm[fqn] = BytesStorageMetadata()
    (folder / "__0_0.distcp").write_bytes(data)
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, None, storage)))
    return folder


def hf_dir(tmp_path: Path) -> Path:
    """Two safetensors shards and their index, by huggingface_hub."""
    folder = tmp_path / "hf"
    folder.mkdir()
    hub.save_torch_state_dict({"a": torch.ones(300, 16), "b": torch.ones(300, 16)}, folder,
                              max_shard_size="10KB")
    return folder


def refused(run_cli: Callable[..., CliResult], path: Path, message: str,
            tmp_path: Path) -> None:
    """Every command refuses ``path`` with ``message``, exit 3, and writes nothing."""
    for args in (["inspect", str(path)], ["diagnose", str(path)], ["devices", str(path)],
                 ["diff", str(path), str(path)],
                 ["convert", str(path), str(tmp_path / "out.pt")]):
        code, out, err = run_cli(*args)
        assert (code, out) == (3, ""), (args, err)
        assert message in err and "Traceback" not in err and len(err.splitlines()) == 2
    assert not (tmp_path / "out.pt").exists()


def test_a_nul_byte_in_a_shard_name(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = hf_dir(tmp_path)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["a"] = "a\u0000b"
    index.write_text(json.dumps(data))
    refused(run_cli, folder, "with a NUL byte in it", tmp_path)


def test_sizes_the_file_does_not_back_are_refused_before_anything_is_made(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """A 1.5 kB chunk claiming a [2^19, 2^20] float32 box (2 TB): refused at
    read time, not when torch is asked for the memory."""
    small = torch.ones(2, 2)
    folder = build(tmp_path / "huge", {"w": (((1 << 20, 1 << 20), torch.float32), [
        ((0, 0), (1 << 19, 1 << 20), small), ((1 << 19, 0), (1 << 19, 1 << 20), small)])})
    refused(run_cli, folder, "but its item in __0_0.distcp is", tmp_path)


def test_chunks_that_cover_by_volume_but_not_by_place(tmp_path: Path,
                                                      run_cli: Callable[..., CliResult]) -> None:
    """23 dimensions, 24 chunks: one element held twice, one by none, the
    volumes adding up. The overlap is found (no wrong value is written)."""
    dims = 23
    whole = torch.randint(1, 100, (2,) * dims, dtype=torch.int8)
    boxes: list[Box] = [((1,) * k + (0,) * (dims - k), (1,) * k + (1,) + (2,) * (dims - 1 - k),
                         None) for k in range(dims)]
    boxes.append(((0,) * (dims - 1) + (1,), (1,) * dims, None))
    assert sum(math.prod(s) for _, s, _ in boxes) == whole.numel()
    folder = build(tmp_path / "grid", {"w": (whole, boxes)})
    refused(run_cli, folder, "two of its chunks both hold the element", tmp_path)


def test_a_gap_is_named(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    whole = torch.arange(12.0).reshape(3, 4)
    folder = build(tmp_path / "gap", {"w": (whole, [((0, 0), (2, 4), None)])})
    refused(run_cli, folder, "w is not whole: no chunk holds the element at [2, 0]", tmp_path)


def test_a_shard_that_is_a_directory(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = hf_dir(tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    inner = tmp_path / "inner.safetensors"
    shard.rename(inner)
    shard.mkdir()
    inner.rename(shard / "inner.safetensors")
    refused(run_cli, folder, f"{shard.name} (named by model.safetensors.index.json) is not a "
            "file", tmp_path)


def test_data_files_without_their_metadata(tmp_path: Path,
                                           run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "copied"
    shutil.copytree(FIXTURES / "dcp_4ranks", folder)
    (folder / ".metadata").unlink()  # what `cp src/* dst/` does
    refused(run_cli, folder, "but no .metadata to say what is in them", tmp_path)


def test_metadata_that_is_some_other_pickle(tmp_path: Path,
                                            run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "other"
    shutil.copytree(FIXTURES / "dcp_4ranks", folder)
    (folder / ".metadata").write_bytes(pickle.dumps({"hello": [1, 2, 3]}))
    refused(run_cli, folder, ".metadata holds dict", tmp_path)


def test_a_broken_index(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = hf_dir(tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:40])  # cut short
    refused(run_cli, folder, "model.safetensors.index.json is not a shard index", tmp_path)


def test_a_stray_broken_link_is_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_4ranks", folder)
    os.symlink(tmp_path / "nowhere", folder / "__9_0.distcp")
    (folder / "__5_0.distcp").mkdir()
    ckpt = ckptool.open(folder)
    assert {f.path for f in ckpt.files} >= {"__0_0.distcp", "__3_0.distcp"}
    assert not {"__9_0.distcp", "__5_0.distcp"} & {f.path for f in ckpt.files}


def test_a_second_accelerate_model_is_named_not_merged(tmp_path: Path) -> None:
    folder = tmp_path / "acc"
    shutil.copytree(FIXTURES / "accelerate_fsdp", folder)
    shutil.copytree(folder / "pytorch_model_fsdp_0", folder / "pytorch_model_fsdp_1")
    ckpt = ckptool.open(folder)
    assert ckpt.metadata["metadata_files"] == [
        "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"]
    assert any("pytorch_model_fsdp_1/" in n for n in ckpt.metadata["notes"])
    assert ckpt.warnings == []


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_chunk_that_is_a_payload_is_named_unsafe(tmp_path: Path,
                                                   run_cli: Callable[..., CliResult]) -> None:
    marker = tmp_path / "ran"
    folder = build(tmp_path / "evil", {"w": (((2, 2), torch.float32), [
        ((0, 0), (2, 2), RunsCode(marker))])})
    code, out, err = run_cli("convert", str(folder), str(tmp_path / "out.pt"))
    assert (code, out) == (3, "") and "names unsafe globals (posix.system)" in err, err
    code, out, err = run_cli("diff", str(folder), str(folder))  # values not compared, and why
    assert "names unsafe globals (posix.system)" in " ".join(out.split()), out
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_an_index_that_names_no_tensors(tmp_path: Path,
                                        run_cli: Callable[..., CliResult]) -> None:
    folder = hf_dir(tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    refused(run_cli, folder, "names no tensors: its weight_map is empty", tmp_path)


def test_a_missing_file_is_named_with_the_metadata_that_names_it(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "acc"
    shutil.copytree(FIXTURES / "accelerate_fsdp", folder)
    (folder / "optimizer_0" / "__1_0.distcp").unlink()
    refused(run_cli, folder, "optimizer_0/__1_0.distcp is missing (named by "
            "optimizer_0/.metadata)", tmp_path)
