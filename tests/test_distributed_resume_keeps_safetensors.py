"""A re-run of a distributed convert keeps what an earlier run wrote and
verified whatever the input: from a safetensors file or HF safetensors
shards too, whose tensors carry no CRC of their own (the CRC recorded is
the one the copy took from the bytes it wrote). Every rank wrote its whole
share, then rank 0 failed at the commit: the re-run keeps every byte and
writes none; a kept range damaged since is written again. Ranks run as
threads of this process over one in-memory store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import on_thread_ranks
from safetensors.torch import save_file

from ckptool.errors import CkptoolError
from ckptool.write.convert.run import convert as convert_one
from ckptool.write.distributed.run import convert as convert_rank
from ckptool.write.distributed.staging import Staging

TENSORS = 8
NBYTES = 64 * 64 * 4


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import huggingface_hub as hub

    root = tmp_path_factory.mktemp("resume_st")
    g = torch.Generator().manual_seed(6)
    tensors = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(TENSORS)}
    save_file(tensors, root / "in.safetensors")
    (root / "hf").mkdir()
    hub.save_torch_state_dict(tensors, root / "hf", max_shard_size="40KB")
    return {"safetensors": root / "in.safetensors", "hf": root / "hf"}


def on_ranks(src: Path, out: Path, **options: Any) -> list[Any]:
    said: list[CkptoolError] = []
    got = on_thread_ranks(2, lambda w: convert_rank(w, str(src), str(out), say=said.append,
                                                    **options), (CkptoolError, OSError))
    assert len(said) <= 1, said
    return [said[0] if said else got[0], *got[1:]]


def failed_at_the_commit(src: Path, out: Path, monkeypatch: pytest.MonkeyPatch,
                         **options: Any) -> Staging:
    """Every rank writes its share; rank 0 stops at the commit."""
    def commit(self: Staging, name: str | None, durable: bool) -> None:
        raise CkptoolError("stopped at the commit")

    with monkeypatch.context() as patched:
        patched.setattr(Staging, "commit", commit)
        said = on_ranks(src, out, **options)[0]
    assert isinstance(said, CkptoolError) and said.message == "stopped at the commit"
    assert not out.exists()
    return Staging(str(out), out.suffix == "")


def per_rank(result: Any, key: str) -> list[int]:
    return [r[key] for r in result.distributed["per_rank"]]


@pytest.mark.parametrize(("src", "name", "options"), [
    ("safetensors", "out.pt", {}),
    ("safetensors", "out_hf", {"fmt": "hf", "max_shard_size": 40000}),
    ("hf", "from_hf.pt", {}),
])
def test_a_rerun_keeps_every_byte_written(inputs: dict[str, Path], src: str, name: str,
                                          options: dict[str, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / name
    staging = failed_at_the_commit(inputs[src], out, monkeypatch, **options)
    assert all(entry["checks"] for entry in staging.recorded().values())
    result = on_ranks(inputs[src], out, **options)[0]
    assert result.distributed["resumed"]
    assert sum(per_rank(result, "bytes_kept")) == TENSORS * NBYTES
    assert per_rank(result, "bytes_written") == [0, 0]
    one, many = tmp_path / "one" / name, out  # (a zip's records are named for its file)
    one.parent.mkdir()
    convert_one(str(inputs[src]), str(one), **options)
    if one.is_dir():
        assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in many.iterdir())
        assert all((one / p.name).read_bytes() == (many / p.name).read_bytes()
                   for p in one.iterdir())
    else:
        assert one.read_bytes() == many.read_bytes()


def test_a_kept_range_damaged_since_is_written_again(inputs: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "many" / "out.pt"
    out.parent.mkdir()
    staging = failed_at_the_commit(inputs["safetensors"], out, monkeypatch)
    at, size, _ = staging.recorded()[("out.pt", "w3")]["checks"][-1]
    with open(staging.file("out.pt"), "r+b") as f:  # the disk lost a byte
        f.seek(at + size // 2)
        byte = f.read(1)
        f.seek(at + size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = on_ranks(inputs["safetensors"], out)[0]
    assert result.distributed["resumed"]
    assert sum(per_rank(result, "bytes_kept")) == (TENSORS - 1) * NBYTES
    assert sum(per_rank(result, "bytes_written")) >= NBYTES  # w3 (and its record's header)
    assert sum(per_rank(result, "bytes_written")) < 2 * NBYTES  # and nothing else
    convert_one(str(inputs["safetensors"]), str(tmp_path / "out.pt"))
    assert out.read_bytes() == (tmp_path / "out.pt").read_bytes()
