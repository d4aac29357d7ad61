"""The safety verdict models what the real loader calls, not which names appear.

An adversarial corpus of the classes ckptool's earlier name tables missed,
each built opcode by opcode the way an attacker who has read
``ckptool/read/pickle`` would, and each proven live: the control test loads
every one with CPython's C unpickler (what ``torch.load`` uses) in a
subprocess and sees its canary appear. Then ckptool must flag the global
that runs (or refuse the file naming it), never run it, and ``fix`` and
``convert`` must write nothing from it:

- an allowed callee that calls one of its arguments: a defaultdict's factory
  read through a ChainMap by ``dict``/``OrderedDict``/``Counter``, numpy's
  random-state helpers calling their constructor argument, a
  ``functools.partial`` whose target BUILD swapped, a nested
  ``torch.load`` of bytes the file carries reached through a helper;
- BUILD putting ``__setstate__``, ``append``, ``extend`` or ``add`` on an
  instance, which CPython then looks up there and calls;
- a method reached by ``getattr`` on an allowed class;
- a function from a package that ships with torch (networkx), reached as a
  factory.

Nothing here is a copy of a published payload: the classes are the same.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckptool
from ckptool.cli import main
from tests.test_malicious import (
    build,
    by,
    call,
    dct,
    g,
    i,
    in_zip,
    legacy,
    lst,
    pkl,
    s,
    sg,
    tup,
    wait_for,
)
from tests.test_safety_corpus import flagged_or_refused

MARK, APPENDS, ADDITEMS, EMPTY_DICT, NEWOBJ = b"(", b"e", b"\x90", b"}", b"\x81"


def touch_cmd(c: Path) -> bytes:
    return s(f"touch {c}")


def partial(func: bytes, *args: bytes) -> bytes:
    return call(g("functools", "partial"), func, *args)


def chain_read(reader: tuple[str, str], factory: bytes) -> bytes:
    """``reader(ChainMap(defaultdict(factory), {"k": 1}))``: reading key
    ``k`` misses the first map, whose ``__missing__`` calls the factory."""
    dd = call(g("collections", "defaultdict"), factory)
    chain = call(g("collections", "ChainMap"), dd, dct((s("k"), i(1))))
    return call(g(*reader), chain)


def _built_chainmap(c: Path) -> bytes:
    # ChainMap as pickle writes it: __newobj__ then BUILD {"maps": [...]}
    dd = call(g("collections", "defaultdict"), writer(c))
    chain = build(g("collections", "ChainMap") + tup() + NEWOBJ,
                  dct((s("maps"), lst(dd, dct((s("k"), i(1)))))))
    return pkl(call(g("collections", "Counter"), chain))


def _injected(name: str, then: bytes, target: bytes, func: bytes) -> bytes:
    armed = build(target, dct((s(name), func)))
    return armed + then


def _evil_legacy(c: Path) -> bytes:
    return legacy(pkl(call(g("os", "system"), touch_cmd(c))))


@dataclass(frozen=True)
class Attack:
    build: Callable[[Path], bytes]
    runs: frozenset[str]  # what ckptool must name


def A(build: Callable[[Path], bytes], *runs: str) -> Attack:
    return Attack(build, frozenset(runs))


# the sink: a function that ships with torch (networkx, a torch dependency)
# and writes a file. No name list flags it; only a call of it runs anything
SINK = "networkx.write_adjlist"


def writer(c: Path) -> bytes:
    """``partial(networkx.write_adjlist, None, c)``: called with anything, it
    opens (creates) ``c`` before it fails on its graph."""
    return partial(g("networkx", "write_adjlist"), b"N", s(str(c)))


def _adam(c: Path) -> bytes:
    adam = call(g("copyreg", "_reconstructor"), g("torch.optim.adam", "Adam"),
                g("builtins", "object"), b"N")
    group = call(g("collections", "defaultdict"), writer(c))  # no "params": its factory runs
    return pkl(build(adam, dct((s("defaults"), dct()), (s("state"), dct()),
                               (s("param_groups"), lst(group)))))


def _parameter_state(c: Path) -> bytes:
    meta = call(g("torch._utils", "_rebuild_meta_tensor_no_storage"), g("torch", "float32"),
                tup(i(2)), tup(i(1)), b"\x89")
    param = call(g("torch._utils", "_rebuild_parameter_with_state"), meta, b"\x89",
                 call(g("collections", "OrderedDict")), dct((s("__setstate__"), writer(c))))
    return pkl(build(param, s("state")))


def _meta_tensor() -> bytes:
    return call(g("torch._utils", "_rebuild_meta_tensor_no_storage"), g("torch", "float32"),
                tup(i(2)), tup(i(1)), b"\x89")


def _carrying(name: str, c: Path) -> bytes:
    """A Namespace whose BUILD put ``writer`` under ``name``."""
    return build(call(g("argparse", "Namespace")), dct((s(name), writer(c))))


def _partial_kwds(c: Path) -> bytes:
    # partial(Namespace, keys=writer)(): the object carries it without a BUILD of its own
    bound = build(partial(g("argparse", "Namespace")),
                  tup(g("argparse", "Namespace"), tup(), dct((s("keys"), writer(c))), b"N"))
    return pkl(call(g("builtins", "dict"), call(bound)))


HOOKS = tuple((s(h), dct()) for h in ("_backward_hooks", "_forward_hooks",
                                       "_backward_pre_hooks", "_forward_pre_hooks"))


def _module(module: str, cls: str, *attrs: tuple[bytes, bytes]) -> bytes:
    """A torch module made as pickle makes one: NEWOBJ, then BUILD its dict."""
    return build(g(module, cls) + tup() + NEWOBJ, dct(*HOOKS, *attrs))


def _module_as_keys(c: Path) -> bytes:
    # dict(ns) calls ns.keys(): a module, whose __call__ runs its forward
    module = _module("torch.nn.modules.linear", "Identity", (s("forward"), writer(c)))
    holder = build(call(g("argparse", "Namespace")), dct((s("keys"), module)))
    return pkl(call(g("builtins", "dict"), holder))


def _str_of_module(c: Path) -> bytes:
    # str(module) is Module.__repr__, which calls self.extra_repr()
    module = _module("torch.nn.modules.linear", "Identity", (s("extra_repr"), writer(c)),
                     (s("_modules"), dct()))
    return pkl(call(g("builtins", "str"), module))


def _list_of_sequential(c: Path) -> bytes:
    # list(seq) is Sequential.__iter__: iter(self._modules.values())
    seq = _module("torch.nn.modules.container", "Sequential",
                  (s("_modules"), _carrying("values", c)))
    return pkl(call(g("builtins", "list"), seq))


def _setitems_on_sequential(c: Path) -> bytes:
    # SETITEMS is Sequential.__setitem__, which calls self._modules.keys()
    seq = _module("torch.nn.modules.container", "Sequential",
                  (s("_modules"), _carrying("keys", c)))
    return pkl(seq + MARK + i(0) + s("x") + b"u")


def _mesh(c: Path) -> bytes:
    return build(g("torch.distributed.device_mesh", "DeviceMesh") + tup() + NEWOBJ,
                 dct((s("_hash_key"), writer(c))))


def _mesh_as_key(c: Path) -> bytes:
    # a dict key is hashed: DeviceMesh.__hash__ calls self._hash_key()
    return pkl(dct((_mesh(c), i(1))))


def _sequential(c: Path) -> bytes:
    """A Sequential whose __iter__ and __getitem__ call its _modules' values()."""
    return _module("torch.nn.modules.container", "Sequential",
                   (s("_modules"), _carrying("values", c)))


def _generic_alias(c: Path) -> bytes:
    # a typing alias is callable: calling it calls its __origin__
    alias = build(g("typing", "_GenericAlias") + tup() + NEWOBJ,
                  dct((s("__origin__"), writer(c)), (s("_inst"), b"\x88")))
    return pkl(call(g("codecs", "StreamReaderWriter"), s("x"), alias, alias))


ATTACKS: dict[str, Attack] = {
    # 1. an allowed callee calls one of its arguments
    "dict_reads_a_chainmap_factory": A(lambda c: pkl(chain_read(
        ("builtins", "dict"), writer(c))), SINK),
    "ordereddict_reads_a_chainmap_factory": A(lambda c: pkl(chain_read(
        ("collections", "OrderedDict"), writer(c))), SINK),
    "counter_reads_a_built_chainmap": A(_built_chainmap, SINK),
    "numpy_generator_calls_its_constructor": A(lambda c: pkl(call(
        g("numpy.random._pickle", "__generator_ctor"), s("MT19937"), writer(c))), SINK),
    "numpy_randomstate_loads_nested_bytes": A(lambda c: pkl(call(
        g("numpy.random._pickle", "__randomstate_ctor"), by(_evil_legacy(c)),
        g("torch.storage", "_load_from_bytes"))), "os.system"),
    "partial_target_swapped_by_build": A(lambda c: pkl(call(build(
        partial(g("builtins", "int")), tup(g("networkx", "write_adjlist"),
                                          tup(b"N", s(str(c))), b"N", b"N")))), SINK),
    "rebuild_from_type_calls_a_partial": A(lambda c: pkl(call(
        g("torch._tensor", "_rebuild_from_type_v2"), writer(c), g("torch", "Tensor"), tup(),
        dct())), SINK),
    "adam_setstate_reads_a_param_group": A(_adam, SINK),
    "uuid_setstate_reads_a_missing_key": A(lambda c: pkl(build(
        call(g("copyreg", "_reconstructor"), g("uuid", "UUID"), g("builtins", "object"), b"N"),
        call(g("collections", "defaultdict"), writer(c)))), SINK),
    "newobj_ex_spreads_a_chainmap": A(lambda c: pkl(call(
        g("copyreg", "__newobj_ex__"), g("argparse", "Namespace"), tup(),
        call(g("collections", "ChainMap"), call(g("collections", "defaultdict"), writer(c)),
             dct((s("k"), i(1)))))), SINK),
    # 2. BUILD puts a method on an instance; CPython looks it up there
    "setstate_put_on_an_ordereddict": A(lambda c: pkl(build(build(
        call(g("collections", "OrderedDict")), dct((s("__setstate__"), writer(c)))),
        s("state"))), SINK),
    "append_put_on_a_namespace": A(lambda c: pkl(_injected(
        "append", MARK + s("item") + APPENDS, call(g("argparse", "Namespace")), writer(c))),
        SINK),
    "add_put_on_a_namespace": A(lambda c: pkl(_injected(
        "add", MARK + s("item") + ADDITEMS, call(g("argparse", "Namespace")), writer(c))),
        SINK),
    "extend_put_on_a_simplenamespace": A(lambda c: pkl(_injected(
        "extend", MARK + s("item") + APPENDS, call(g("types", "SimpleNamespace")),
        writer(c))), SINK),
    "parameter_state_puts_setstate_on_the_tensor": A(_parameter_state, SINK),
    "dict_calls_keys_put_on_a_namespace": A(lambda c: pkl(call(g("builtins", "dict"), build(
        call(g("argparse", "Namespace")), dct((s("keys"), writer(c)))))), SINK),
    "userdict_calls_keys_put_on_a_namespace": A(lambda c: pkl(call(
        g("collections", "UserDict"), build(call(g("argparse", "Namespace")),
                                            dct((s("keys"), writer(c)))))), SINK),
    "adam_calls_setdefault_put_on_its_defaults": A(lambda c: pkl(build(
        call(g("copyreg", "_reconstructor"), g("torch.optim.adam", "Adam"),
             g("builtins", "object"), b"N"),
        dct((s("defaults"), build(call(g("argparse", "Namespace")),
                                  dct((s("setdefault"), writer(c))))),
            (s("state"), dct()), (s("param_groups"), lst())))), SINK),
    # 3. constructors and __setstate__ methods call methods of what they are given
    "uuid_calls_replace_of_its_argument": A(lambda c: pkl(call(
        g("uuid", "UUID"), _carrying("replace", c))), SINK),
    "randomstate_calls_squeeze_of_its_seed": A(lambda c: pkl(call(
        g("numpy.random.mtrand", "RandomState"), _carrying("squeeze", c))), SINK),
    "partial_keywords_carry_keys": A(_partial_kwds, SINK),
    "module_setstate_reads_a_namespace": A(lambda c: pkl(build(
        g("torch.nn.modules.linear", "Identity") + tup() + NEWOBJ, _carrying("keys", c))), SINK),
    "optimizer_setstate_calls_its_own_attribute": A(lambda c: pkl(build(
        g("torch.optim.sgd", "SGD") + tup() + NEWOBJ,
        dct((s("_patch_step_function"), writer(c)), (s("defaults"), dct()),
            (s("param_groups"), lst())))), SINK),
    "rebuild_from_type_calls_as_subclass_of_its_result": A(lambda c: pkl(call(
        g("torch._tensor", "_rebuild_from_type_v2"),
        g("torch._utils", "_rebuild_parameter_with_state"), s("x"),
        tup(_meta_tensor(), b"\x89", call(g("collections", "OrderedDict")),
            dct((s("as_subclass"), writer(c)))), dct())), SINK),
    "memmap_newobj_opens_a_file": A(lambda c: pkl(
        g("numpy", "memmap") + tup(s(str(c)), s("uint8"), s("w+"), i(0), tup(i(4))) + NEWOBJ),
        "numpy.memmap"),
    "typing_alias_called_by_a_codec_wrapper": A(_generic_alias, "typing._GenericAlias"),
    # 4. the class's own code uses what BUILD put on its object: a module's
    # __call__ its forward, __repr__ its extra_repr, a container's __iter__ and
    # __setitem__ its _modules' methods, a mesh's __hash__ its _hash_key
    "module_called_as_a_mapping_method": A(_module_as_keys, SINK),
    "str_of_a_module_calls_extra_repr": A(_str_of_module, SINK),
    "list_of_a_sequential_iterates_its_modules": A(_list_of_sequential, SINK),
    "setitems_on_a_sequential": A(_setitems_on_sequential, SINK),
    "a_mesh_hashed_as_a_dict_key": A(_mesh_as_key, SINK),
    "a_tuple_key_holding_a_mesh": A(lambda c: pkl(dct((tup(_mesh(c)), i(1)))), SINK),
    "str_of_a_list_of_modules": A(lambda c: pkl(call(g("builtins", "str"), lst(_module(
        "torch.nn.modules.linear", "Identity", (s("extra_repr"), writer(c)),
        (s("_modules"), dct()))))), SINK),
    "rnn_setstate_indexes_its_weights": A(lambda c: pkl(build(
        g("torch.nn.modules.rnn", "RNN") + tup() + NEWOBJ,
        dct(*HOOKS, (s("_all_weights"), _sequential(c)), (s("proj_size"), i(0))))), SINK),
    "a_sequential_as_a_handles_state": A(lambda c: pkl(build(
        g("torch.utils.hooks", "RemovableHandle") + tup() + NEWOBJ, _sequential(c))), SINK),
    "a_sequential_as_a_modules_state": A(lambda c: pkl(build(
        g("torch.nn.modules.linear", "Identity") + tup() + NEWOBJ, _sequential(c))), SINK),
    "a_sequential_given_to_a_structseqs_new": A(lambda c: pkl(
        g("os", "stat_result") + tup(_sequential(c)) + NEWOBJ), SINK),
    # a method reached by getattr on a class ckptool knows as data
    "method_by_getattr_on_a_data_class": A(lambda c: pkl(call(
        call(g("builtins", "getattr"), g("pathlib", "Path"), s("write_text")),
        call(g("pathlib", "Path"), s(str(c))), s("x"))), "pathlib.Path.write_text"),
}

CONTROL = textwrap.dedent("""
    import glob, os, pickle, sys
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.pkl"))):
        try:
            pickle.loads(open(path, "rb").read())
        except Exception:
            pass  # most fail after they ran: only the canary counts
""")


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("control")
    (work / "pickles").mkdir()
    (work / "canaries").mkdir()
    for name, attack in ATTACKS.items():
        (work / "pickles" / f"{name}.pkl").write_bytes(attack.build(work / "canaries" / name))
    subprocess.run([sys.executable, "-c", CONTROL, str(work / "pickles")],
                   capture_output=True, timeout=120, check=True)
    return work / "canaries"


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_runs_under_the_real_unpickler(name: str, ran: Path) -> None:
    assert wait_for(ran / name), f"{name} did not run under pickle.loads: not a live payload"


@pytest.mark.parametrize("container", ["raw", "torch_zip"])
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_is_flagged_and_never_runs(name: str, container: str, tmp_path: Path,
                                               torch_files: dict[str, Path]) -> None:
    canary = tmp_path / "CANARY"
    data = ATTACKS[name].build(canary)
    path = tmp_path / "evil.pth"
    path.write_bytes(data if container == "raw" else in_zip(data, torch_files["zip"]))
    flagged_or_refused(path, ATTACKS[name].runs)
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(path), str(out)]) == 3 and not out.exists()
    fixed = tmp_path / "fixed.pth"
    assert main(["fix", str(path), "--to", "cpu", "-o", str(fixed)]) == 3
    assert not fixed.exists()
    with pytest.raises(ckptool.CkptoolError):
        ckptool.load(path)
    assert not canary.exists(), "the payload ran"


def test_the_verdict_names_the_call_and_where(tmp_path: Path) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(ATTACKS["dict_reads_a_chainmap_factory"].build(tmp_path / "CANARY"))
    glob = next(g for g in ckptool.open(path).globals if g.name == SINK)
    assert glob.category == "unsafe"
    assert "functools.partial" in glob.reason and "ChainMap" in glob.reason
    assert "at byte" in glob.reason and "the pickle" in glob.reason


# -- what a reference that nothing calls is: data ---------------------------

@pytest.mark.parametrize(("body", "clean"), [
    # stored, never called: data, whatever the name
    (dct((s("hook"), g("os", "system"))), True),
    (dct((s("f"), partial(g("os", "system"), s("true")))), True),
    (call(g("collections", "defaultdict"), g("os", "system")), True),
    # a ChainMap stored, never read: its factories are never called
    (call(g("collections", "ChainMap"), call(g("collections", "defaultdict"),
                                              g("os", "system"))), True),
    # iterating a ChainMap reads no value: list() calls no factory
    (call(g("builtins", "list"), call(g("collections", "ChainMap"), call(
        g("collections", "defaultdict"), g("os", "system")))), True),
    # the same, read key by key: the factory runs
    (chain_read(("builtins", "dict"), g("os", "getcwd")), False),
    # an allowed name that calls its argument
    (call(g("numpy.random._pickle", "__bit_generator_ctor"), g("os", "getcwd")), False),
    # a tensor rebuild ckptool does not implement is not trusted for its prefix
    (call(g("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"), b"N", b"N", b"N",
          b"\x89"), False),
    # a pure function is one name deep: a chain through what the module
    # imports is judged as what it reaches
    (call(g("torch.nn.functional", "gelu"), b"N"), True),
    (call(sg("torch.nn.functional", "torch.serialization.os.getcwd")), False),
    (call(call(g("builtins", "getattr"), call(g("builtins", "getattr"), g(
        "torch.nn.functional", "torch"), s("serialization")), s("os"))), False),
    # a module whose import runs something, even only referenced
    (g("antigravity", "fly"), False),
    (g("unittest.__main__", "main"), False),
])
def test_a_reference_is_data_a_call_is_judged(tmp_path: Path, body: bytes, clean: bool) -> None:
    path = tmp_path / "x.pkl"
    path.write_bytes(pkl(body))
    ckpt = ckptool.open(path)
    assert (ckpt.unsafe_globals == []) == clean, [(x.name, x.category, x.reason)
                                                  for x in ckpt.globals]


def test_a_class_given_a_callable_may_call_it(tmp_path: Path) -> None:
    """A class ckptool knows as data, called with a callable: its constructor
    could call it (LambdaLR calls its lr_lambda at once): unknown."""
    path = tmp_path / "x.pkl"
    path.write_bytes(pkl(call(g("torch.optim.lr_scheduler", "LambdaLR"), b"N",
                              g("os", "system"))))
    glob = {x.name: x for x in ckptool.open(path).globals}["os.system"]
    assert glob.category == "unsafe" and "LambdaLR" in glob.reason


def test_pickle_protocol_builders_are_what_pickle_writes() -> None:
    """The builders above speak the pickle CPython reads (a sanity check on
    the corpus itself: a harmless object round-trips)."""
    assert pickle.loads(pkl(call(g("collections", "OrderedDict"),
                                 lst(tup(s("a"), i(1)))))) == {"a": 1}


def test_a_walk_past_its_bounds_fails_closed(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What a bounded walk does not reach could be anything: a factory after
    a filler longer than ckptool follows is not taken for data."""
    from ckptool.read.pickle import calls

    monkeypatch.setattr(calls, "MAX_ITEMS", 50)
    group = call(g("collections", "defaultdict"), writer(tmp_path / "CANARY"))
    filler = MARK + i(0) * 200 + b"l"
    path = tmp_path / "x.pkl"
    path.write_bytes(pkl(build(
        call(g("copyreg", "_reconstructor"), g("torch.optim.adam", "Adam"),
             g("builtins", "object"), b"N"),
        dct((s("param_groups"), lst(group)), (s("zzz"), filler)))))
    unsafe = ckptool.open(path).unsafe_globals
    assert "ckptool.<more than ckptool follows>" in unsafe
    assert not (tmp_path / "CANARY").exists()


REWRITTEN = """
import pickle, sys
class Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return None  # the storages: not what this is about
try:
    Unpickler(open(sys.argv[1], "rb")).load()
except Exception:
    pass
"""


def _reordered(c: Path) -> bytes:
    """``dict(M)`` while M is bare, then a BUILD gives M a ``keys``: loaded as
    written nothing runs; written back by a rewrite, M comes whole first."""
    m = call(g("collections", "UserList")) + b"q\x01"  # BINPUT 1
    late = b"h\x01" + dct((s("keys"), writer(c))) + b"b0"  # BINGET 1, BUILD, POP
    return pkl(dct((s("m"), m), (s("d"), call(g("builtins", "dict"), b"h\x01"))) + late)


def test_a_rewrite_is_judged_as_it_would_be_written(tmp_path: Path,
                                                   torch_files: dict[str, Path]) -> None:
    """fix writes each object whole where it is first reached: a call the
    input made before the object got its attributes would come after them.
    The input is clean; the pickle fix would write is judged before anything
    is written, and refused (in place too: the input is left as it was)."""
    from ckptool.read import dispatch
    from ckptool.read.resolve import faithful
    from ckptool.write import repickle

    canary = tmp_path / "RAN"  # the control makes it: not named CANARY (test_malicious)
    path = tmp_path / "reordered.pth"
    path.write_bytes(in_zip(_reordered(canary), torch_files["zip"]))
    assert ckptool.open(path).unsafe_globals == []
    before = path.read_bytes()
    out = tmp_path / "out.pth"
    assert main(["fix", str(path), "--to", "cpu", "-o", str(out)]) == 3 and not out.exists()
    assert main(["fix", str(path), "--to", "cpu", "--in-place"]) == 3
    assert path.read_bytes() == before and not canary.exists()
    # the control: what fix would have written runs the payload
    with faithful():
        raw = dispatch.read(str(path))
    written = repickle.dumps(raw.root, lambda ref: tuple([*(ref.pid or ())]), judge=False)
    (tmp_path / "w.pkl").write_bytes(written)
    subprocess.run([sys.executable, "-c", REWRITTEN, str(tmp_path / "w.pkl")], check=True,
                   timeout=60)
    assert wait_for(canary), "the rewritten order did not run it: not a live payload"


def test_a_nested_files_globals_say_where_they_are(tmp_path: Path) -> None:
    """What a torch file carried as bytes names is said to be there, whether
    loading calls it (os.system) or only stores it (math.cos)."""
    nested = legacy(pkl(dct((s("f"), g("math", "cos")), (s("x"), call(g("os", "system"),
                                                                       s("true"))))))
    path = tmp_path / "nested.pkl"
    path.write_bytes(pkl(call(g("numpy.random._pickle", "__randomstate_ctor"), by(nested),
                              g("torch.storage", "_load_from_bytes"))))
    globs = {x.name: x for x in ckptool.open(path).globals}
    assert globs["os.system"].category == "unsafe" and globs["math.cos"].category == "data"
    for name in ("os.system", "math.cos"):
        assert any("embedded torch file" in w for w in globs[name].where), globs[name].where
