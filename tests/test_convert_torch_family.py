"""ckptool convert of the torch files fix cannot rewrite (TorchScript archives,
plain pickles) into a torch zip state dict: values, dtypes and shapes as
the source holds them, tied weights sharing storage again, views as their
own tensors, what is left out said; a plain pickle's tensor bytes read in
place; and fix's refusal of both formats pointing to convert."""

from __future__ import annotations

import json
import pickle
import shlex
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import saved_on
from torch import nn

import ckptool
from ckptool.read.tensor_data import TensorData
from ckptool.write.fix.preview import preview

CliRun = Callable[..., tuple[int, str, str]]


class TiedWithViews(nn.Module):
    """An embedding and a head sharing one weight, and buffers that view one
    storage: itself, transposed (not contiguous) and one row (an offset)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        base = torch.arange(12.0).reshape(3, 4)
        self.register_buffer("base", base)
        self.register_buffer("base_t", base.t())
        self.register_buffer("row", base[1])
        self.register_buffer("scale", torch.linspace(0, 1, 5).half())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x)) + self.base_t.sum() + self.row.sum()


def plain_state() -> dict[str, torch.Tensor]:
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    return {
        "w": w, "tied": w,  # one tensor twice: the pickle memoizes it
        "row": w[1],  # an offset view (its own embedded storage in a pickle)
        "t": w.t(),  # not contiguous
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "fp16": torch.tensor([0.5, -2.0]).half(),
        "flags": torch.tensor([True, False]),
        "i64": torch.tensor(2**40),  # a scalar
        "empty": torch.zeros(0, 3),
    }


def same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key].float(), value.float()), key


def shares(sd: dict[str, torch.Tensor], a: str, b: str) -> bool:
    return bool(sd[a].untyped_storage().data_ptr() == sd[b].untyped_storage().data_ptr())


def test_torchscript_to_torch_keeps_ties_and_writes_views(tmp_path: Path,
                                                          run_cli: CliRun) -> None:
    src, out = tmp_path / "script.pt", tmp_path / "weights.pth"
    torch.jit.script(TiedWithViews()).save(str(src))
    want = torch.jit.load(str(src)).state_dict()
    code, stdout, _ = run_cli("convert", str(src), str(out), "--json")
    assert code == 0
    report = json.loads(stdout)
    assert (report["input_format"], report["output_format"]) == ("torchscript", "torch-zip")
    assert report["aliases"] == {"head.weight": "embed.weight"}
    assert report["copied_views"] == ["base", "base_t", "row"]
    assert report["tensors"] == len(want) - 1 and report["left_out"] == []
    got = torch.load(out, weights_only=True)
    same_tensors(got, want)
    assert shares(got, "embed.weight", "head.weight")
    assert not shares(got, "base", "base_t")  # a view is its own contiguous copy
    assert got["base_t"].is_contiguous()
    # a state dict a fresh module loads strictly
    model = TiedWithViews()
    assert str(model.load_state_dict(got, strict=True)) == "<All keys matched successfully>"
    assert zipfile.ZipFile(out).read("weights/byteorder") == b"little"


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_plain_pickle_to_torch(tmp_path: Path, protocol: int, run_cli: CliRun) -> None:
    src, out = tmp_path / "weights.pkl", tmp_path / "weights.pth"
    with src.open("wb") as f:
        pickle.dump(plain_state(), f, protocol=protocol)
    code, stdout, _ = run_cli("convert", str(src), str(out), "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["input_format"] == "pickle" and report["aliases"] == {"tied": "w"}
    got = torch.load(out, weights_only=True)
    with src.open("rb") as f:
        same_tensors(got, pickle.load(f))
    assert shares(got, "w", "tied") and not shares(got, "w", "row")
    assert got["t"].is_contiguous()


def test_plain_pickle_to_safetensors(tmp_path: Path, run_cli: CliRun) -> None:
    from safetensors.torch import load_file

    src, out = tmp_path / "weights.pkl", tmp_path / "weights.safetensors"
    state = plain_state()
    src.write_bytes(pickle.dumps(state))
    assert run_cli("convert", str(src), str(out), "-q")[0] == 0
    got = load_file(str(out))
    assert sorted(got) == sorted(k for k in state if k != "tied")  # tied: an alias
    for key, value in got.items():
        assert torch.equal(value.float(), state[key].float()), key


def test_plain_pickle_values_are_read_where_the_file_holds_them(tmp_path: Path) -> None:
    src = tmp_path / "weights.pkl"
    state = plain_state()
    src.write_bytes(pickle.dumps(state))
    ckpt = ckptool.open(src)
    data = src.read_bytes()
    with TensorData(ckpt) as reader:
        for t in ckpt.tensors:
            assert torch.equal(reader.values(t).float(), state[t.key].float()), t.key
            storage = ckpt.storages[t.storage or ""]
            # the record is an offset into the file, where the bytes are as they are
            assert storage.record is not None and storage.record.startswith("@")
            at = int(storage.record[1:])
            assert data[at:at + storage.nbytes] == reader.storage_bytes(storage.id)


def test_what_is_left_out_is_said(tmp_path: Path, run_cli: CliRun) -> None:
    src, out = tmp_path / "run.pkl", tmp_path / "run.pth"
    sd = {"w": torch.ones(2, 3), "sp": torch.eye(3).to_sparse(),
          "q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
          "norm._extra_state": {"scale": 2}}
    with saved_on("cuda:1"), src.open("wb") as f:
        pickle.dump({"state_dict": sd, "epoch": 3, "opt": {"m": torch.zeros(2)}}, f)
    code, stdout, _ = run_cli("convert", str(src), str(out), "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["left_out"] == [
        "sp (a sparse_coo tensor: convert writes dense tensors only; "
        ".to_dense() it first to keep it)",
        "q (a quantized tensor: convert writes plain tensors only; "
        ".dequantize() it first to keep it)",
        "1 tensor outside 'state_dict' (e.g. opt/m)",
        "state_dict/norm._extra_state (dict)",
        "epoch (int)",
    ]
    assert report["notes"] == ["storages saved on cuda:1 are written as on cpu "
                               "(`ckptool fix --to DEVICE` retargets them)"]
    got = torch.load(out, weights_only=True)  # no GPU needed: written as on cpu
    assert list(got) == ["w"] and torch.equal(got["w"], torch.ones(2, 3))


def test_big_endian_torchscript_is_written_little_endian(tmp_path: Path,
                                                         run_cli: CliRun) -> None:
    little, big, out = tmp_path / "little.pt", tmp_path / "big.pt", tmp_path / "out.pth"
    torch.jit.script(TiedWithViews()).save(str(little))
    want = torch.jit.load(str(little)).state_dict()
    sizes = {s.record: torch.empty(0, dtype=getattr(torch, s.dtype)).element_size()
             for s in ckptool.open(little).storages.values()}
    with zipfile.ZipFile(little) as zin, zipfile.ZipFile(big, "w") as zout:
        for info in zin.infolist():
            raw = zin.read(info)
            if info.filename in sizes:  # each element's bytes reversed
                raw = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(
                    -1, sizes[info.filename]).flip(1).numpy().tobytes()
            if info.filename.endswith("/byteorder"):
                raw = b"big"
            zout.writestr(info.filename, raw)
    assert run_cli("convert", str(big), str(out), "-q")[0] == 0
    same_tensors(torch.load(out, weights_only=True), want)


def test_protocol_2_pickle_says_why(tmp_path: Path, run_cli: CliRun) -> None:
    src, out = tmp_path / "old.pkl", tmp_path / "old.pth"
    src.write_bytes(pickle.dumps({"w": torch.ones(2)}, protocol=2))
    code, stdout, stderr = run_cli("convert", str(src), str(out))
    assert code != 0 and stdout == ""
    assert "spelled as text in the pickle (as pickle protocols 0 to 2 write bytes)" in stderr
    assert not out.exists()


@pytest.mark.parametrize("kind", ["torchscript", "pickle"])
def test_fix_points_to_convert(tmp_path: Path, kind: str, run_cli: CliRun,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    src = "model.pt" if kind == "torchscript" else "model.pkl"
    if kind == "torchscript":
        torch.jit.script(TiedWithViews()).save(src)
    else:
        Path(src).write_bytes(pickle.dumps(plain_state()))
    code, _, stderr = run_cli("fix", src, "--extract")
    assert code != 0
    what = "a TorchScript archive" if kind == "torchscript" else "a plain pickle"
    assert f"this is {what}\n" in stderr
    assert f"`ckptool convert {src} model.pth` (or into safetensors: " \
           f"`ckptool convert {src} model.safetensors`)" in stderr
    if kind == "pickle":
        assert "torchscript" not in stderr.lower()
    with pytest.raises(ckptool.CkptoolError) as refused:  # the browser's preview too
        preview(ckptool.open(src), ckptool.FixOptions())
    assert f"`ckptool convert {src} model.pth`" in refused.value.hint
    # the command it names works, and fix rewrites what it writes
    command = stderr.split("`")[1]
    assert run_cli(*shlex.split(command)[1:], "-q")[0] == 0
    assert run_cli("fix", "model.pth", "--strip-prefix", "embed.", "-q")[0] == 0


def test_the_hint_never_names_the_input_as_output(tmp_path: Path, run_cli: CliRun) -> None:
    src = tmp_path / "weights.pth"  # a plain pickle under torch's usual name
    src.write_bytes(pickle.dumps(plain_state()))
    _, _, stderr = run_cli("fix", str(src))
    assert f"`ckptool convert {src} {tmp_path / 'weights.weights.pth'}`" in stderr


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_torch_save_files_are_sent_to_fix(tmp_path: Path, legacy: bool,
                                          run_cli: CliRun) -> None:
    src, out = tmp_path / "m.pt", tmp_path / "m.pth"
    torch.save({"w": torch.ones(2)}, src, _use_new_zipfile_serialization=not legacy)
    code, _, stderr = run_cli("convert", str(src), str(out))
    assert code == 2 and not out.exists()
    fmt = "torch-legacy" if legacy else "torch-zip"
    assert f"is already a torch checkpoint ({fmt}): `ckptool fix` rewrites it" in stderr
    assert f"`ckptool fix {src} --extract -o {out}`" in stderr  # no PATH for --extract
