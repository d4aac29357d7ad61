"""A DCP checkpoint's read and ``convert --dry-run``'s plan at scale (issue
35, item 18(b)) do each piece of work once, and their shortcuts change no
result: the dry run keeps Python's cycle collector off throughout (its
passes over a million records cost seconds), a checkpoint of many files
picks its main state dict once (not once for one file, then again), and
the chunks, the files' counts, the groups and a lone ``.metadata``'s merge
made in bulk are those the loops as first written made (kept here).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

import ckptool
from ckptool.keys import key_of, split_key
from ckptool.model import Chunk
from ckptool.read import optim, reader
from ckptool.read.layouts import dcp, dcp_chunks, dcp_metadata, recognise
from ckptool.read.layouts.dcp_records import Metadata, TensorMeta
from ckptool.read.seen import GlobalsSeen
from tests.conftest import CliResult

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multifile"
DCP_DIRS = ["dcp_4ranks", "dcp_2ranks_nocollectives", "accelerate_fsdp/optimizer_0",
            "accelerate_fsdp/pytorch_model_fsdp_0"]


def metadata_of(name: str) -> list[tuple[str, Metadata]]:
    layout = recognise.recognise(str(FIXTURES / name))
    assert layout is not None
    seen = GlobalsSeen()
    return [(m, dcp_metadata.parse(layout.directory, m, seen)) for m in layout.metadata]


# -- the loops as first written ----------------------------------------------------

def first_chunks(md: Metadata) -> dict[str, tuple[Chunk, ...]]:
    return {fqn: tuple(Chunk(item.file, o, s, item.offset, item.length,
                             dcp_chunks.rank(item.file), item.transforms)
                       for o, s, item in tm.boxes) for fqn, tm in md.tensors.items()}


def first_counts(md: Metadata) -> tuple[dict[str, int], dict[str, int]]:
    tensors: dict[str, int] = {}
    values: dict[str, int] = {}
    for tm in md.tensors.values():
        for _, _, item in tm.boxes:
            tensors[item.file] = tensors.get(item.file, 0) + 1
    for item in md.values.values():
        values[item.file] = values.get(item.file, 0) + 1
    return tensors, values


def first_groups(md: Metadata, paths: dict[str, tuple[str | int, ...]],
                 found: list[optim.OptimizerState]) -> tuple[dict[str, list[str]],
                                                             dict[str, str]]:
    parents = sorted({tuple(split_key(s.path))[:-1] for s in found if "/" in s.path},
                     key=len, reverse=True)
    groups: dict[str, list[str]] = {}
    keys: dict[str, str] = {}
    for fqn in md.tensors:
        path = paths.get(fqn, ())
        steps = tuple(str(p) for p in path)
        parent = next((p for p in parents if steps[:len(p)] == p and len(steps) > len(p) + 1),
                      None)
        entry = steps[:len(parent) + 1] if parent is not None else steps[:1] \
            if len(steps) > 1 else ()
        name = ".".join(entry)
        groups.setdefault(name, []).append(fqn)
        keys[name] = key_of(list(entry))
    return groups, keys


def first_merge(md: Metadata) -> Metadata:
    """What the merge of one ``.metadata`` made: a copy of it."""
    out = Metadata(version=md.version)
    out.planner.update(md.planner)
    out.values.update(md.values)
    out.tensors = {fqn: TensorMeta(fqn, tm.shape, tm.dtype, tm.requires_grad, list(tm.boxes))
                   for fqn, tm in md.tensors.items()}
    return out


# -- the same results ----------------------------------------------------------------

@pytest.mark.parametrize("name", DCP_DIRS)
def test_chunks_and_counts_made_in_bulk_are_the_loops(name: str) -> None:
    for _, md in metadata_of(name):
        assert md.tensors
        made = dcp_chunks.chunks(md.tensors)
        assert made == first_chunks(md)
        assert list(made) == list(md.tensors)
        assert all(type(c) is Chunk for cs in made.values() for c in cs)
        tensors, values = dcp_chunks.counts(md.tensors, md.values)
        assert (dict(tensors), dict(values)) == first_counts(md)


@pytest.mark.parametrize("name", DCP_DIRS)
def test_one_metadata_merges_into_what_the_loop_made(name: str) -> None:
    metas = metadata_of(name)
    for one in metas:
        warnings: list[str] = []
        notes: list[str] = []
        merged, others = dcp._merge([one], warnings, notes)
        assert merged == first_merge(one[1]) and others == [] and not warnings and not notes


def _paths(md: Metadata) -> dict[str, tuple[str | int, ...]]:
    return {fqn: tuple(p) for fqn, p in md.planner.items()
            if all(isinstance(x, (str, int)) for x in p) and p}


@pytest.mark.parametrize("name", DCP_DIRS)
def test_groups_are_those_the_loop_made(name: str) -> None:
    for _, md in metadata_of(name):
        paths = _paths(md)
        found = optim.find_flat(paths.values())
        assert dcp._groups(md, paths, found) == first_groups(md, paths, found)


def test_groups_under_an_app_state_are_those_the_loop_made() -> None:
    """``{"app": {"model": ..., "optim": ...}}``: groups under a parent entry,
    names without a path, and entries whose names join alike."""
    md = Metadata()
    paths: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in [
            ("app.model.w", ("app", "model", "w")), ("app.model.b", ("app", "model", "b")),
            ("app.optim.state.w.exp_avg", ("app", "optim", "state", "w", "exp_avg")),
            ("app.optim.param_groups.0.params", ("app", "optim", "param_groups", 0, "params")),
            ("top", ("top",)), ("loose", ()), ("a.b.c", ("a.b", "c")), ("a.b.d", ("a", "b", "d")),
            ("unlisted", ("unlisted", "x"))]:
        md.tensors[fqn] = TensorMeta(fqn, (1,), "float32", False)
        if path:
            paths[fqn] = path
    del paths["unlisted"]
    found = optim.find_flat(paths.values())
    assert found  # the optimizer under "app" is found, so "app" is a parent
    assert dcp._groups(md, paths, found) == first_groups(md, paths, found)


# -- work done once --------------------------------------------------------------------

def test_a_dry_run_plans_with_the_collector_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                run_cli: Any) -> None:
    from ckptool.write.distributed import run

    enabled: list[bool] = []
    real = run.plan_only

    def plan_only(*args: Any, **kwargs: Any) -> Any:
        enabled.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "plan_only", plan_only)
    assert gc.isenabled()
    result: CliResult = run_cli("convert", str(FIXTURES / "dcp_4ranks"),
                                str(tmp_path / "o.safetensors"), "--dry-run", "--workers", "3",
                                "--json")
    assert result[0] == 0, result[2]
    assert enabled == [False]
    assert gc.isenabled()  # (back on after)
    assert not os.path.exists(tmp_path / "o.safetensors")


@pytest.mark.parametrize("name", ["dcp_4ranks", "accelerate_fsdp"])
def test_a_checkpoint_of_many_files_picks_its_state_dict_once(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = ckptool.open(FIXTURES / name).main_state_dict
    assert expected is not None and expected.keys
    calls: list[int] = []
    real = reader._main_state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "_main_state_dict", counted)
    assert ckptool.open(FIXTURES / name).main_state_dict == expected
    assert len(calls) == 1


def test_a_dry_run_that_is_the_whole_process_leaves_its_plan_to_the_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli: Any) -> None:
    """The ``ckptool`` executable ends without the interpreter's teardown:
    the plan (the whole checkpoint read) is not freed object by object
    first. Called in a longer-lived process, nothing is kept."""
    import weakref

    from ckptool.cli import common
    from ckptool.write.distributed import run

    plans: list[weakref.ref[Any]] = []
    real = run.plan_only

    def plan_only(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        plans.append(weakref.ref(plan))
        return plan

    monkeypatch.setattr(run, "plan_only", plan_only)
    monkeypatch.setattr(common, "_KEPT", [])
    monkeypatch.setattr(gc, "freeze", lambda: None)  # (this process goes on)
    for whole in (False, True):
        monkeypatch.setattr(common, "_WHOLE_PROCESS", [whole])
        code, _, err = run_cli("convert", str(FIXTURES / "dcp_4ranks"),
                               str(tmp_path / "o.safetensors"), "--dry-run", "--workers", "2")
        assert code == 0, err
    gc.collect()
    assert plans[0]() is None  # freed as it went
    kept = plans[1]()
    assert kept is not None and len(common._KEPT) == 1 and common._KEPT[0] is kept  # to the end


def test_each_rank_plans_with_the_collector_off(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import on_thread_ranks

    from ckptool.errors import CkptoolError
    from ckptool.write.distributed import run

    enabled: list[bool] = []
    real = run.make

    def make(*args: Any, **kwargs: Any) -> Any:
        enabled.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "make", make)
    out = on_thread_ranks(2, lambda w: run.convert(w, str(FIXTURES / "dcp_4ranks"),
                                                   str(tmp_path / "o.safetensors"),
                                                   say=lambda e: None), (CkptoolError, OSError))
    assert not any(isinstance(o, BaseException) for o in out), out
    assert enabled == [False, False]
    assert gc.isenabled()
