"""``convert`` on many ranks (ckptool.write.distributed), its ranks run as
threads of this process over one in-memory store (``world.alone_with``):
the same bytes as the one-process convert for every output it writes
file by file, from inputs real writers made (``dcp.save``,
``huggingface_hub``, ``torch.save``); failures that commit nothing and name
the rank; re-runs that resume. (The processes themselves, under torchrun,
srun and ``--workers``: test_distributed_launch.py.)"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import flip_record_byte, on_thread_ranks

from ckptool.errors import CkptoolError, RankFailedError, UsageError
from ckptool.write.convert.run import convert as convert_one
from ckptool.write.distributed import world
from ckptool.write.distributed.ending import Quiet
from ckptool.write.distributed.plan import assign
from ckptool.write.distributed.run import convert as convert_rank
from ckptool.write.distributed.staging import Staging
from tests.conftest import CliResult


def on_ranks(n: int, src: Path | str, dst: Path | str, **options: Any) -> list[Any]:
    """Run the conversion on ``n`` ranks (threads): rank 0's report, or the
    error it said (its exit code the failure's), then each other rank's
    None or ``Quiet``."""
    said: list[CkptoolError] = []
    out = on_thread_ranks(n, lambda w: convert_rank(w, str(src), str(dst), say=said.append,
                                                    **options), (CkptoolError, OSError))
    assert len(said) <= 1, said  # said once
    if said:
        assert isinstance(out[0], Quiet)
        said[0].exit_code = out[0].exit_code
        out[0] = said[0]
    return out


def same_bytes(a: Path, b: Path) -> None:
    if a.is_dir():
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
        for name in os.listdir(a):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    else:
        assert a.read_bytes() == b.read_bytes()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A DCP checkpoint (model and optimizer), HF shards (tied weights), a torch zip."""
    import huggingface_hub as hub
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dist_inputs")
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(32, 16 + i, generator=g) for i in range(9)}
    model["emb.weight"] = torch.randn(300, 16, generator=g)
    model["norm.bias"] = torch.randn(7, generator=g).to(torch.bfloat16)
    model["steps"] = torch.arange(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optim": {"state": {"0": {"exp_avg": torch.ones(3, 4)}},
                                            "param_groups": [{"lr": 0.1, "params": [0]}]},
                  "step": 7}, checkpoint_id=root / "dcp", no_dist=True)
    tied = dict(model)
    tied["lm_head.weight"] = tied["emb.weight"]
    (root / "hf").mkdir()
    hub.save_torch_state_dict(tied, root / "hf", max_shard_size="3KB")
    torch.save(tied, root / "model.pt")
    return {"dcp": root / "dcp", "hf": root / "hf", "pt": root / "model.pt"}


CASES = [  # (input, output name, options)
    ("dcp", "one.safetensors", {}),
    ("dcp", "one.pt", {}),
    ("dcp", "cast.safetensors", {"dtype": "bfloat16"}),
    ("dcp", "shards", {"fmt": "hf", "max_shard_size": 2500}),
    ("dcp", "bins", {"fmt": "hf-bin", "max_shard_size": 4000}),
    ("hf", "from_hf.safetensors", {}),
    ("hf", "hf_bins", {"fmt": "hf-bin", "max_shard_size": 3000}),
    ("pt", "tied.safetensors", {}),
    ("pt", "tied_shards", {"fmt": "hf", "max_shard_size": 1500, "dtype": "float16"}),
]


@pytest.mark.parametrize(("src", "name", "options"), CASES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_many_ranks_write_the_bytes_one_process_writes(
        inputs: dict[str, Path], tmp_path: Path, src: str, name: str, options: dict[str, Any],
        ranks: int) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    expected = convert_one(str(inputs[src]), str(tmp_path / "one" / name), **options)
    results = on_ranks(ranks, inputs[src], tmp_path / "many" / name, **options)
    assert all(r is None for r in results[1:]), results
    result = results[0]
    assert not isinstance(result, BaseException), result
    same_bytes(tmp_path / "one" / name, tmp_path / "many" / name)
    assert result.bytes_written == expected.bytes_written
    assert result.files == expected.files
    per_rank = result.distributed["per_rank"]
    assert [r["rank"] for r in per_rank] == list(range(ranks))
    # every tensor written once, by exactly one rank
    assert sum(r["tensors"] for r in per_rank) == expected.tensors
    assert os.listdir(tmp_path / "many") == [name]  # no staging directory left


FIXTURES = Path(__file__).parent / "fixtures"
WRITERS = [  # what real writers made (fixtures/*/make_*.py): every input layout ckptool reads
    (FIXTURES / "deepspeed" / "z3_bf16_ws4", "zero3.safetensors", {}),
    (FIXTURES / "deepspeed" / "z2_bf16", "module.pt", {"weights": "module"}),
    (FIXTURES / "frameworks" / "llama_tied_bin_sharded", "llama", {"max_shard_size": 40000}),
    (FIXTURES / "frameworks" / "peft_lora", "adapter", {"fmt": "hf-bin"}),
    (FIXTURES / "multifile" / "dcp_4ranks", "whole.pt", {}),
    (FIXTURES / "multifile" / "per_rank_dtensor" / "mesh2d_ws4", "dtensor.safetensors", {}),
    (FIXTURES / "multifile" / "hf_storage", "hf_storage.safetensors", {"dtype": "float16"}),
    (FIXTURES.parent.parent / "samples" / "tinynet.safetensors", "tinynet.pt", {}),
]


@pytest.mark.parametrize(("src", "name", "options"), WRITERS,
                         ids=[f"{p.name}-{n}" for p, n, _ in WRITERS])
def test_every_input_layout(src: Path, name: str, options: dict[str, Any],
                            tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    expected = convert_one(str(src), str(tmp_path / "one" / name), **options)
    result = on_ranks(3, src, tmp_path / "many" / name, **options)[0]
    assert not isinstance(result, BaseException), result
    same_bytes(tmp_path / "one" / name, tmp_path / "many" / name)
    assert (result.files, result.notes, result.left_out) == (
        expected.files, expected.notes, expected.left_out)


def test_rank_0_shows_one_bar_for_the_whole_job(big_pt: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    seen: list[tuple[int, int]] = []
    threads = [threading.Thread(target=convert_rank, args=(
        world.alone_with(store, r, 2), str(big_pt), str(tmp_path / "o.safetensors")),
        kwargs={"progress": (lambda d, t: seen.append((d, t))) if r == 0 else None,
                "say": print})
        for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    total = 8 * 256 * 256 * 4
    assert seen[-1] == (total, total)
    assert {t for _, t in seen} == {total}
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never goes back


def test_a_rank_that_stops_answering_is_taken_for_lost(
        big_pt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed (or its machine lost) says nothing: rank 0 notices that
    its beats stopped, and stops the job naming it."""
    import torch.distributed as dist

    from ckptool.write.distributed.coordinate import Coordinator

    monkeypatch.setenv("CKPTOOL_RANK_TIMEOUT", "1")
    store = dist.HashStore()
    out: list[Any] = [None]

    def rank0() -> None:
        try:
            convert_rank(world.alone_with(store, 0, 2), str(big_pt),
                         str(tmp_path / "o.safetensors"), say=out.append)
        except Quiet as exc:
            out.append(exc.exit_code)

    thread = threading.Thread(target=rank0)
    thread.start()
    lost = Coordinator(world.alone_with(store, 1, 2).store, 1, 2, "gone")
    lost._beat()  # it joined, beat once, then its machine went away
    thread.join(60)
    said, code = out[1], out[2]
    assert isinstance(said, RankFailedError)
    assert said.message.startswith("rank 1 of 2 (?): stopped answering for 1 s")
    assert code == 4
    assert not (tmp_path / "o.safetensors").exists()


def test_more_ranks_than_tensors(inputs: dict[str, Path], tmp_path: Path) -> None:
    convert_one(str(inputs["pt"]), str(tmp_path / "one.safetensors"))
    results = on_ranks(16, inputs["pt"], tmp_path / "many.safetensors")
    assert min(r["tensors"] for r in results[0].distributed["per_rank"]) == 0  # 12 tensors
    assert (tmp_path / "one.safetensors").read_bytes() == \
        (tmp_path / "many.safetensors").read_bytes()


def test_the_share_of_each_rank_is_its_bytes_plus_at_most_one_tensor() -> None:
    sizes = [5, 100, 3, 3, 3, 40, 40, 1, 0, 7, 90, 2] * 20
    for ranks in (1, 2, 3, 7, 16, 300):
        bounds = assign(sizes, ranks)
        assert bounds[0] == 0 and bounds[-1] == len(sizes)
        assert bounds == sorted(bounds)  # contiguous runs, in order
        shares = [sum(sizes[bounds[r]:bounds[r + 1]]) for r in range(ranks)]
        assert sum(shares) == sum(sizes)
        assert max(shares) <= sum(sizes) / ranks + max(sizes)
    assert assign([0, 0], 3) == [0, 2, 2, 2]


def test_a_failed_rank_commits_nothing_names_itself_and_the_rerun_resumes(
        big_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    flip_record_byte(big_pt, "big/data/7")  # the last tensor: the last rank's to copy
    results = on_ranks(3, big_pt, out)
    assert isinstance(results[0], RankFailedError)  # said by rank 0, for rank 2
    assert results[0].exit_code == 3  # the failed rank's own code (bad input)
    assert results[0].message.startswith("rank 2 of 3 (")
    assert "w7" in results[0].message
    assert "run the same command again to resume" in results[0].hint
    assert "nothing was written" not in results[0].hint
    assert isinstance(results[1], Quiet) and isinstance(results[2], Quiet)
    assert results[2].exit_code == 3  # the failed rank leaves with its own code
    assert not out.exists()
    staging = Staging(str(out), False)
    assert len(staging.recorded()) == 6  # ranks 0 and 1 wrote theirs; rank 2 w6 and w7 at once
    flip_record_byte(big_pt, "big/data/7")  # repaired: the same file, the same times
    results = on_ranks(2, big_pt, out)  # resumed on another number of ranks
    report = results[0].distributed
    assert report["resumed"]
    assert sum(r["bytes_kept"] for r in report["per_rank"]) == 6 * 256 * 256 * 4
    convert_one(str(big_pt), str(tmp_path / "one.safetensors"))
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    assert not staging.path.exists()


def test_kept_bytes_damaged_since_are_written_again(big_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    flip_record_byte(big_pt, "big/data/5")
    on_ranks(2, big_pt, out)
    staging = Staging(str(out), False)
    recorded = staging.recorded()
    assert ("out.safetensors", "w0") in recorded
    at, size, _ = recorded[("out.safetensors", "w0")]["checks"][-1]
    with open(staging.file("out.safetensors"), "r+b") as f:  # the disk lost a byte
        f.seek(at + size // 2)
        f.write(b"\xff")
    flip_record_byte(big_pt, "big/data/5")
    results = on_ranks(2, big_pt, out)
    kept = sum(r["bytes_kept"] for r in results[0].distributed["per_rank"])
    assert 0 < kept < 5 * 256 * 256 * 4  # w0 was written again
    convert_one(str(big_pt), str(tmp_path / "one.safetensors"))
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_another_conversion_into_the_same_output_starts_afresh(big_pt: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    flip_record_byte(big_pt, "big/data/7")
    on_ranks(2, big_pt, out)
    flip_record_byte(big_pt, "big/data/7")
    results = on_ranks(2, big_pt, out, dtype="bfloat16")  # not what the staging holds
    assert not results[0].distributed["resumed"]
    assert sum(r["bytes_kept"] for r in results[0].distributed["per_rank"]) == 0
    convert_one(str(big_pt), str(tmp_path / "one.safetensors"), dtype="bfloat16")
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_an_output_that_exists_is_refused_by_every_rank(inputs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"mine")
    results = on_ranks(2, inputs["pt"], out)
    assert isinstance(results[0], UsageError) and "already exists" in results[0].message
    assert "resume" not in results[0].hint  # nothing was staged
    assert isinstance(results[1], Quiet)
    assert out.read_bytes() == b"mine"
    results = on_ranks(2, inputs["pt"], out, force=True)
    assert results[0].output == str(out) and out.read_bytes()[:8] != b"mine"


def test_force_replaces_a_checkpoint_directory_and_nothing_else(
        inputs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    results = on_ranks(2, inputs["pt"], out, fmt="hf", force=True)
    assert isinstance(results[0], UsageError) and "holds no checkpoint" in results[0].message
    assert (out / "todo.txt").read_text() == "mine"
    shards = tmp_path / "shards"
    convert_one(str(inputs["dcp"]), str(shards), fmt="hf")
    results = on_ranks(2, inputs["pt"], shards, fmt="hf-bin", force=True)
    assert results[0].files == ["pytorch_model.bin"]
    assert os.listdir(shards) == ["pytorch_model.bin"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # nothing left aside


def test_dry_run_shows_which_rank_writes_what(inputs: dict[str, Path], tmp_path: Path,
                                              run_cli: Callable[..., CliResult]) -> None:
    import json

    code, out, _ = run_cli("convert", str(inputs["dcp"]), str(tmp_path / "o"), "--format", "hf",
                           "--max-shard-size", "2500", "--dry-run", "--workers", "3", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["dry_run"] and plan["ranks"] == 3
    assert [r["rank"] for r in plan["plan"]] == [0, 1, 2]
    assert sum(r["tensors"] for r in plan["plan"]) == plan["tensors"]
    assert plan["files"][-1] == "model.safetensors.index.json"
    assert not (tmp_path / "o").exists()
    code, out, _ = run_cli("convert", str(inputs["dcp"]), str(tmp_path / "o"), "--dry-run",
                           "--workers", "40")
    assert code == 0 and "on 40 ranks" in out
    busy = [line for line in out.splitlines() if line.endswith("model.safetensors")]
    assert 0 < len(busy) <= 11  # 11 tensors: the busy ranks are shown, the idle counted
    assert f"{40 - len(busy)} ranks have no tensor to write" in out


def test_a_resume_keeps_only_the_same_conversion(tmp_path: Path) -> None:
    """The fingerprint a re-run must match: the same on any number of ranks,
    and not the same for the module's half-precision weights and the fp32
    masters cast to half (same names, shapes and output dtype)."""
    from ckptool.write.distributed.run import plan_only

    src = str(FIXTURES / "deepspeed" / "z2_bf16")
    out = str(tmp_path / "o.safetensors")
    masters = plan_only(src, out, 2, dtype="bfloat16")
    assert masters.fingerprint() == plan_only(src, out, 7, dtype="bfloat16").fingerprint()
    module = plan_only(src, out, 2, weights="module", dtype="bfloat16")
    assert [u.name for u in module.units] == [u.name for u in masters.units]
    assert module.fingerprint() != masters.fingerprint()


def test_an_error_every_rank_meets_is_said_as_one_process_says_it(tmp_path: Path) -> None:
    """Not a checkpoint: every rank finds it while planning, whichever records
    it first; rank 0 says it as one process would, with no rank named."""
    src = tmp_path / "notes.pt"
    src.write_text("hello\n")
    for _ in range(3):
        results = on_ranks(3, src, tmp_path / "o.safetensors")
        assert results[0].message.startswith(f"{src} is not a checkpoint"), results[0].message
        assert results[0].exit_code == 3
        assert all(isinstance(r, Quiet) and r.exit_code == 3 for r in results[1:])


def test_a_bad_timeout_is_said_once_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    monkeypatch.setenv("CKPTOOL_RANK_TIMEOUT", "soon")
    code, out, err = run_cli("convert", str(FIXTURES.parent.parent / "samples" / "dcp_tinynet"),
                             str(tmp_path / "o.safetensors"), "--workers", "2")
    assert code == 2 and out == ""
    assert err.splitlines()[0] == "ckptool: error: CKPTOOL_RANK_TIMEOUT='soon': expected a " \
        "number of seconds above 0"
    assert not (tmp_path / "o.safetensors").exists()
