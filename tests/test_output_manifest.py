"""``convert ... --manifest FILE`` and ``fix ... --manifest FILE`` (issue 28
item 3): the manifest of the output, equal to what ``ckptool verify OUT
--write-manifest`` writes (but for its time), for every output kind;
a destination that cannot take it refused before anything is written;
convert on many processes refuses it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

CliRun = Callable[..., tuple[int, str, str]]


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"module.fc.weight": torch.randn(8, 4, generator=g),
            "module.fc.bias": torch.randn(8, generator=g), "module.steps": torch.arange(3)}


def same_as_verify(run_cli: CliRun, out: Path, written: Path, tmp_path: Path) -> dict:
    again = tmp_path / "again.json"
    rc, _, err = run_cli("verify", str(out), "--write-manifest", str(again))
    assert rc == 0, err
    mine, theirs = json.loads(written.read_text()), json.loads(again.read_text())
    mine.pop("created"), theirs.pop("created")
    assert mine == theirs
    assert mine["tensors"] and mine["files"]
    return mine


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "in.pth"
    torch.save({"state_dict": weights(), "epoch": 2}, path)
    return path


@pytest.mark.parametrize("out_name, fmt", [
    ("out.safetensors", None), ("hf", "hf"), ("bin", "hf-bin"), ("dcp", "dcp")])
def test_convert_manifest_of_every_output(run_cli: CliRun, source: Path, tmp_path: Path,
                                          out_name: str, fmt: str | None) -> None:
    out, dest = tmp_path / out_name, tmp_path / "out.manifest.json"
    args = ["convert", str(source), str(out), "--manifest", str(dest), "--json",
            *(["--format", fmt] if fmt else []),
            *(["--max-shard-size", "100"] if fmt in ("hf", "hf-bin") else [])]
    rc, stdout, err = run_cli(*args)
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["manifest"] == str(dest)
    assert any(n.startswith(f"manifest of {out} written to {dest}") for n in report["notes"])
    same_as_verify(run_cli, out, dest, tmp_path)


def test_convert_hf_input_and_text(run_cli: CliRun, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_torch_state_dict(weights(), src, max_shard_size=200)
    out, dest = tmp_path / "one.pth", tmp_path / "m.json"
    rc, stdout, err = run_cli("convert", str(src), str(out), "--manifest", str(dest))
    assert rc == 0, err
    assert "manifest of" in stdout
    same_as_verify(run_cli, out, dest, tmp_path)


@pytest.mark.parametrize("extra", [[], ["--in-place"], ["--dtype", "bf16"]])
def test_fix_manifest(run_cli: CliRun, source: Path, tmp_path: Path, extra: list[str]) -> None:
    out, dest = tmp_path / "fixed.pth", tmp_path / "fixed.manifest.json"
    args = ["fix", str(source), "--strip-module", "--manifest", str(dest), "--json", *extra]
    if "--in-place" not in extra:
        args += ["-o", str(out)]
    rc, stdout, err = run_cli(*args)
    assert rc == 0, err
    assert json.loads(stdout)["manifest"] == str(dest)
    written = same_as_verify(run_cli, source if "--in-place" in extra else out, dest, tmp_path)
    assert "state_dict/fc.weight" in written["tensors"]


def test_fix_of_a_directory(run_cli: CliRun, tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    save_torch_state_dict(weights(), src, max_shard_size=200)
    dest = tmp_path / "m.json"
    rc, _, err = run_cli("fix", str(src), "--strip-module", "-o", str(out), "--manifest",
                         str(dest))
    assert rc == 0, err
    same_as_verify(run_cli, out, dest, tmp_path)


def test_bad_destinations_refused_before_writing(run_cli: CliRun, source: Path,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    rc, _, err = run_cli("convert", str(source), str(out), "--manifest",
                         str(tmp_path / "no" / "m.json"))
    assert rc == 2 and "does not exist" in err and not out.exists()
    rc, _, err = run_cli("convert", str(source), str(out), "--manifest", str(out))
    assert rc == 2 and "the output itself" in err and not out.exists()
    rc, _, err = run_cli("fix", str(source), "--in-place", "--strip-module", "--manifest",
                         str(source))
    assert rc == 2 and "the output itself" in err
    rc, _, err = run_cli("convert", str(source), str(out), "--workers", "2", "--manifest",
                         str(tmp_path / "m.json"))
    assert rc == 2 and "many processes" in err and not out.exists()
    rc, _, _ = run_cli("fix", str(source), "--strip-module", "--dry-run", "--manifest",
                       str(tmp_path / "m.json"))
    assert rc == 0 and not (tmp_path / "m.json").exists()


def streamed_manifest_is_the_manifest(out: Path, streams: dict[str, object],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest from a writer's ``streams`` is written without reading
    OUT again, and equals the one a read of OUT gives."""
    from ckptool.check.verify import filehash, manifest
    from ckptool.check.verify.outmanifest import write_for_output
    from ckptool.read.reader import open_checkpoint

    def no_read(*args: object, **kwargs: object) -> object:
        raise AssertionError("OUT read again")

    monkeypatch.setattr(filehash, "hash_file", no_read)
    monkeypatch.setattr(manifest, "digest_ranges", no_read)
    dest = out.with_name(out.name + ".manifest.json")
    written, note = write_for_output(str(out), str(dest), 1, streams)  # type: ignore[arg-type]
    assert "no second read" in note
    monkeypatch.undo()
    again = manifest.build_manifest(open_checkpoint(str(out)), 1)
    assert written["files"] == again["files"] and written["tensors"] == again["tensors"]


def test_convert_hashes_its_tensor_files_as_it_checks_them(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """convert --manifest takes a one-file output's sha256 and tensor digests
    from the bytes it re-reads for their CRC: nothing of OUT is read again."""
    from ckptool.write.convert.run import convert

    src = tmp_path / "w.pt"
    torch.save({"a": torch.randn(300, 70), "b": torch.randn(5).to(torch.bfloat16),
                "e": torch.zeros(0)}, src)
    out = tmp_path / "w.safetensors"
    streams: dict[str, object] = {}
    convert(str(src), str(out), streams=streams)  # type: ignore[arg-type]
    streamed_manifest_is_the_manifest(out, streams, monkeypatch)


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}])
def test_fix_hashes_its_output_as_it_checks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               options: dict[str, str]) -> None:
    """fix -o (storages copied, or cast) takes the output's hashes from the
    bytes it re-reads for their CRC: nothing of OUT is read again."""
    from ckptool.write.fix.plan import FixOptions
    from ckptool.write.fix.run import fix

    src = tmp_path / "w.pt"
    torch.save({"module.a": torch.randn(300, 70), "module.b": torch.randn(5)}, src)
    out = tmp_path / "fixed.pt"
    streams: dict[str, object] = {}
    fix(str(src), FixOptions(strip_module=True, **options), str(out),  # type: ignore[arg-type]
        streams=streams)  # type: ignore[arg-type]
    streamed_manifest_is_the_manifest(out, streams, monkeypatch)
