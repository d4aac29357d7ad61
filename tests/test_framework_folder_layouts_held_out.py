"""Framework folders of kinds a held-out sweep found (each built from a real
fixture folder, as the library lays it out):

- an OpenVINO export beside the model (optimum-intel's
  ``openvino_model.xml``/``.bin``, raw weights): no pickle, so never a
  code-running companion; copied by fix and convert;
- ``custom_generate/``: code ``trust_remote_code=True`` runs, named as such;
- a sentence-transformers model whose transformer sits in a module folder
  (``0_Transformer/``, a Router's ``query_0_Transformer/``): its modules are
  named, one to read;
- ``fix -o OUT/`` of a folder holding the model only as a variant writes the
  plain name, which the loader reads without ``variant=``;
- ``fix -o OUT/`` of an accelerate folder says load_state needs more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.gpus.machine import Machine
from ckptool.cli import main
from ckptool.errors import InputError

HERE = Path(__file__).parent / "fixtures" / "frameworks"
CPU = Machine((), False, None, "none", "")


def test_an_openvino_export_beside_the_model_is_no_pickle(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    folder = tmp_path / "ov"
    shutil.copytree(HERE / "llama_tied", folder)
    (folder / "openvino_model.xml").write_text("<?xml version='1.0'?><net name='m'/>\n")
    (folder / "openvino_model.bin").write_bytes(bytes(range(7, 200)) * 3)  # raw weights
    ckpt = ckptool.open(str(folder))
    assert ckpt.framework is not None
    roles = {c.path: c for c in ckpt.framework.companions}
    assert "OpenVINO" in (roles["openvino_model.bin"].role or "")
    assert not roles["openvino_model.bin"].unsafe
    assert diagnose(ckpt, CPU).findings == []
    assert main(["fix", str(folder), "--dtype", "bf16", "-o", str(tmp_path / "out") + "/"]) == 0
    capsys.readouterr()
    for name in ("openvino_model.xml", "openvino_model.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()


def test_custom_generate_is_named_as_code(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "cg"
    shutil.copytree(HERE / "llama_tied", folder)
    (folder / "custom_generate").mkdir()
    (folder / "custom_generate" / "generate.py").write_text("raise SystemExit('ran')\n")
    assert main(["inspect", str(folder), "--json"]) == 0
    (sub,) = json.loads(capsys.readouterr().out)["subfolders"]
    assert sub["name"] == "custom_generate" and "trust_remote_code=True" in sub["role"]


@pytest.mark.parametrize("module", ["0_Transformer", "query_0_Transformer"])
def test_a_sentence_transformers_model_in_module_folders_names_them(tmp_path: Path,
                                                                   module: str) -> None:
    folder = tmp_path / "st"
    shutil.copytree(HERE / "ecosystem" / "st_dense_normalize", folder)
    (folder / module).mkdir()
    for name in ("model.safetensors", "config.json"):
        (folder / name).rename(folder / module / name)
    modules = json.loads((folder / "modules.json").read_text())
    if module == "0_Transformer":
        modules[0]["path"] = module
    else:  # a Router at the top routes to its module folders
        (folder / "router_config.json").write_text(json.dumps(
            {"types": {module: "sentence_transformers.base.modules.transformer.Transformer"}}))
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InputError) as caught:
        ckptool.open(str(folder))
    assert f"{module}/" in caught.value.message and "sentence-transformers" in caught.value.message
    assert caught.value.hint.endswith(f"{module}") or f"{module}" in caught.value.hint
    assert ckptool.open(str(folder / module)).main_state_dict is not None


def test_a_variant_only_folder_is_fixed_under_the_plain_name(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    out = tmp_path / "out"
    assert main(["fix", str(HERE / "loader_choice" / "transformers_variant_only"),
                 "--dtype", "bf16", "-o", f"{out}/"]) == 0
    said = capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not (out / "model.fp16.safetensors").exists()
    assert "without variant=" in " ".join(said.split())
    assert json.loads((out / "config.json").read_text()).get("dtype") == "bfloat16"


def test_an_accelerate_folder_fixed_as_a_folder_says_what_load_state_needs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fix", str(HERE / "accelerate_state"), "--dtype", "bf16", "-o",
                 f"{tmp_path / 'out'}/"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "load_state" in said and "from_pretrained loads" not in said


def test_a_pickle_named_as_an_openvino_export_is_still_read(tmp_path: Path) -> None:
    folder = tmp_path / "ov"
    shutil.copytree(HERE / "llama_tied", folder)
    # a protocol-2 pickle that calls os.system('true') when loaded
    (folder / "openvino_model.bin").write_bytes(
        b"\x80\x02cposix\nsystem\n(X\x04\x00\x00\x00truetR.")
    ckpt = ckptool.open(str(folder))
    assert ckpt.framework is not None
    companion = {c.path: c for c in ckpt.framework.companions}["openvino_model.bin"]
    assert companion.unsafe
