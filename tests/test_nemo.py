"""NeMo checkpoints without NeMo: a ``.nemo`` (an uncompressed tar) read in
place as the folder it holds (torch_dist ``model_weights/``, a
``model_weights.ckpt``, per-rank ``mp_rank_XX/`` refused with the way to
read one), a gzip ``.nemo`` and unsafe archives refused, and NeMo 2's
``weights/`` + ``context/`` folder. Fixtures: ``tests/fixtures/nemo/make_nemo.py``."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_nemo
from safetensors.torch import load_file

from ckptool.errors import InputError
from ckptool.read.archive import mounts, tar
from ckptool.read.megatron.nemo import flat_yaml
from ckptool.read.reader import open_checkpoint


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def _same(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    got = load_file(str(out))
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k


def test_a_torch_dist_nemo_reads_in_place(tmp_path: Path, run_cli: Any) -> None:
    path, tensors = make_nemo.make("dist", tmp_path)
    code, out, err = run_cli("inspect", str(path))
    assert code == 0, err
    out = " ".join(out.split())
    assert "Megatron-core torch_dist" in out
    assert ("NeMo 1 MegatronGPTModel · TP 1 x PP 1 · 2 layers · hidden 16 · precision "
            "bf16-mixed · nemo 1.23.0 (model_config.yaml)") in out
    before = _files(tmp_path)
    dest = tmp_path / "out.safetensors"
    code, out, err = run_cli("convert", str(path), str(dest))
    assert code == 0, out + err
    assert _files(tmp_path) - before == {dest}  # nothing extracted
    _same(dest, tensors)
    ckpt = open_checkpoint(str(path))
    assert ckpt.metadata["nemo"]["config"]["tensor_model_parallel_size"] == 1
    code, out, _ = run_cli("verify", str(path))
    assert code == 0 and "checked" in out


def test_a_model_weights_ckpt_nemo_reads_in_place(tmp_path: Path, run_cli: Any) -> None:
    path, tensors = make_nemo.make("ckpt", tmp_path)
    code, out, err = run_cli("inspect", str(path))
    assert code == 0, err
    assert "NeMo 1 MegatronGPTModel" in " ".join(out.split())
    before = _files(tmp_path)
    dest = tmp_path / "out.safetensors"
    code, out, err = run_cli("convert", str(path), str(dest))
    assert code == 0, out + err
    assert _files(tmp_path) - before == {dest}
    _same(dest, tensors)


def test_the_member_index_reads_headers_only(tmp_path: Path, monkeypatch: Any) -> None:
    path, _ = make_nemo.make("dist", tmp_path)
    read: list[tuple[int, int]] = []
    real = tar.fs.open_unmounted

    class Counting(io.RawIOBase):
        def __init__(self, f: Any) -> None:
            self.f = f

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

        def seek(self, *a: Any) -> int:
            return int(self.f.seek(*a))

        def tell(self) -> int:
            return int(self.f.tell())

        def readinto(self, b: Any) -> int:
            at = self.f.tell()
            n = self.f.readinto(b)
            read.append((at, n))
            return int(n)

        def fileno(self) -> int:
            return int(self.f.fileno())

    monkeypatch.setattr(tar.fs, "open_unmounted", lambda p: Counting(real(p)))
    archive = tar.index(str(path))
    # no byte of any member's data: headers (and padding) alone
    for m in archive.files.values():
        assert not [r for r in read if r[0] < m.offset + m.size and m.offset < r[0] + r[1]]
    assert sum(n for _, n in read) < path.stat().st_size / 2
    assert set(archive.files) >= {"model_config.yaml", "model_weights/.metadata",
                                  "model_weights/common.pt", "model_weights/metadata.json"}


def test_verify_finds_a_damaged_member(tmp_path: Path, run_cli: Any) -> None:
    path, _ = make_nemo.make("ckpt", tmp_path)
    with tarfile.open(path) as tf:
        m = tf.getmember("./model_weights.ckpt")
    data = bytearray(path.read_bytes())
    at = m.offset_data + m.size - 3000  # inside the last storage records
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, _ = run_cli("verify", str(path))
    assert code == 1, out


def test_tensor_parallel_ranks_are_joined_and_one_read_by_naming_it(
        tmp_path: Path, run_cli: Any) -> None:
    path, whole = make_nemo.make("tp2", tmp_path)
    code, out, err = run_cli("inspect", str(path))
    assert code == 0, err
    assert "NeMo 1's per-rank files" in out and "nemo-ranks · TP 2 x PP 1" in out
    dest = tmp_path / "whole.safetensors"
    code, out, err = run_cli("convert", str(path), str(dest))
    assert code == 0, out + err
    _same(dest, {k.removeprefix("model."): v for k, v in whole.items()})
    mounts.unmount_all()  # as a new run would: the member named before the archive is read
    one = f"{path}/mp_rank_00/model_weights.ckpt"
    dest = tmp_path / "rank0.safetensors"
    code, out, err = run_cli("convert", one, str(dest))
    assert code == 0, out + err
    _same(dest, make_nemo.tp_split(whole, 2)[0])


def test_a_gzip_nemo_is_refused(tmp_path: Path, run_cli: Any) -> None:
    path, _ = make_nemo.make("gz", tmp_path)
    code, _, err = run_cli("inspect", str(path))
    assert code == 3
    assert "gzip-compressed .nemo" in err and "tar xzf" in err


def _tar(path: Path, members: list[tuple[str, bytes | None, str]]) -> Path:
    """A tar of (name, data or None for a folder, link target) members."""
    with tarfile.open(path, "w:") as tf:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tf.addfile(info)
            elif data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


CONFIG = ("./model_config.yaml", b"num_layers: 2\n", "")


@pytest.mark.parametrize(("members", "said"), [
    ([CONFIG, ("../evil.txt", b"x", "")], "outside the archive"),
    ([CONFIG, ("/etc/evil", b"x", "")], "outside the archive"),
    ([CONFIG, ("./model_weights.ckpt", None, "/etc/passwd")], "is a link"),
    ([CONFIG, ("./model_weights.ckpt", b"a", ""), ("model_weights.ckpt", b"b", "")],
     "in the archive twice"),
])
def test_unsafe_archives_are_refused(tmp_path: Path, members: list[Any], said: str) -> None:
    path = _tar(tmp_path / "bad.nemo", members)
    with pytest.raises(InputError, match=said):
        open_checkpoint(str(path))
    assert not (tmp_path / "evil.txt").exists()


def test_a_rewritten_nemo_is_indexed_again(tmp_path: Path) -> None:
    path, _ = make_nemo.make("ckpt", tmp_path)
    assert len(open_checkpoint(str(path)).tensors) == 15
    os.replace(make_nemo.make("dist", tmp_path)[0], path)
    assert len(open_checkpoint(str(path)).tensors) == 9


def test_a_nemo2_folder_reads_its_weights_and_notes_its_context(tmp_path: Path,
                                                                 run_cli: Any) -> None:
    path, tensors = make_nemo.make("nemo2", tmp_path)
    code, out, err = run_cli("inspect", str(path))
    assert code == 0, err
    out = " ".join(out.split())
    assert "NeMo 2 LlamaModel · TP 1 x PP 1 · 2 layers · hidden 16 (context/model.yaml)" in out
    assert "is a NeMo 2 checkpoint: read weights/; context/ (io.json, model.yaml, " \
           "nemo_tokenizer/)" in out
    dest = tmp_path / "out.safetensors"
    code, out, err = run_cli("convert", str(path), str(dest))
    assert code == 0, out + err
    _same(dest, tensors)


def test_the_config_parser_reads_scalars_and_builds_nothing() -> None:
    text = ("a: 1\nb: 0.5\nc: null\nd: true\ne: 'x: y'\nf: plain # note\n"
            "g:\n  h: 2\n  i:\n    j: k\nl:\n- 1\n- 2\nm: |\n  text\n  more: 3\n"
            "n: !!python/object:os.system echo\no: [1, 2]\np: &anchor 3\n")
    assert flat_yaml(text) == {"a": 1, "b": 0.5, "c": None, "d": True, "e": "x: y",
                               "f": "plain", "g.h": 2, "g.i.j": "k"}
