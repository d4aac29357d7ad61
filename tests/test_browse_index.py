"""The browser's view model (ckptool.tui.index): the module tree, filters,
sorts and lazy rows, without Textual."""

from __future__ import annotations

import pytest

from ckptool.model import TensorInfo
from ckptool.tui.index import Filter, FilteredTree, Index, Node, leaf_name, natural


def t(key: str, n: int = 4, dtype: str = "float32", loc: str | None = "cpu") -> TensorInfo:
    return TensorInfo(key, (n,), dtype, (1,), 0, key, loc, n * 4)


KEYS = [
    "state_dict/module.conv.weight",
    "state_dict/module.conv.bias",
    "state_dict/module.layers.10.weight",
    "state_dict/module.layers.2.weight",
    "state_dict/module.bn.num_batches_tracked",
    "optimizer/state/0/exp_avg",
]


def index() -> Index:
    tensors = [t(k, n=i + 1) for i, k in enumerate(KEYS)]
    tensors[4] = TensorInfo(KEYS[4], (), "int64", (), 0, "s4", "cuda:2", 8)
    return Index(tensors)


def keys(rows: object) -> list[str]:
    return [r.path if isinstance(r, Node) else r.key for r in rows]  # type: ignore[attr-defined]


def test_tree_counts_params_bytes_and_locations() -> None:
    ix = index()
    module = ix.node("state_dict/module")
    assert module is not None
    assert module.count == 5
    assert module.params == 1 + 2 + 3 + 4  # the int64 counter is no parameter
    assert module.nbytes == 4 * (1 + 2 + 3 + 4) + 8
    assert module.locations == {"cpu": 40, "cuda:2": 8}
    assert module.main_location == "cpu"
    conv = ix.node("state_dict/module.conv")
    assert conv is not None and [x.key for x in conv.tensors] == KEYS[:2]
    assert ix.node("optimizer/state/0").count == 1  # type: ignore[union-attr]
    assert ix.node("state_dict/modul") is None
    assert ix.root.count == len(KEYS)


def test_tree_rows_follow_expanded_nodes_only() -> None:
    ix = index()
    assert keys(ix.tree(set(), "file")) == ["state_dict", "optimizer"]
    rows = ix.tree({"state_dict", "state_dict/module"}, "file")
    assert keys(rows) == ["state_dict", "state_dict/module", "state_dict/module.conv",
                          "state_dict/module.layers", "state_dict/module.bn", "optimizer"]
    opened = ix.tree({"state_dict", "state_dict/module", "state_dict/module.conv"}, "file")
    assert keys(opened)[3:5] == KEYS[:2]
    assert [ix.depth(r, True) for r in opened][:5] == [0, 1, 2, 3, 3]


def test_default_expanded_opens_single_child_chains() -> None:
    ix = Index([t(f"sd/module.encoder.block{i}.{p}") for i in range(100) for p in "wb"])
    opened = ix.default_expanded(rows=30)
    # the chain opens, and the first wide level too: the screen fills
    assert {"sd", "sd/module", "sd/module.encoder"} <= opened
    assert not any(p.startswith("sd/module.encoder.block") for p in opened)
    small = Index([t("a.b.w"), t("a.b.b"), t("a.c.w"), t("a.c.b")])
    assert small.default_expanded(rows=30) == {"a", "a.b", "a.c"}


def test_flat_rows_and_sorts() -> None:
    ix = index()
    assert keys(ix.flat("file")) == KEYS
    assert keys(ix.flat("name"))[1:3] == ["state_dict/module.bn.num_batches_tracked",
                                          "state_dict/module.conv.bias"]
    by_name = keys(ix.flat("name"))
    assert by_name.index(KEYS[3]) < by_name.index(KEYS[2])  # layers.2 before layers.10
    assert keys(ix.flat("size"))[0] == "optimizer/state/0/exp_avg"  # 24 bytes, largest
    assert keys(ix.flat("device"))[-1] == KEYS[4]  # cuda:2 after cpu


def test_tree_sort_orders_siblings() -> None:
    ix = index()
    opened = {"state_dict", "state_dict/module"}
    assert keys(ix.tree(opened, "size"))[:3] == [
        "state_dict", "state_dict/module", "state_dict/module.layers"]
    assert keys(ix.tree(set(), "name")) == ["optimizer", "state_dict"]


@pytest.mark.parametrize(("pattern", "expected"), [
    ("conv", KEYS[:2]),
    ("CONV", []),  # a capital letter makes it case-sensitive
    ("Module.Conv", []),
    ("layers.1", [KEYS[2]]),
    ("*.weight", [KEYS[0], KEYS[2], KEYS[3]]),  # glob over the last part
    ("module.conv.*", KEYS[:2]),
    ("state_dict/*bias", [KEYS[1]]),  # glob over the whole key
    ("exp_avg", [KEYS[5]]),
    ("layers.?.weight", []),  # anchored: a glob matches whole names
    ("*layers.?.weight", [KEYS[3]]),
    ("[", []),  # an unclosed bracket is a literal, not an error
])
def test_filters(pattern: str, expected: list[str]) -> None:
    assert keys(index().flat("file", Filter(pattern))) == expected


def test_empty_filter_is_false_and_shows_all() -> None:
    assert not Filter("  ")
    assert keys(index().flat("file", Filter(""))) == KEYS


def test_filtered_tree_opens_every_node_with_a_match_lazily() -> None:
    ix = index()
    rows = ix.tree(set(), "file", Filter("conv"))
    assert isinstance(rows, FilteredTree)
    assert len(rows) == 5
    assert keys(rows) == ["state_dict", "state_dict/module", "state_dict/module.conv",
                          *KEYS[:2]]
    assert rows[-1].key == KEYS[1]  # type: ignore[union-attr]
    assert len(ix.tree(set(), "file", Filter("nothing-matches"))) == 0


def test_filtered_tree_count_matches_rows_on_a_big_index() -> None:
    ix = Index([t(f"m.l{i // 50}.b{i % 50}.{p}") for i in range(2000) for p in "wb"])
    for pattern in ("l1", "b4", ".w", "*.b", "zzz"):
        rows = ix.tree(set(), "size", Filter(pattern))
        made = list(rows)
        assert len(made) == len(rows)
        tensors = [r for r in made if isinstance(r, TensorInfo)]
        assert len(tensors) == len(ix.flat("file", Filter(pattern)))


def test_batches_grow_the_same_tree() -> None:
    whole = index()
    parts = Index()
    tensors = whole.tensors
    parts.extend(tensors[:3])
    assert parts.node("state_dict/module").count == 3  # type: ignore[union-attr]
    parts.extend(tensors[3:])
    assert keys(parts.flat("file")) == keys(whole.flat("file"))
    assert parts.node("state_dict/module").nbytes == whole.node(  # type: ignore[union-attr]
        "state_dict/module").nbytes


def test_a_key_that_is_also_a_module() -> None:
    ix = Index([t("a.b"), t("a.b.c")])
    rows = ix.tree({"a", "a.b"}, "file")
    assert keys(rows) == ["a", "a.b", "a.b", "a.b.c"]  # the tensor a.b, then the module a.b


def test_ancestors_and_helpers() -> None:
    ix = index()
    assert ix.ancestors("state_dict/module.conv.weight") == [
        "state_dict", "state_dict/module", "state_dict/module.conv"]
    assert leaf_name(ix.tensors[0]) == "weight"
    assert natural("layers.10") > natural("layers.2")


def test_deep_keys_do_not_recurse() -> None:
    key = ".".join(["a"] * 5000)
    ix = Index([t(key)])
    opened = set(ix.ancestors(key))
    assert len(ix.tree(opened, "name")) == 5000


def big(n: int = 20_000) -> Index:
    """Keys as bench/bench_browse.py makes them: module.encoder.layers.N.blockM.x"""
    return Index([t(f"state_dict/module.encoder.layers.{i // 40}.block{(i // 4) % 10}."
                    f"{('weight', 'bias', 'norm.weight', 'norm.running_mean')[i % 4]}")
                  for i in range(n)])


def test_a_row_deep_in_a_filtered_tree_is_found_without_making_the_rows_above() -> None:
    """A filter keystroke keeps the cursor on its row: finding that row, and
    drawing the screen around it, must not walk every row before it."""
    ix = big()
    deep = "state_dict/module.encoder.layers.450.block3.bias"
    rows = ix.tree(set(), "file", Filter("block3"))
    assert isinstance(rows, FilteredTree)
    at = rows.index_of(deep)
    assert at is not None and at > 2000
    screen = [rows[i] for i in range(at - 20, at + 20)]  # what the view draws
    assert rows[at].key == deep  # type: ignore[union-attr]
    assert rows.made <= len(screen) + 1  # the rows above it were never made
    assert rows.index_of("state_dict/module.encoder.layers.450") == at - 3
    assert rows.made <= 2 * len(screen) + 2


@pytest.mark.parametrize("sort", ["file", "name", "size", "device"])
@pytest.mark.parametrize("pattern", ["block3", "*.bias", "layers.1", "zzz", "norm"])
def test_random_access_rows_are_the_walked_rows(sort: str, pattern: str) -> None:
    ix = big(4000)
    walked = list(ix.tree(set(), sort, Filter(pattern)))  # made one after another
    assert len(walked) == len(ix.tree(set(), sort, Filter(pattern)))
    where = {keys([r])[0]: i for i, r in reversed(list(enumerate(walked)))}
    for step in (1, 7, 97):
        rows = ix.tree(set(), sort, Filter(pattern))
        for i in range(len(walked) - 1, -1, -step):  # backwards: every access seeks
            assert rows[i] is walked[i]
    rows = ix.tree(set(), sort, Filter(pattern))
    for key, i in list(where.items())[::13]:
        assert rows.index_of(key) == i  # type: ignore[attr-defined]
    assert rows.index_of("state_dict/module.encoder.layers.0.nothing") is None  # type: ignore[attr-defined]


def test_modules_closed_under_a_filter_hide_their_rows() -> None:
    ix = big(4000)
    closed = {"state_dict/module.encoder.layers.3", "state_dict/module.encoder.layers.7.block3"}
    rows = ix.tree(set(), "name", Filter("block3"), closed)
    made = list(rows)
    assert len(made) == len(rows)
    assert isinstance(rows, FilteredTree)
    shown = keys(made)
    assert "state_dict/module.encoder.layers.3" in shown
    assert not any(k.startswith("state_dict/module.encoder.layers.3.") for k in shown)
    assert "state_dict/module.encoder.layers.7.block3" in shown
    assert "state_dict/module.encoder.layers.7.block3.bias" not in shown
    assert not rows.is_open(ix.node("state_dict/module.encoder.layers.3"))  # type: ignore[arg-type]
    assert rows.is_open(ix.node("state_dict/module.encoder.layers.4"))  # type: ignore[arg-type]
    assert rows.index_of("state_dict/module.encoder.layers.3.block3.bias") is None
    for key in ("state_dict/module.encoder.layers.7.block3", "state_dict/module.encoder.layers.8"):
        assert rows.index_of(key) == shown.index(key)
        assert keys([rows[shown.index(key)]]) == [key]


def test_flat_rows_find_a_key_by_its_position() -> None:
    ix = big(4000)
    rows = ix.flat("name", Filter("*.bias"))
    key = "state_dict/module.encoder.layers.70.block2.bias"
    at = rows.index_of(key)  # type: ignore[attr-defined]
    assert at is not None and rows[at].key == key  # type: ignore[union-attr]
    assert rows.index_of("nothing") is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("pattern", ["*.bias", "*bias", "bias*", "*conv*", "module.conv*",
                                     "0/exp*", "state_dict/*", "*", "**", "*.Weight",
                                     "*layers.1*", "optimizer*"])
def test_plain_globs_match_as_the_glob_does(pattern: str) -> None:
    """``*X``, ``X*`` and ``*X*`` skip the regex: the same matches."""
    import fnmatch
    import re

    keys = [*KEYS, "bias", "a.bias.b", "Module.Weight", "x/module.convert"]
    filt = Filter(pattern)
    assert filt.glob
    flags = re.IGNORECASE | re.DOTALL if filt.fold else re.DOTALL
    rx = re.compile(r"(?:.*/)?" + fnmatch.translate(filt.pattern), flags)
    seen = [k.lower() for k in keys] if filt.fold else keys
    assert filt.mask(seen) == [rx.match(k) is not None for k in seen]


def reference_rows(ix: Index, sort: str, pattern: str, closed: set[str]) -> list[str]:
    """The filtered tree's rows by their definition: the whole tree in
    ``sort`` order, every module open, keeping a module that holds a match
    and each matching tensor, and nothing below a closed module."""
    from ckptool.tui.rows import walk_tree

    filt = Filter(pattern)
    matched = {id(x) for x in ix.flat("file", filt)}
    every = {n.path for n in walk_tree(ix.root, sort, set()) if isinstance(n, Node)}
    opened: set[str] = set()
    stack = [ix.root]
    while stack:  # every module path, to open them all
        node = stack.pop()
        opened.add(node.path)
        stack.extend(node.children.values())
    assert every <= opened

    def holds(node: Node) -> bool:
        return any(id(x) in matched for x in node.tensors) or any(
            holds(c) for c in node.children.values())

    out: list[str] = []
    hidden_below: list[str] = []
    for row in walk_tree(ix.root, sort, opened):
        key = row.path if isinstance(row, Node) else row.key
        if any(key.startswith(h) and key != h for h in hidden_below):
            continue
        if isinstance(row, Node):
            if holds(row):
                out.append(key)
                if row.path in closed:
                    hidden_below.append(row.path + ".")
                    hidden_below.append(row.path + "/")
        elif id(row) in matched:
            out.append(key)
    return out


def odd_index() -> Index:
    """Modules with no tensors of their own, with many, a tensor that is also a
    module, tensors at the top, a flat container of 300 names, and sizes that
    make the sorts differ."""
    names = [f"sd/m.a{i % 7}.b{i % 3}.{('w', 'bias', 'c.d.e')[i % 3]}" for i in range(60)]
    names += [f"sd/m.flat{i}" for i in range(300)]
    names += ["top", "sd/m.a1", "sd/m.a1.b1.w.x", "opt/state/0/exp_avg", "opt/state/1/exp_avg"]
    return Index([t(k, n=(i * 37) % 11 + 1, loc=("cpu", "cuda:0")[i % 2])
                  for i, k in enumerate(names)])


@pytest.mark.parametrize("sort", ["file", "name", "size", "device"])
@pytest.mark.parametrize("pattern", ["a1", "bias", "*.w", "flat2", "e", "zzz", "m", "*",
                                     "a3.b0", "exp_avg", "top"])
@pytest.mark.parametrize("closed", [set(), {"sd/m.a1"}, {"sd", "opt/state/0"},
                                    {"sd/m.a2.b2.c", "sd/m"}])
def test_filtered_tree_is_its_definition(sort: str, pattern: str, closed: set[str]) -> None:
    ix = odd_index()
    want = reference_rows(ix, sort, pattern, closed)
    rows = ix.tree(set(), sort, Filter(pattern), closed)
    assert keys(rows) == want  # iterated
    assert len(rows) == len(want)
    assert keys([rows[i] for i in range(len(rows) - 1, -1, -1)]) == want[::-1]  # random access
    for i, key in enumerate(want):
        first = want.index(key)  # a tensor that is also a module: the first row
        assert rows.index_of(key) == first  # type: ignore[attr-defined]
        assert keys([rows[i]]) == [key]
    assert rows.index_of("sd/m.nothing") is None  # type: ignore[attr-defined]
    assert isinstance(rows, FilteredTree) or not pattern
    assert rows.matches == len(ix.flat("file", Filter(pattern)))  # type: ignore[attr-defined]


def test_lookup_finds_every_tensor_of_a_key_and_the_module() -> None:
    one, two, other = t("a.b"), t("a.b"), t("a.b.c")
    ix = Index([one, other, two])  # the same key twice (two files' tensors, say)
    found = ix.lookup("a.b")
    assert found[0] is one and found[1] is two and found[2] is ix.node("a.b")
    assert ix.lookup("a.b.c") == [other]
    assert ix.lookup("nothing") == []
    single = Index([one, other])
    assert single.lookup("a.b")[0] is one and len(single.lookup("a.b")) == 2  # and the module
