"""``convert`` from and to checkpoints of many files, checked against the
real tools: torch's ``dcp_to_torch_save`` is the reference for consolidating
DCP, ``dcp.load`` and ``dcp_to_torch_save`` read the DCP ckptool writes,
huggingface_hub splits shards as ckptool does and loads what it writes. A
directory output appears whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult

import ckptool
from ckptool.errors import CkptoolError
from ckptool.write.convert import directory as convert_dir
from ckptool.write.convert.run import convert
from ckptool.write.layout import Made, Span
from ckptool.write.sources import TensorSource

hub = pytest.importorskip("huggingface_hub")
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multifile"
FOUR = FIXTURES / "dcp_4ranks"
ROOT = Path(__file__).resolve().parent.parent


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dict/list tree by path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}{i}/").items()}
    return {prefix: tree}


def same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return bool(a == b)


def assert_same_tree(got: Any, want: Any) -> None:
    fg, fw = flat(got), flat(want)
    assert fg.keys() == fw.keys()
    assert [k for k in fw if not same(fg[k], fw[k])] == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What torch's own dcp_to_torch_save makes of the 4-rank checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path_factory.mktemp("ref") / "ref.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(FOUR, out)
    return torch.load(out, weights_only=False)  # type: ignore[no-any-return]


def model_sd() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    emb = torch.randn(1000, 16)  # 64 000 bytes: more than the shard size below
    return {"embed.weight": emb, "layers.0.w": torch.randn(300, 16),
            "layers.0.b": torch.randn(300), "layers.1.w": torch.randn(300, 16).half(),
            "head.weight": emb, "steps": torch.arange(5)}


# -- DCP in: consolidated exactly as torch does it ---------------------------

def test_dcp_to_torch_file_is_torchs_consolidation(reference: dict[str, Any],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "whole.pt"
    result = convert(str(FOUR), str(out))
    # everything, nested as saved, loadable without running code
    assert_same_tree(torch.load(out, weights_only=True), reference)
    assert result.output_format == "torch-zip" and result.left_out == []
    assert "step" in result.kept_entries


def test_dcp_to_safetensors_is_the_models_state_dict(reference: dict[str, Any],
                                                     tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = convert(str(FOUR), str(out))
    got = load_file(out)
    assert got.keys() == reference["model"].keys()  # the model's own names
    assert all(torch.equal(got[k], reference["model"][k]) for k in got)
    assert any("outside the state dict" in item for item in result.left_out)


def test_dcp_out_is_read_by_torch(reference: dict[str, Any], tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "again"
    result = convert(str(FOUR), str(out), fmt="dcp")
    assert result.output_format == "dcp" and ".metadata" in result.files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(out, tmp_path / "again.pt")
        assert_same_tree(torch.load(tmp_path / "again.pt", weights_only=False), reference)
        # and dcp.load fills a state dict of the model's shapes in place
        target = {"model": {k: torch.zeros_like(v) for k, v in reference["model"].items()}}
        dcp.load(target, checkpoint_id=out, no_dist=True)
    assert all(torch.equal(target["model"][k], v) for k, v in reference["model"].items())


def test_row_sharded_chunks_are_copied_not_assembled() -> None:
    ckpt = ckptool.open(FOUR)
    by_key = {t.key: t for t in ckpt.tensors}
    with TensorSource(ckpt) as source:
        rows = source.segments(by_key["dt.rows"], "float32", 0, "rows")
        cols = source.segments(by_key["dt.cols"], "float32", 0, "cols")
        cast = source.segments(by_key["dt.rows"], "float16", 0, "rows")
    assert all(isinstance(s, Span) for s in rows) and len(rows) > 1
    assert sum(s.size for s in rows) == by_key["dt.rows"].nbytes
    assert [type(s) for s in cols] == [Made] and [type(s) for s in cast] == [Made]


# -- Hugging Face out: split as huggingface_hub splits, loaded by it ----------

def test_shards_split_as_huggingface_hub_does(tmp_path: Path) -> None:
    sd = model_sd()
    single = tmp_path / "model.pth"
    torch.save(sd, single)
    convert(str(single), str(tmp_path / "hf"), max_shard_size=40_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    split = hub.split_torch_state_dict_into_shards(
        {k: v for k, v in sd.items() if k != "head.weight"}, max_shard_size=40_000)
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == {"total_size": split.metadata["total_size"],
                                 "head.weight": "embed.weight"}  # the tie, as hub records it
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(
        [*split.filename_to_tensors, "model.safetensors.index.json"])


def test_huggingface_hub_loads_what_is_written(tmp_path: Path) -> None:
    sd = model_sd()
    del sd["head.weight"]
    module = torch.nn.Module()
    for name, value in sd.items():  # a module whose state dict is sd
        parent = module
        *path, last = name.split(".")
        for step in path:
            if not hasattr(parent, step):
                parent.add_module(step, torch.nn.Module())
            parent = getattr(parent, step)
        parent.register_buffer(last, torch.zeros_like(value))
    single = tmp_path / "model.pth"
    torch.save(sd, single)
    for fmt in ("hf", "hf-bin"):
        out = tmp_path / fmt
        convert(str(single), str(out), fmt=fmt, max_shard_size=40_000)
        for buf in module.buffers():
            buf.zero_()
        hub.load_torch_model(module, out, strict=True, safe=fmt == "hf")
        assert all(torch.equal(module.state_dict()[k], v) for k, v in sd.items())


def test_torch_shards_keep_ties_shared(tmp_path: Path) -> None:
    single = tmp_path / "model.pth"
    torch.save(model_sd(), single)
    out = tmp_path / "bins"
    result = convert(str(single), str(out), fmt="hf-bin", max_shard_size=40_000)
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    shard = index["weight_map"]["head.weight"]
    assert shard == index["weight_map"]["embed.weight"]
    loaded = torch.load(out / shard, weights_only=True)
    assert loaded["head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
    assert result.aliases == {"head.weight": "embed.weight"}


def test_shards_round_trip_through_every_layout(tmp_path: Path) -> None:
    sd = model_sd()
    single = tmp_path / "model.pth"
    torch.save(sd, single)
    convert(str(single), str(tmp_path / "hf"), max_shard_size=40_000)
    convert(str(tmp_path / "hf"), str(tmp_path / "bins"), fmt="hf-bin", max_shard_size=10_000)
    convert(str(tmp_path / "bins"), str(tmp_path / "back.safetensors"))
    convert(str(tmp_path / "back.safetensors"), str(tmp_path / "back.pth"))
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert_same_tree(back, sd)
    assert back["head.weight"].data_ptr() == back["embed.weight"].data_ptr()
    # DCP has no shared storage: the tie comes back as two equal tensors, said so
    result = convert(str(tmp_path / "bins"), str(tmp_path / "dcp"), fmt="dcp")
    assert any("head.weight" in note and "copy" in note for note in result.notes)
    convert(str(tmp_path / "dcp"), str(tmp_path / "dcp.safetensors"))
    convert(str(tmp_path / "dcp.safetensors"), str(tmp_path / "dcp.pth"))
    assert_same_tree(torch.load(tmp_path / "dcp.pth", weights_only=True), sd)


def test_cli_reports_the_directory(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("convert", str(FOUR), str(tmp_path / "hf"), "--max-shard-size",
                             "100B", "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["output_format"] == "hf-safetensors" and report["input_format"] == "dcp"
    assert "model.safetensors.index.json" in report["files"] and len(report["files"]) > 2
    code, out, err = run_cli("convert", str(FOUR), str(tmp_path / "hf2"), "--format", "hf-bin")
    assert code == 0 and "hf-bin" in out and "pytorch_model.bin" in os.listdir(tmp_path / "hf2")


# -- a directory appears whole or not at all ---------------------------------

def leftovers(parent: Path) -> list[str]:
    return [n for n in os.listdir(parent) if ".ckptool-" in n]


def test_a_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    single = tmp_path / "model.pth"
    torch.save(model_sd(), single)
    calls = []

    def failing(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise CkptoolError("the disk filled up", "free some space")
        return real(*args, **kwargs)

    real = convert_dir.write_safetensors
    monkeypatch.setattr(convert_dir, "write_safetensors", failing)
    with pytest.raises(CkptoolError, match="disk filled"):
        convert(str(single), str(tmp_path / "hf"), max_shard_size=40_000)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_kill_9_leaves_no_directory_and_the_next_run_cleans_up(tmp_path: Path) -> None:
    single = tmp_path / "model.pth"
    torch.save(model_sd(), single)
    dst = tmp_path / "hf"
    script = (  # dies by SIGKILL as the second shard starts
        "import os, signal, sys\n"
        "from ckptool.write.convert import directory as convert_dir\n"
        "from ckptool.write.convert.run import convert\n"
        "real, n = convert_dir.write_safetensors, []\n"
        "def die(*a, **k):\n"
        "    n.append(1)\n"
        "    if len(n) == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(*a, **k)\n"
        "convert_dir.write_safetensors = die\n"
        "convert(sys.argv[1], sys.argv[2], max_shard_size=40_000)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(single), str(dst)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == -9
    assert not dst.exists() and len(leftovers(tmp_path)) == 1  # the dead run's, hidden
    convert(str(single), str(dst), max_shard_size=40_000)
    assert dst.is_dir() and leftovers(tmp_path) == []


def test_an_existing_output_needs_force(tmp_path: Path,
                                        run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "hf"
    assert run_cli("convert", str(FOUR), str(out), "--format", "hf-bin", "-q")[0] == 0
    code, _, err = run_cli("convert", str(FOUR), str(out))
    assert code == 2 and "already exists" in err and "--force" in err
    assert (out / "pytorch_model.bin").exists()
    code, _, err = run_cli("convert", str(FOUR), str(out), "--force", "-q")
    assert code == 0 and not (out / "pytorch_model.bin").exists()
    assert (out / "model.safetensors").exists() and leftovers(tmp_path) == []


def test_force_never_replaces_what_is_not_a_checkpoint(tmp_path: Path,
                                                      run_cli: Callable[..., CliResult]) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    code, _, err = run_cli("convert", str(FOUR), str(tmp_path / "mine"), "--force")
    assert code == 2 and "holds no checkpoint" in err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["same", "around", "inside"])
def test_the_output_is_never_the_input_or_around_it(
        where: str, tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(FOUR, src)
    before = sorted(p.name for p in src.iterdir())
    dst = {"same": src, "around": tmp_path, "inside": src / "sub"}[where]
    for args in (["convert", str(src), str(dst), "--force"],
                 ["convert", str(src), str(src / "model.safetensors")],
                 ["fix", str(src), "--dtype", "bf16", "-o", str(dst), "--force"]):
        if where != "inside" and args[2].endswith(".safetensors"):
            continue
        code, out, err = run_cli(*args)
        assert (code, out) == (2, "") and "the input" in err, args
    assert sorted(p.name for p in src.iterdir()) == before


@pytest.mark.parametrize(("args", "message"), [
    (["x.safetensors", "--format", "hf"], "writes a directory"),
    (["x.pt", "--max-shard-size", "1GB"], "--max-shard-size sizes the shards"),
    (["out", "--max-shard-size", "lots"], "is not a size"),
    (["out", "--max-shard-size", "0MB"], "above zero"),
    (["x.weights", ], "cannot tell the output format"),
])
def test_options_that_do_not_fit(args: list[str], message: str, tmp_path: Path,
                                 run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("convert", str(FOUR), str(tmp_path / args[0]), *args[1:])
    assert code == 2 and out == "" and message in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_progress_covers_the_whole_job(tmp_path: Path) -> None:
    single = tmp_path / "model.pth"
    torch.save(model_sd(), single)
    seen: list[tuple[int, int]] = []
    convert(str(single), str(tmp_path / "hf"), max_shard_size=40_000,
            progress=lambda done, total: seen.append((done, total)))
    totals = {total for _, total in seen}
    assert len(totals) == 1 and seen[-1][0] == seen[-1][1]  # one bar, ending full
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never going back


def test_the_dcp_writer_is_handed_one_tensor_at_a_time(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's writer keeps a reference to every tensor of a file: each one's
    memory is given back once the next is asked for, whatever read it (one
    file's bytes, a DCP chunk), and its CRC, taken in place, must not pin it
    as a numpy view would."""
    import torch.distributed.checkpoint.filesystem as fs

    single = tmp_path / "model.pth"
    torch.save(model_sd(), single)
    written: list[torch.Tensor] = []
    real = fs._write_item

    def write_item(*args: Any, **kwargs: Any) -> Any:
        # every tensor written before this one has no memory left
        assert [w.untyped_storage().size() for w in written] == [0] * len(written)
        if isinstance(args[2], torch.Tensor):
            written.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", write_item)
    for src, dst in ((single, tmp_path / "dcp"), (tmp_path / "dcp", tmp_path / "again")):
        written.clear()
        convert(str(src), str(dst), fmt="dcp")
        sizes = [w.untyped_storage().size() for w in written]  # never the tensors: freed
        assert len(sizes) == 6 and sizes == [0] * 6  # 5 tensors and the tie, each a copy


def test_names_with_slashes_keep_their_place(tmp_path: Path) -> None:
    """A DCP name is its own: '/' and '\\' in it are not key separators."""
    src = tmp_path / "slash.pt"
    sd = {"model": {"a/b": torch.ones(2), "x\\y": torch.zeros(3)}, "step": 1}
    torch.save(sd, src)
    convert(str(src), str(tmp_path / "dcp"), fmt="dcp")  # the main state dict, flat
    result = convert(str(tmp_path / "dcp"), str(tmp_path / "back.pt"))
    assert result.left_out == []
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == {"a/b", "x\\y"} and torch.equal(back["a/b"], torch.ones(2))
    nested = tmp_path / "nested"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.save(sd, checkpoint_id=nested, no_dist=True)
    convert(str(nested), str(tmp_path / "nested.pt"))
    assert_same_tree(torch.load(tmp_path / "nested.pt", weights_only=True), sd)


def test_a_tie_in_one_hf_file_comes_back(tmp_path: Path) -> None:
    """huggingface_hub records a tied name it leaves out in the one file's
    __metadata__ (and ckptool writes it the same way): read back as a tie."""
    for name, writer in (("hub", None), ("ours", "convert")):
        sd = model_sd()  # huggingface_hub takes the tied name out of the dict it is given
        folder = tmp_path / name
        if writer is None:
            folder.mkdir()
            hub.save_torch_state_dict(sd, folder)
        else:
            torch.save(sd, tmp_path / "model.pth")
            convert(str(tmp_path / "model.pth"), str(folder))
        assert os.listdir(folder) == ["model.safetensors"]
        result = convert(str(folder / "model.safetensors"), str(tmp_path / f"{name}.pth"))
        # the tie either way round: huggingface_hub keeps the name it prefers
        assert [sorted(p) for p in result.aliases.items()] == [["embed.weight", "head.weight"]]
        back = torch.load(tmp_path / f"{name}.pth", weights_only=True)
        assert back["head.weight"].data_ptr() == back["embed.weight"].data_ptr()


def test_a_trailing_slash_names_a_directory(tmp_path: Path) -> None:
    single = tmp_path / "model.pth"
    torch.save(model_sd(), single)
    result = convert(str(single), f"{tmp_path / 'out.safetensors'}/")
    assert result.output_format == "hf-safetensors" and (tmp_path / "out.safetensors").is_dir()
