"""Hostile pickles: reading never runs code from the file, never imports a
module the file names, and reports every dangerous global it names.

Each payload would create a canary file if it ran. They are real:
``test_payload_runs_under_plain_pickle`` loads every one with plain
``pickle.loads`` (and the container forms with ``torch.load(weights_only=
False)``) in a subprocess and sees its canary appear. ckptool then reads the
same payloads as a raw pickle, as the data.pkl of a real torch zip, in both
pickle slots of a legacy torch file that torch.load unpickles, and nested 50
containers deep, and the canary must stay absent.

Payloads are written opcode by opcode (see the builders below) so that no
exploit class has to exist in the test process.
"""

from __future__ import annotations

import io
import json
import marshal
import pickle
import shlex
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckptool
from ckptool.errors import CkptoolError

RunCli = Callable[..., tuple[int, str, str]]  # the run_cli fixture (conftest)

# -- pickle builders: each returns opcodes that push one object ------------


def g(module: str, name: str) -> bytes:
    """GLOBAL module.name (protocol 0 and up)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def sg(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): name may be a dotted attribute chain."""
    return s(module) + s(name) + b"\x93"


def s(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def by(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


def i(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def lst(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"l"


def dct(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def call(func: bytes, *args: bytes) -> bytes:
    return func + tup(*args) + b"R"


def build(obj: bytes, state: bytes) -> bytes:
    """BUILD: set ``state`` on the object ``obj`` pushes."""
    return obj + state + b"b"


def pkl(body: bytes, proto: int = 2) -> bytes:
    return b"\x80" + bytes([proto]) + body + b"."


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
SYS_INFO = {"protocol_version": 1001, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}


def legacy(obj: bytes, sys_info: bytes | None = None) -> bytes:
    """A legacy torch file: magic, version, sys_info, object, storage keys."""
    return (pickle.dumps(LEGACY_MAGIC, 2) + pickle.dumps(1001, 2)
            + (sys_info or pickle.dumps(SYS_INFO, 2)) + obj + pickle.dumps([], 2))


# -- the payloads -----------------------------------------------------------


def touch(canary: Path) -> str:
    return f"touch {shlex.quote(str(canary))}"


def create(canary: Path) -> str:
    """A Python expression that creates the canary."""
    return f"open({str(canary)!r}, 'w').close()"


def code_bytes(canary: Path) -> bytes:
    return marshal.dumps(compile(create(canary), "<payload>", "exec"))


EXT_CODE = 231  # the sanity subprocess registers os.system under it


def _typing_hints(c: Path) -> bytes:
    ns = build(call(g("argparse", "Namespace")),
               dct((s("__annotations__"), dct((s("a"), s(create(c)))))))
    return pkl(call(g("typing", "get_type_hints"), ns))


def _setstate_trick(c: Path) -> bytes:
    # BUILD puts os.system in the instance dict as __setstate__; the next
    # BUILD calls it with the command
    ns = call(g("argparse", "Namespace"))
    armed = build(ns, dct((s("__setstate__"), g("os", "system"))))
    return pkl(build(armed, s(touch(c))))


def _run_path(c: Path) -> bytes:
    script = c.with_name(c.name + "_script.py")
    script.write_text(create(c) + "\n")
    return pkl(call(g("runpy", "run_path"), s(str(script))))


@dataclass(frozen=True)
class Payload:
    build: Callable[[Path], bytes]  # canary path -> whole pickle
    unsafe: frozenset[str]  # globals ckptool must report as unsafe
    needs_torch: bool = False  # plain pickle.loads imports torch for it


def P(build: Callable[[Path], bytes], *unsafe: str, needs_torch: bool = False) -> Payload:
    return Payload(build, frozenset(unsafe), needs_torch)


PAYLOADS: dict[str, Payload] = {
    "os_system": P(lambda c: pkl(call(g("os", "system"), s(touch(c)))), "os.system"),
    "os_system_protocol0": P(
        lambda c: g("os", "system") + b"(S" + repr(touch(c)).encode() + b"\ntR.", "os.system"),
    "posix_system": P(lambda c: pkl(call(g("posix", "system"), s(touch(c)))), "posix.system"),
    "subprocess_popen": P(lambda c: pkl(call(
        g("subprocess", "Popen"), lst(s("touch"), s(str(c))))), "subprocess.Popen"),
    "subprocess_check_output": P(lambda c: pkl(call(
        g("subprocess", "check_output"), lst(s("touch"), s(str(c))))),
        "subprocess.check_output"),
    "builtins_eval": P(lambda c: pkl(call(g("builtins", "eval"), s(create(c)))),
                       "builtins.eval"),
    "builtins_exec": P(lambda c: pkl(call(g("builtins", "exec"), s(create(c)))),
                       "builtins.exec"),
    "py2_builtin_eval": P(lambda c: pkl(call(g("__builtin__", "eval"), s(create(c)))),
                          "builtins.eval"),
    "import_getattr_chain": P(lambda c: pkl(call(call(
        g("builtins", "getattr"), call(g("builtins", "__import__"), s("os")), s("system")),
        s(touch(c)))), "builtins.getattr", "builtins.__import__"),
    "functools_partial": P(lambda c: pkl(call(call(
        g("functools", "partial"), g("os", "system"), s(touch(c))))),
        "os.system"),
    "runpy_run_code": P(lambda c: pkl(call(g("runpy", "_run_code"), s(create(c)), b"}")),
                        "runpy._run_code"),
    "runpy_run_path": P(_run_path, "runpy.run_path"),
    "pickle_loads_nested": P(lambda c: pkl(call(
        g("pickle", "loads"), by(pkl(call(g("os", "system"), s(touch(c))))))),
        "pickle.loads"),
    "marshal_eval": P(lambda c: pkl(call(
        g("builtins", "eval"), call(g("marshal", "loads"), by(code_bytes(c))))),
        "builtins.eval", "marshal.loads"),
    "builtins_open": P(lambda c: pkl(call(g("builtins", "open"), s(str(c)), s("w"))),
                       "builtins.open"),
    "types_functiontype": P(lambda c: pkl(call(call(
        g("types", "FunctionType"), call(g("marshal", "loads"), by(code_bytes(c))), b"}"))),
        "types.FunctionType", "marshal.loads"),
    "operator_methodcaller": P(lambda c: pkl(call(
        call(g("operator", "methodcaller"), s("system"), s(touch(c))),
        call(g("builtins", "__import__"), s("os")))),
        "operator.methodcaller", "builtins.__import__"),
    "copyreg_reconstructor": P(lambda c: pkl(call(
        g("copyreg", "_reconstructor"), g("subprocess", "Popen"), g("subprocess", "Popen"),
        lst(s("touch"), s(str(c))))), "subprocess.Popen"),
    "build_setstate": P(_setstate_trick, "os.system"),
    "stack_global_dunder_chain": P(lambda c: pkl(call(
        call(sg("builtins", "__dict__.get"), s("eval")), s(create(c))), 4),
        "builtins.__dict__.get"),
    "stack_global_module_chain": P(lambda c: pkl(call(
        sg("pathlib", "os.system"), s(touch(c))), 4), "pathlib.os.system"),
    "inst_opcode": P(lambda c: b"(S" + repr(touch(c)).encode() + b"\nios\nsystem\n.",
                     "os.system"),
    "obj_opcode": P(lambda c: b"(" + g("os", "system") + b"S" + repr(touch(c)).encode()
                    + b"\no.", "os.system"),
    "ext_opcode": P(lambda c: pkl(b"\x82" + bytes([EXT_CODE]) + tup(s(touch(c))) + b"R"),
                    f"copyreg.extension.{EXT_CODE}"),
    # gadgets in modules that merely hold data types: their functions are unsafe
    "uuid_command": P(lambda c: pkl(call(
        g("uuid", "_get_command_stdout"), s("touch"), s(str(c)))), "uuid._get_command_stdout"),
    "argparse_filetype": P(lambda c: pkl(call(call(g("argparse", "FileType"), s("w")),
                                              s(str(c)))), "argparse.FileType"),
    "typing_get_type_hints": P(_typing_hints, "typing.get_type_hints"),
    "numpy_open_memmap": P(lambda c: pkl(call(
        g("numpy.lib._format_impl", "open_memmap"), s(str(c)), s("w+"), s("uint8"),
        tup(i(1)))), "numpy.lib._format_impl.open_memmap"),
    # a plain-pickled storage is a whole legacy torch file that torch.load runs
    "torch_load_from_bytes": P(lambda c: pkl(call(
        g("torch.storage", "_load_from_bytes"),
        by(legacy(pkl(call(g("os", "system"), s(touch(c)))))))),
        "os.system", needs_torch=True),
}
if sys.version_info < (3, 13):  # the function exec()s code built from strings
    PAYLOADS["dataclasses_create_fn"] = P(lambda c: pkl(call(call(
        g("dataclasses", "_create_fn"), s("f"), lst(), lst(s(create(c)))))),
        "dataclasses._create_fn")


# -- containers -----------------------------------------------------------

def split(payload: bytes) -> tuple[bytes, bytes]:
    """(PROTO header or b'', opcodes that push the payload's object)."""
    assert payload.endswith(b".")
    header = payload[:2] if payload[:1] == b"\x80" else b""
    return header, payload[len(header):-1]


def nested(payload: bytes, depth: int) -> bytes:
    """The payload at the bottom of a dict of list of dict ... ``depth`` deep."""
    header, body = split(payload)
    opening, closing = [], []
    for level in range(depth):
        if level % 2:
            opening.append(b"]")
            closing.append(b"a")
        else:
            opening.append(b"}" + s("k"))
            closing.append(b"s")
    return (header or b"\x80\x02") + b"".join(opening) + body + b"".join(reversed(closing)) + b"."


def in_zip(payload: bytes, template: Path) -> bytes:
    """A real torch.save zip with its data.pkl replaced (stored, same root)."""
    out = io.BytesIO()
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = payload if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def benign_object() -> bytes:
    return pkl(dct((s("epoch"), i(3))))


CONTAINERS: dict[str, Callable[[bytes, dict[str, Path]], bytes]] = {
    "raw": lambda p, t: p,
    "torch_zip": lambda p, t: in_zip(p, t["zip"]),
    "legacy_object": lambda p, t: legacy(p),
    "legacy_sys_info": lambda p, t: legacy(benign_object(), sys_info=p),
    "nested50": lambda p, t: nested(p, 50),
}


# -- proof that the payloads are real ----------------------------------------

SANITY = textwrap.dedent("""
    import copyreg, glob, os, pickle, sys
    copyreg.add_extension("os", "system", {ext})
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.pkl"))):
        try:
            pickle.loads(open(path, "rb").read())
        except Exception:
            pass  # many payloads fail after they ran: only the canary counts
    import torch
    for path in sorted(glob.glob(os.path.join(sys.argv[2], "*"))):
        try:
            torch.load(path, weights_only=False)
        except Exception:
            pass
""").format(ext=EXT_CODE)


@pytest.fixture(scope="module")
def plain_pickle_ran(tmp_path_factory: pytest.TempPathFactory,
                     torch_files: dict[str, Path]) -> Path:
    """Load every payload with plain pickle, and each container with torch.load,
    in one subprocess; returns the folder where the canaries land."""
    work = tmp_path_factory.mktemp("sanity")
    pickles, containers, canaries = work / "pickles", work / "containers", work / "canaries"
    for folder in (pickles, containers, canaries):
        folder.mkdir()
    for name, payload in PAYLOADS.items():
        (pickles / f"{name}.pkl").write_bytes(payload.build(canaries / name))
    for name, make in CONTAINERS.items():
        if name != "raw":
            data = make(PAYLOADS["os_system"].build(canaries / f"container_{name}"), torch_files)
            (containers / name).write_bytes(data)
    subprocess.run([sys.executable, "-c", SANITY, str(pickles), str(containers)],
                   capture_output=True, timeout=120, check=True)
    return canaries


def wait_for(path: Path, seconds: float = 5.0) -> bool:
    """Popen-based payloads create the canary from a child process."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_payload_runs_under_plain_pickle(name: str, plain_pickle_ran: Path) -> None:
    assert wait_for(plain_pickle_ran / name), f"{name} did not run under pickle.loads"


@pytest.mark.parametrize("container", sorted(set(CONTAINERS) - {"raw"}))
def test_container_runs_under_torch_load(container: str, plain_pickle_ran: Path) -> None:
    assert wait_for(plain_pickle_ran / f"container_{container}")


# -- ckptool reads them without running them -----------------------------------


def assert_not_run(canary: Path) -> None:
    # a Popen payload would create it late, from a child: the last test of
    # this module looks for those
    assert not canary.exists(), "the payload ran"


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_read_reports_and_never_runs(name: str, container: str, tmp_path: Path,
                                     torch_files: dict[str, Path]) -> None:
    payload = PAYLOADS[name]
    canary = tmp_path / "CANARY"
    path = tmp_path / "evil.pth"
    path.write_bytes(CONTAINERS[container](payload.build(canary), torch_files))
    ckpt = ckptool.open(path)
    assert_not_run(canary)
    assert payload.unsafe <= set(ckpt.unsafe_globals), ckpt.globals


@pytest.mark.parametrize("container", ["raw", "torch_zip", "legacy_sys_info"])
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_cli_warns_unsafe(name: str, container: str, tmp_path: Path,
                          torch_files: dict[str, Path], run_cli: RunCli,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # long names must not wrap mid-name
    payload = PAYLOADS[name]
    canary = tmp_path / "CANARY"
    path = tmp_path / "evil.pth"
    path.write_bytes(CONTAINERS[container](payload.build(canary), torch_files))
    code, out, err = run_cli("inspect", str(path))
    assert (code, err) == (0, "")
    assert "UNSAFE" in out and all(n in out for n in payload.unsafe), out
    code, out, err = run_cli("inspect", "--json", str(path))
    assert (code, err) == (0, "")
    assert payload.unsafe <= set(json.loads(out)["unsafe_globals"])
    assert_not_run(canary)


@pytest.mark.parametrize("container", ["raw", "torch_zip", "legacy_object"])
def test_very_deep_nesting_is_a_clean_error(container: str, tmp_path: Path,
                                            torch_files: dict[str, Path],
                                            run_cli: RunCli) -> None:
    canary = tmp_path / "CANARY"
    path = tmp_path / "deep.pth"
    deep = nested(PAYLOADS["os_system"].build(canary), 100_000)
    path.write_bytes(CONTAINERS[container](deep, torch_files))
    with pytest.raises(CkptoolError, match="levels deep"):
        ckptool.open(path)
    code, out, err = run_cli("inspect", str(path))
    assert_clean_error(code, out, err)
    assert_not_run(canary)


def assert_clean_error(code: int, out: str, err: str) -> None:
    assert code == 3 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("ckptool: error: ") and lines[1].startswith("hint: ")


# -- never importing what the file names ------------------------------------------

EVIL_MODULE = "ckptool_evil_mod_xyz"

IMPORT_PROBE = textwrap.dedent("""
    import io, json, sys, contextlib
    sys.path.insert(0, sys.argv[1])
    {action}
    print(json.dumps({{"imported": {mod!r} in sys.modules}}))
""")


def test_never_imports_a_module_the_file_names(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / f"{EVIL_MODULE}.py").write_text(f"{create(canary)}\nboom = print\n")
    path = tmp_path / "names_module.pkl"
    path.write_bytes(pkl(call(g(EVIL_MODULE, "boom"), s("hello"))))

    def probe(action: str) -> dict[str, bool]:
        code = IMPORT_PROBE.format(action=action, mod=EVIL_MODULE)
        proc = subprocess.run([sys.executable, "-c", code, str(modules)],
                              capture_output=True, text=True, timeout=60, check=True)
        return json.loads(proc.stdout.splitlines()[-1])

    # the control: plain pickle imports it, and importing it runs its code
    assert probe(f"import pickle; pickle.loads(open({str(path)!r}, 'rb').read())") == {
        "imported": True}
    assert canary.exists()
    canary.unlink()
    read = (f"import ckptool; from ckptool.cli import main\n"
            f"names = [g.name for g in ckptool.open({str(path)!r}).globals]\n"
            f"assert '{EVIL_MODULE}.boom' in names\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['inspect', {str(path)!r}]) == 0")
    assert probe(read) == {"imported": False}
    assert not canary.exists()


# -- EXT opcodes and copyreg's cache of live objects --------------------------------

def test_ext_opcode_ignores_copyreg_cache_of_real_objects(tmp_path: Path) -> None:
    """A process that registered an extension and unpickled it once holds the
    real os.system in copyreg's cache; the C unpickler hands it out from there
    without calling find_class."""
    canary = tmp_path / "CANARY"
    path = tmp_path / "ext.pkl"
    path.write_bytes(PAYLOADS["ext_opcode"].build(canary))
    code = textwrap.dedent(f"""
        import copyreg, json, pickle, ckptool
        copyreg.add_extension("os", "system", {EXT_CODE})
        assert pickle.loads(b"\\x80\\x02\\x82\\x{EXT_CODE:02x}.").__name__ == "system"
        print(json.dumps(ckptool.open({str(path)!r}).unsafe_globals))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert "os.system" in json.loads(proc.stdout)
    assert_not_run(canary)


# -- pickles that attack the reader itself ------------------------------------------

def deep_tuple(depth: int) -> bytes:
    return b")" + b"\x85" * depth  # EMPTY_TUPLE, then TUPLE1 around it, depth times


def doubling_tuple(depth: int) -> bytes:
    """A tuple holding the previous one twice, ``depth`` times: 2**depth to hash."""
    body = b")q\x00"  # EMPTY_TUPLE, BINPUT 0
    for _ in range(depth):
        body += b"h\x00h\x00\x86q\x00"  # BINGET 0 twice, TUPLE2, BINPUT 0
    return body


HOSTILE = {
    # hashing a 200k-deep tuple overflows the C stack: a segfault, not an exception
    "deep_tuple_key": pkl(b"}" + deep_tuple(200_000) + i(1) + b"s"),
    "deep_tuple_in_set": pkl(b"\x8f(" + deep_tuple(200_000) + b"\x90", 4),
    "deep_tuple_frozenset": pkl(b"(" + deep_tuple(200_000) + b"\x91", 4),
    "deep_tuple_dict_opcode": pkl(b"(" + deep_tuple(200_000) + i(1) + b"d"),
    "deep_tuple_via_set_call": pkl(call(g("builtins", "set"), lst(deep_tuple(200_000)))),
    # hashing these never ends
    "doubling_tuple_key": pkl(b"}" + doubling_tuple(80) + i(1) + b"s"),
    "doubling_tuple_in_build_state": pkl(build(call(g("argparse", "Namespace")),
                                               b"}" + doubling_tuple(80) + i(1) + b"s")),
    "doubling_tuple_frozenset": pkl(call(g("builtins", "frozenset"),
                                         lst(doubling_tuple(80))), 4),
    "huge_int": pkl(dct((s("epoch"), b"\x8b" + struct.pack("<i", 4000) + b"\x01" * 4000))),
    "unregistered_opcode": pkl(b"\xff"),
    "build_on_shared_function": pkl(build(g("torch._utils", "_rebuild_tensor_v2"),
                                          tup(b"N", dct((s("__defaults__"), tup(i(1))))))),
    "build_on_class": pkl(build(g("collections", "defaultdict"),
                                tup(b"N", dct((s("__init__"), g("builtins", "list")))))),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_to_the_reader_is_a_clean_error(name: str, tmp_path: Path) -> None:
    """Run in a subprocess: a regression here is a crash or a hang, which
    must fail this test rather than take pytest down."""
    path = tmp_path / f"{name}.pkl"
    path.write_bytes(HOSTILE[name])
    proc = subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert_clean_error(proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


def test_build_cannot_poison_later_reads(tmp_path: Path) -> None:
    """BUILD on an object the reader hands out for every file (a class, a
    function) would change how the next files read: it is refused."""
    poison = tmp_path / "poison.pkl"
    poison.write_bytes(HOSTILE["build_on_class"])
    with pytest.raises(CkptoolError, match="did not create"):
        ckptool.open(poison)
    benign = tmp_path / "benign.pkl"
    benign.write_bytes(pkl(call(g("collections", "defaultdict"), g("builtins", "list"))))
    root = ckptool.open(benign).root
    from ckptool.read.constructors import safe_list

    assert isinstance(root, dict) and root.factory is safe_list


def test_build_cannot_rewrite_a_checked_tensor(tmp_path: Path,
                                               torch_files: dict[str, Path]) -> None:
    """A tensor record is checked against its storage when it is built; a
    later BUILD must not swap its shape for something unchecked."""
    storage = tup(s("storage"), g("torch", "FloatStorage"), s("0"), s("cpu"), i(6)) + b"Q"
    tensor = call(g("torch._utils", "_rebuild_tensor_v2"), storage, i(0), tup(i(2), i(3)),
                  tup(i(3), i(1)), b"\x89", call(g("collections", "OrderedDict")))
    forged = build(tensor, tup(b"N", dct((s("shape"), s("not a shape")))))
    path = tmp_path / "forged.pth"
    path.write_bytes(in_zip(pkl(dct((s("w"), forged))), torch_files["zip"]))
    with pytest.raises(CkptoolError, match="did not create"):
        ckptool.open(path)
    # the control: the same tensor without the BUILD reads fine
    path.write_bytes(in_zip(pkl(dct((s("w"), tensor))), torch_files["zip"]))
    assert ckptool.open(path).tensors[0].shape == (2, 3)


def test_chained_calls_do_not_grow_names(tmp_path: Path) -> None:
    """Calling a stand-in's result again and again (2 bytes per call) must
    not build a name, and a class, as long as the chain for each call."""
    path = tmp_path / "calls.pkl"
    path.write_bytes(pkl(call(g("mypkg", "thing")) + b")R" * 5_000))
    ckpt = ckptool.open(path)
    assert ckpt.entries[0].type == "mypkg.thing()"


def test_ordinary_tuple_and_frozenset_keys_still_read(tmp_path: Path) -> None:
    """The control for the hostile cases above."""
    path = tmp_path / "keys.pkl"
    path.write_bytes(pkl(dct((tup(s("a"), tup(i(1), i(2))), i(1)),
                             (b"(" + i(1) + i(2) + b"\x91", i(2))), 4))
    assert ckptool.open(path).root == {("a", (1, 2)): 1, frozenset({1, 2}): 2}


def test_payload_inside_protocol0_global_first_is_recognised(tmp_path: Path) -> None:
    """Classic exploit files start with 'c' (GLOBAL): read as a pickle and
    reported, not waved off as 'not a checkpoint'."""
    path = tmp_path / "classic.pkl"
    path.write_bytes(PAYLOADS["os_system_protocol0"].build(tmp_path / "CANARY"))
    assert ckptool.open(path).format == "pickle"


def test_no_canary_from_any_read(tmp_path: Path) -> None:
    """After every read in this module's process, no payload ran late
    (a child process started by a Popen that slipped through)."""
    assert not list(tmp_path.parent.glob("*/CANARY"))
