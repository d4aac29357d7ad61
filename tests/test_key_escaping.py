"""Keys of names that hold ``/`` or ``\\``: one escaping rule (``ckptool.keys``)
wherever keys are made and read.

``torch.save({"a/b": x, "a": {"b": y}})`` holds two tensors that a plain
"/"-join names alike; ckptool keys them ``a\\/b`` and ``a/b``, addresses each
with ``--drop`` and ``--extract``, shows them apart in JSON, ``diff`` and the
browser's tree, keys the streaming preview the same way, and writes the
file's own names back (never the escaped text). Files are real torch.save
files, read back with torch.load and safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import ckptool
from ckptool.check.diff import diff_checkpoints
from ckptool.keys import (
    Filter,
    escape,
    join_key,
    join_keys,
    key_of,
    pieces,
    split_key,
    unescape,
)
from ckptool.model import TensorInfo
from ckptool.tui.index import Index, Node, leaf_name

CliResult = tuple[int, str, str]
RunCli = Callable[..., CliResult]

X = torch.arange(2, dtype=torch.float32)  # under the top-level name "a/b"
Y = torch.arange(3, dtype=torch.float32) + 10  # under "a" > "b"


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


@pytest.fixture
def collision(tmp_path: Path) -> Path:
    path = tmp_path / "collide.pt"
    torch.save({"a/b": X, "a": {"b": Y}, "epoch": 3}, path)
    return path


@pytest.fixture
def slashed_names(tmp_path: Path) -> Path:
    """A state dict whose own names hold "/", under "model"."""
    path = tmp_path / "named.pt"
    sd = {"enc/layer.weight": torch.ones(2, 2), "enc/layer.bias": torch.zeros(2),
          "head.w": torch.full((3,), 2.0)}
    torch.save({"model": sd, "epoch": 1}, path)
    return path


# -- the rule itself -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["plain.name", "a/b", "c\\d", "e\\", "\\/", "/", "\\",
                                  "x//y", "trail/", "\\\\/\\"])
def test_every_name_splits_back_from_its_key(name: str) -> None:
    key = join_key("outer/in\\/ner", name)
    assert split_key(key) == ["outer", "in/ner", name]
    assert unescape(escape(name)) == name
    assert split_key(key_of(["p", name, "q"])) == ["p", name, "q"]


@pytest.mark.parametrize("names", [["a.w", "b.w"], ["a.w", "a/b"], ["c\\d", "e"], [],
                                   ["x/", "\\"], ["", "plain"]])
@pytest.mark.parametrize("path", ["", "state_dict", "in\\/ner"])
def test_join_keys_is_join_key_for_each(path: str, names: list[str]) -> None:
    keys = join_keys(path, names)
    assert keys == [join_key(path, n) for n in names]
    assert keys is not names  # a new list, whatever the names


def test_ordinary_names_are_their_own_keys() -> None:
    assert escape("module.conv.weight") == "module.conv.weight"
    assert join_key("", "module.conv.weight") == "module.conv.weight"
    assert join_key("state_dict", "w") == "state_dict/w"
    assert escape("a/b") == "a\\/b" and escape("c\\d") == "c\\\\d"
    assert split_key("") == []
    # pieces stay escaped, and the tree's cut also at "."
    assert pieces("a\\/b.c/d", dots=True) == ["a\\/b", "c", "d"]
    assert pieces("e\\\\/f") == ["e\\\\", "f"]  # an escaped "\" then a real "/"


# -- inspect, fix --drop, fix --extract ----------------------------------------------

def test_colliding_keys_are_two_keys_in_inspect_json(collision: Path, run_cli: RunCli) -> None:
    code, out, _ = run_cli("inspect", str(collision), "--json")
    assert code == 0
    report = json.loads(out)
    shapes = {t["key"]: t["shape"] for t in report["tensors"]}
    assert shapes == {"a\\/b": [2], "a/b": [3]}
    assert len(report["tensors"]) == 2
    by_storage = {tuple(s["tensors"]) for s in report["storages"]}
    assert by_storage == {("a\\/b",), ("a/b",)}


def test_inspect_text_and_depth_groups_keep_them_apart(collision: Path,
                                                       run_cli: RunCli) -> None:
    code, out, _ = run_cli("inspect", str(collision), "--depth", "1")
    assert code == 0
    first = [line.split()[0] for line in out.splitlines() if line.startswith(("a", "a\\"))]
    assert "a\\/b" in first and "a" in first  # the top-level name is its own group


def test_drop_escaped_path_drops_the_top_level_name(collision: Path, tmp_path: Path,
                                                     run_cli: RunCli) -> None:
    out = tmp_path / "dropped.pt"
    code, _, err = run_cli("fix", str(collision), "--drop", "a\\/b", "-o", str(out))
    assert code == 0, err
    loaded = load(out)
    assert "a/b" not in loaded
    assert list(loaded) == ["a", "epoch"]
    assert torch.equal(loaded["a"]["b"], Y)
    assert [t.key for t in ckptool.open(out).tensors] == ["a/b"]


def test_drop_plain_path_drops_the_nested_one(collision: Path, tmp_path: Path,
                                              run_cli: RunCli) -> None:
    out = tmp_path / "dropped.pt"
    code, _, err = run_cli("fix", str(collision), "--drop", "a/b", "-o", str(out))
    assert code == 0, err
    loaded = load(out)
    assert torch.equal(loaded["a/b"], X)  # the file's own name, never "a\/b"
    assert loaded["a"] == {}
    assert "a\\/b" not in loaded


def test_extract_an_escaped_path(tmp_path: Path, run_cli: RunCli) -> None:
    src = tmp_path / "runs.pt"
    torch.save({"run/1": {"w": X}, "run": {"1": {"w": Y}}, "step": 7}, src)
    ckpt = ckptool.open(src)
    assert [t.key for t in ckpt.tensors] == ["run\\/1/w", "run/1/w"]
    out = tmp_path / "one.pt"
    code, _, err = run_cli("fix", str(src), "--extract=run\\/1", "-o", str(out))
    assert code == 0, err
    loaded = load(out)
    assert list(loaded) == ["w"] and torch.equal(loaded["w"], X)
    code, _, err = run_cli("fix", str(src), "--extract=run/1", "-o", str(out), "--force")
    assert code == 0, err
    assert torch.equal(load(out)["w"], Y)


def test_extract_finds_a_main_state_dict_under_an_escaped_name(tmp_path: Path,
                                                              run_cli: RunCli) -> None:
    src = tmp_path / "wrapped.pt"
    torch.save({"x/y": {"w": X}, "epoch": 1}, src)
    ckpt = ckptool.open(src)
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.path == "x\\/y"
    assert list(ckpt.state_dict()) == ["w"]
    out = tmp_path / "sd.pt"
    code, _, err = run_cli("fix", str(src), "--extract", "-o", str(out))
    assert code == 0, err
    assert list(load(out)) == ["w"]
    # diagnose's load hint indexes the real name
    code, text, _ = run_cli("diagnose", str(src))
    assert "torch.load(path)['x/y']" in text


def test_backslash_names_round_trip(tmp_path: Path, run_cli: RunCli) -> None:
    src = tmp_path / "back.pt"
    names = {"c\\d": X, "c": {"d": Y}, "e\\": {"f": X + 1}, "e\\/f": X + 2}
    torch.save(names, src)
    keys = [t.key for t in ckptool.open(src).tensors]
    assert keys == ["c\\\\d", "c/d", "e\\\\/f", "e\\\\\\/f"]
    assert [split_key(k) for k in keys] == [["c\\d"], ["c", "d"], ["e\\", "f"], ["e\\/f"]]
    code, out, _ = run_cli("inspect", str(src), "--json")
    assert [t["key"] for t in json.loads(out)["tensors"]] == keys
    dst = tmp_path / "out.pt"
    for key in keys:
        code, _, err = run_cli("fix", str(src), "--drop", key, "-o", str(dst), "--force")
        assert code == 0, err
        assert [t.key for t in ckptool.open(dst).tensors] == [k for k in keys if k != key]
    # what torch.load sees of the last one: only the top-level "e\/f" is gone
    loaded = load(dst)
    assert list(loaded) == ["c\\d", "c", "e\\"] and torch.equal(loaded["e\\"]["f"], X + 1)


# -- state-dict names holding "/": fix and convert write the real names ---------------

def test_state_dict_names_stay_whole_and_unescaped(slashed_names: Path) -> None:
    ckpt = ckptool.open(slashed_names)
    sd = ckpt.main_state_dict
    assert sd is not None and sd.path == "model"
    assert sd.keys == ("enc/layer.weight", "enc/layer.bias", "head.w")
    assert [t.key for t in ckpt.tensors] == [
        "model/enc\\/layer.weight", "model/enc\\/layer.bias", "model/head.w"]
    assert list(ckpt.state_dict()) == list(sd.keys)


def test_a_whole_file_state_dict_keeps_its_names(tmp_path: Path) -> None:
    src = tmp_path / "flat.pt"
    torch.save({"enc/w": X, "dec.w": Y}, src)
    ckpt = ckptool.open(src)
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.path == ""
    assert ckpt.main_state_dict.keys == ("enc/w", "dec.w")
    assert [t.key for t in ckpt.tensors] == ["enc\\/w", "dec.w"]
    assert {n: t.shape for n, t in ckpt.state_dict().items()} == {"enc/w": (2,), "dec.w": (3,)}


def test_fix_strip_prefix_renames_real_names(slashed_names: Path, tmp_path: Path,
                                             run_cli: RunCli) -> None:
    out = tmp_path / "stripped.pt"
    code, _, err = run_cli("fix", str(slashed_names), "--extract", "--strip-prefix", "enc/",
                           "-o", str(out))
    assert code == 0, err
    loaded = load(out)
    assert list(loaded) == ["layer.weight", "layer.bias", "head.w"]
    kept = tmp_path / "kept.pt"
    code, _, err = run_cli("fix", str(slashed_names), "--add-prefix", "m.", "-o", str(kept))
    assert code == 0, err
    assert list(load(kept)["model"]) == ["m.enc/layer.weight", "m.enc/layer.bias", "m.head.w"]


def test_convert_writes_real_names_both_ways(slashed_names: Path, tmp_path: Path,
                                             run_cli: RunCli) -> None:
    st = tmp_path / "named.safetensors"
    code, _, err = run_cli("convert", str(slashed_names), str(st))
    assert code == 0, err
    with safe_open(str(st), "pt") as f:
        assert sorted(f.keys()) == ["enc/layer.bias", "enc/layer.weight", "head.w"]
        assert torch.equal(f.get_tensor("enc/layer.weight"), torch.ones(2, 2))
    assert sorted(t.key for t in ckptool.open(st).tensors) == [
        "enc\\/layer.bias", "enc\\/layer.weight", "head.w"]
    back = tmp_path / "back.pth"
    code, _, err = run_cli("convert", str(st), str(back))
    assert code == 0, err
    assert sorted(load(back)) == ["enc/layer.bias", "enc/layer.weight", "head.w"]
    # fix of the safetensors file: a drop by escaped key, the rest renamed by real name
    fixed = tmp_path / "fixed.safetensors"
    code, _, err = run_cli("fix", str(st), "--drop", "enc\\/layer.bias", "--add-prefix", "m.",
                           "-o", str(fixed))
    assert code == 0, err
    with safe_open(str(fixed), "pt") as f:
        assert sorted(f.keys()) == ["m.enc/layer.weight", "m.head.w"]


# -- diff, the browser's tree, the streaming preview ---------------------------------

def test_diff_all_tells_the_two_apart(collision: Path, tmp_path: Path,
                                      run_cli: RunCli) -> None:
    dropped = tmp_path / "dropped.pt"
    assert run_cli("fix", str(collision), "--drop", "a\\/b", "-o", str(dropped))[0] == 0
    a = ckptool.open(collision)
    same = diff_checkpoints(a, a, all_tensors=True)
    assert same.num_matched == 2 and same.num_identical == 2
    report = diff_checkpoints(a, ckptool.open(dropped), all_tensors=True)
    assert [n for n, _ in report.only_in_a] == ["a\\/b"]
    assert report.num_identical == 1 and not report.changed


def test_browse_index_shows_them_as_separate_nodes(collision: Path,
                                                   slashed_names: Path) -> None:
    ix = Index(ckptool.open(collision).tensors)
    assert list(ix.root.children) == ["a"]
    assert [t.key for t in ix.root.tensors] == ["a\\/b"]
    assert leaf_name(ix.root.tensors[0]) == "a\\/b"
    node_a = ix.node("a")
    assert node_a is not None and [t.key for t in node_a.tensors] == ["a/b"]
    assert ix.ancestors("a\\/b") == [] and ix.ancestors("a/b") == ["a"]
    assert [t.key for t in ix.lookup("a\\/b") if isinstance(t, TensorInfo)] == ["a\\/b"]
    rows = list(ix.tree({"a"}, "file"))
    assert [r.path if isinstance(r, Node) else r.key for r in rows] == ["a\\/b", "a", "a/b"]

    named = Index(ckptool.open(slashed_names).tensors)
    enc = named.node("model/enc\\/layer")  # a name's "/" splits no level; its "." does
    assert enc is not None and enc.name == "enc\\/layer" and enc.count == 2
    assert named.node("model/enc") is None
    assert named.ancestors("model/enc\\/layer.weight") == ["model", "model/enc\\/layer"]


def test_streaming_preview_keys_match_the_final_read(tmp_path: Path) -> None:
    src = tmp_path / "stream.pt"
    torch.save({"a/b": X, "a": {"b": Y, "c\\d": X}, "m/x": {"enc/l.w": Y}}, src)
    batches: list[list[TensorInfo]] = []
    ckpt = ckptool.open(src, on_tensors=batches.append)
    final = {t.key: t for t in ckpt.tensors}
    assert sorted(final) == ["a/b", "a/c\\\\d", "a\\/b", "m\\/x/enc\\/l.w"]
    partial = [t for batch in batches for t in batch]
    assert sorted(t.key for t in partial) == sorted(final)
    for t in partial:
        assert t == final[t.key], t.key


@pytest.mark.parametrize("pattern", ["b*", "b?w*"])
def test_a_filter_never_starts_a_name_at_an_escaped_slash(pattern: str) -> None:
    """'a\\/b.weight' is one name, "a/b.weight": a glob for names starting
    with b does not match it; after an escaped backslash, '/' separates."""
    keys = ["a\\/b.weight", "x/b.weight", "b.weight", "q\\\\/b.weight"]
    assert Filter(pattern).mask(keys) == [False, True, True, True]
