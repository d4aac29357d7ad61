"""``--dtype`` and a framework's config: ``convert --dtype bf16`` (and ``fix
--dtype`` of a sharded folder into a new one) writes a ``config.json`` that
says bfloat16, under the keys the transformers version that wrote it uses
(``dtype`` from 4.56, ``torch_dtype`` before), so that ``from_pretrained``
(transformers 5 loads the dtype its config says) loads the weights as they
are now. The input's config is never changed. Frameworks whose configs
record no dtype (diffusers, PEFT) get a note saying how their loader picks
one.

transformers 5.25 loading these outputs in bfloat16 is checked with the
library itself (tests/fixtures/frameworks/README.md), not here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ckptool
from ckptool.cli import main
from ckptool.write.convert.folder import config_with_dtype

HERE = Path(__file__).parent / "fixtures" / "frameworks"


def said(data: dict[str, Any], dtype: str = "bfloat16") -> tuple[dict[str, Any] | None, str]:
    out, why = config_with_dtype(json.dumps(data).encode(), dtype)
    return (json.loads(out) if out is not None else None), why


@pytest.mark.parametrize(("config", "expect", "note"), [
    ({"model_type": "llama", "dtype": "float32"}, {"dtype": "bfloat16"},
     "dtype float32 → bfloat16"),
    ({"model_type": "llama", "torch_dtype": "float32", "transformers_version": "4.40.0"},
     {"torch_dtype": "bfloat16"}, "torch_dtype float32 → bfloat16"),
    ({"model_type": "llama", "dtype": "float32", "torch_dtype": "float32"},
     {"dtype": "bfloat16", "torch_dtype": "bfloat16"},
     "dtype float32 → bfloat16; torch_dtype float32 → bfloat16"),
    ({"model_type": "llama", "transformers_version": "4.57.6"}, {"dtype": "bfloat16"},
     "dtype bfloat16 (it had none)"),
    ({"model_type": "llama", "transformers_version": "4.38.2"}, {"torch_dtype": "bfloat16"},
     "torch_dtype bfloat16 (it had none)"),
    ({"architectures": ["X"]}, {"torch_dtype": "bfloat16"}, "torch_dtype bfloat16 (it had none)"),
    ({"model_type": "llava", "dtype": "float32",
      "text_config": {"model_type": "llama", "dtype": "float32"}},
     {"dtype": "bfloat16", "text_config": {"model_type": "llama", "dtype": "bfloat16"}},
     "dtype float32 → bfloat16; text_config.dtype float32 → bfloat16"),
])
def test_the_config_says_the_new_dtype_as_its_version_wrote_it(
        config: dict[str, Any], expect: dict[str, Any], note: str) -> None:
    out, why = said(config)
    assert out == {**config, **expect}
    assert why == note


@pytest.mark.parametrize(("data", "why"), [
    (b"{not json", "config.json is not JSON: its dtype is left as it was"),
    (b'{"_class_name": "UNet2DModel"}',
     "config.json is not a transformers config: its dtype is left as it was"),
    (b"[1, 2]", "config.json is not a transformers config: its dtype is left as it was"),
])
def test_a_config_it_cannot_read_is_left_and_said(data: bytes, why: str) -> None:
    assert config_with_dtype(data, "bfloat16") == (None, why)


def convert(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = main(["convert", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
    return report


def test_convert_dtype_updates_the_copied_config_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = HERE / "llama_tied"
    before = (src / "config.json").read_bytes()
    report = convert([str(src), str(tmp_path / "out"), "--dtype", "bf16"], capsys)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {**json.loads(before), "dtype": "bfloat16"}
    assert (src / "config.json").read_bytes() == before
    assert ("config.json: dtype float32 → bfloat16, as the weights are now, so that "
            "from_pretrained loads them as bfloat16 (the input's config.json is unchanged)"
            ) in report["notes"]
    assert {t.dtype for t in ckptool.open(tmp_path / "out").tensors} == {"bfloat16"}


def test_without_dtype_the_config_is_copied_byte_for_byte(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = convert([str(HERE / "llama_tied"), str(tmp_path / "out")], capsys)
    assert (tmp_path / "out" / "config.json").read_bytes() == \
        (HERE / "llama_tied" / "config.json").read_bytes()
    assert not any("dtype" in n for n in report["notes"])


def test_fix_dtype_of_a_sharded_folder_updates_its_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = HERE / "llama_tied_bin_sharded"
    code = main(["fix", str(src), "--dtype", "fp16", "-o", str(tmp_path / "out"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {**json.loads((src / "config.json").read_text()), "dtype": "float16"}
    assert any(n.startswith("config.json: dtype float32 → float16") for n in
               json.loads(out)["notes"])


@pytest.mark.parametrize(("src", "note"), [
    ("diffusers_ddpm/unet", "a diffusers config records no dtype: from_pretrained(OUT, "
                            "torch_dtype=torch.bfloat16) loads the weights as bfloat16 "
                            "(without it, as float32)"),
    ("peft_lora", "adapter_config.json records no dtype: PeftModel.from_pretrained keeps LoRA "
                  "weights in float32 (autocast_adapter_dtype=True, its default), or with "
                  "autocast_adapter_dtype=False in the base model's dtype"),
])
def test_a_framework_whose_config_records_no_dtype_says_how_its_loader_picks_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], src: str, note: str) -> None:
    report = convert([str(HERE / src), str(tmp_path / "out"), "--dtype", "bf16"], capsys)
    assert note in report["notes"]
    for name in ("config.json", "adapter_config.json"):
        if (HERE / src / name).exists():
            assert (tmp_path / "out" / name).read_bytes() == (HERE / src / name).read_bytes()


def test_a_sentence_transformers_modules_weights_are_copied_as_they_are_and_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = HERE / "ecosystem" / "st_dense_normalize"
    report = convert([str(src), str(tmp_path / "out"), "--dtype", "bf16"], capsys)
    assert (tmp_path / "out" / "2_Dense" / "model.safetensors").read_bytes() == \
        (src / "2_Dense" / "model.safetensors").read_bytes()
    assert ("2_Dense/model.safetensors: a module's weights, copied as they are (not cast to "
            "bfloat16); SentenceTransformer casts its modules to the transformer's dtype as it "
            "loads them") in report["notes"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
