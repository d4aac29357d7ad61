"""torch.export.save archives (.pt2), written by torch.export itself:
weights (by the exported module's names, ties shared) and constants
listed, read and converted; the program's JSON is never run."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.cli import main


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.emb = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.offset = torch.arange(3.0)  # a constant of the program

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.offset + self.head(x).sum()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(Net(), (torch.randn(2, 4),))
        path = tmp_path_factory.mktemp("pt2") / "net.pt2"
        torch.export.save(program, path)
    return path, {k: v.detach() for k, v in program.state_dict.items()}


def test_weights_and_constants_are_listed(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = exported
    ckpt = ckptool.open(path)
    assert ckpt.format == "torch-export" and not ckpt.unsafe_globals
    assert ckpt.main_state_dict is not None
    assert set(ckpt.main_state_dict.keys) == set(state)
    keys = {t.key for t in ckpt.tensors}
    assert "<constants>/offset" in keys or any(k.startswith("<constants>/") for k in keys)
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key["head.weight"].storage == by_key["emb.weight"].storage  # tied
    assert by_key["lin.weight"].is_parameter and not by_key["scale"].is_parameter


def test_values_are_the_programs(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = exported
    got = ckptool.load_state_dict(path)
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())


def test_convert_keeps_the_exports_names(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = exported
    out = tmp_path / "net.safetensors"
    assert main(["convert", str(path), str(out)]) == 0, capsys.readouterr().err
    written = load_file(out)
    assert set(written) == set(state) - {"head.weight"}  # tied to emb.weight, recorded
    assert all(torch.equal(written[k], state[k]) for k in written)


def test_a_damaged_archive_is_refused(tmp_path: Path,
                                      exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    import zipfile

    path, _ = exported
    broken = tmp_path / "broken.pt2"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(broken, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("data/weights/weight_0"):
                dst.writestr(info, src.read(info.filename))
    with pytest.raises(ckptool.CkptoolError, match=r"weight_0 is missing"):
        ckptool.open(broken)


def _edited(src: Path, dst: Path, edit: Any) -> Path:
    """``src`` with its weights' config edited by ``edit(config)``."""
    import json
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("model_weights_config.json"):
                config = json.loads(data)
                edit(next(iter(config["config"].values())))
                data = json.dumps(config).encode()
            zout.writestr(info, data)
    return dst


@pytest.mark.parametrize(("what", "edit"), [
    ("huge", lambda e: e["tensor_meta"].update(sizes=[{"as_int": 2**70}],
                                               strides=[{"as_int": 0}])),
    ("device", lambda e: e["tensor_meta"].update(device={"type": ["x"], "index": 10**30})),
    ("dtype", lambda e: e["tensor_meta"].update(dtype=[7])),
    ("record", lambda e: e.update(path_name=5)),
])
def test_a_bad_tensor_entry_is_refused(tmp_path: Path, what: str, edit: Any,
                                       exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path = _edited(exported[0], tmp_path / f"{what}.pt2", edit)
    with pytest.raises(ckptool.CkptoolError):
        ckptool.open(path)


def _pickled_weight(src: Path, dst: Path, blob: bytes) -> Path:
    """``src`` with its first weight marked use_pickle and its record ``blob``
    (torch.export.load reads such a record with torch.load, weights_only=False)."""
    import json
    import zipfile

    with zipfile.ZipFile(src) as zin:
        config_name = next(n for n in zin.namelist() if n.endswith("model_weights_config.json"))
        config = json.loads(zin.read(config_name))
        entry = next(iter(config["config"].values()))
        entry["use_pickle"] = True
        record = config_name.rsplit("/", 1)[0] + "/" + entry["path_name"]
        with zipfile.ZipFile(dst, "w") as zout:
            for info in zin.infolist():
                data = zin.read(info.filename)
                if info.filename == config_name:
                    data = json.dumps(config).encode()
                elif info.filename == record:
                    data = blob
                zout.writestr(info, data)
    return dst


def test_a_pickled_weight_is_read_for_what_it_names(
        tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from tests.test_safety_containers import zip_injected
    from tests.test_safety_corpus import CORPUS

    canary = tmp_path / "CANARY"
    clean, evil = tmp_path / "w.pt", tmp_path / "evil.pt"
    torch.save(torch.ones(2), clean)
    zip_injected(CORPUS["os_system"].build(canary), clean, evil)
    ok = ckptool.open(_pickled_weight(exported[0], tmp_path / "ok.pt2", clean.read_bytes()))
    assert ok.unsafe_globals == []
    bad = ckptool.open(_pickled_weight(exported[0], tmp_path / "bad.pt2", evil.read_bytes()))
    assert "os.system" in bad.unsafe_globals
    # bytes ckptool cannot read: torch unpickles them all the same, so unsafe
    junk = ckptool.open(_pickled_weight(exported[0], tmp_path / "junk.pt2", b"not a zip"))
    assert junk.unsafe_globals == ["torch.export.<a pickled record ckptool cannot read>"]
    assert "weights_only=False" in junk.globals[0].reason
    assert not canary.exists()
