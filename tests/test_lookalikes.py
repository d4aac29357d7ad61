"""What a file or folder is when it is no PyTorch checkpoint: ONNX, Flax
msgpack (tests/fixtures/lookalikes/, by their real writers), a Keras
archive, a TensorFlow SavedModel or checkpoint, an orbax checkpoint; and a
diffusers pipeline's root, whose components are each a model. One line,
a hint, exit 3, nothing written."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptool.cli import main

HERE = Path(__file__).parent / "fixtures"


def keras_archive(tmp: Path) -> Path:
    path = tmp / "model.keras"  # what keras.saving.save_model writes
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("metadata.json", '{"keras_version": "3.6.0"}')
        zf.writestr("config.json", '{"class_name": "Sequential"}')
        zf.writestr("model.weights.h5", b"\x89HDF\r\n\x1a\n" + bytes(64))
    return path


def folder(*names: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        root = tmp / "folder"
        for name in names:
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if not name.endswith("/"):
                path.write_bytes(b"\x00" * 8)
        return root
    return make


CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "onnx": (lambda _: HERE / "lookalikes" / "model.onnx", r"is an ONNX model"),
    "flax_msgpack": (lambda _: HERE / "lookalikes" / "flax_model.msgpack",
                     r"msgpack file \(Flax serialization\? its first key is 'params'\)"),
    "keras": (keras_archive, r"Keras model archive"),
    "saved_model": (folder("saved_model.pb", "variables/variables.index",
                           "fingerprint.pb"), r"TensorFlow SavedModel"),
    "tf_checkpoint": (folder("checkpoint", "model.ckpt.index",
                             "model.ckpt.data-00000-of-00001"), r"TensorFlow checkpoint"),
    "orbax": (folder("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "d/x"),
              r"orbax \(JAX\) checkpoint"),
    "diffusers_pipeline": (lambda _: HERE / "frameworks" / "diffusers_ddpm",
                           r"a diffusers pipeline \(DDPMPipeline, diffusers_ddpm/\), whose "
                           r"models are read one at a time: unet/$"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["inspect", "diagnose", "convert"])
def test_other_formats_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 case: str, command: str) -> None:
    build, pattern = CASES[case]
    path = build(tmp_path)
    args = [command, str(path)] + ([str(tmp_path / "out.safetensors")]
                                   if command == "convert" else [])
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 3 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint: "), err
    assert __import__("re").search(pattern, lines[0]), lines[0]
    assert not (tmp_path / "out.safetensors").exists()


def test_a_diffusers_component_reads_as_its_model() -> None:
    import ckptool

    ckpt = ckptool.open(HERE / "frameworks" / "diffusers_ddpm" / "unet")
    assert ckpt.path.endswith("diffusion_pytorch_model.safetensors")
    assert len(ckpt.tensors) == 114
    assert ckpt.framework is not None and ckpt.framework.kind == "diffusers"
    assert ckpt.framework.model_class == "UNet2DModel"
