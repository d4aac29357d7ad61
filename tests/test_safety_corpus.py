"""The safety verdict fails closed: every payload kind, in every container,
is flagged unsafe with the name that would run or refused (exit 3) naming
it; never reported clean, never run; and fix never writes it. The other
side: benign files stay free of ``unsafe``, so that the warning means
something.

Payloads and builders come from ``test_malicious``; the containers here add
where a payload hides: a second pickle after the first one's STOP, bytes
after data.pkl's pickle or after a legacy file's storages, the state of an
object, a list, a pickle without a protocol header (protocol 0/1 style)
and one that declares protocol 5. A function from a module ckptool has
never heard of, called at load time, is a payload too.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptool
from ckptool.errors import CkptoolError
from tests.test_malicious import (
    PAYLOADS,
    Payload,
    benign_object,
    build,
    call,
    dct,
    g,
    in_zip,
    legacy,
    lst,
    pkl,
    s,
    split,
)

UNKNOWN = "ckptool_corpus_helpers"  # a module ckptool knows nothing about
HELPERS = "def run_code(source):\n    exec(source)\n\nclass Box:\n    pass\n"


def _unknown_function(c: Path) -> bytes:
    return pkl(call(g(UNKNOWN, "run_code"), s(f"open({str(c)!r}, 'w').close()")))


def _called_object(c: Path) -> bytes:
    # an object of a class the file names, then called: its __call__ runs
    return pkl(call(call(g(UNKNOWN, "Box")), s(str(c))))


CORPUS: dict[str, Payload] = {
    **PAYLOADS,
    "unknown_function": Payload(_unknown_function, frozenset({f"{UNKNOWN}.run_code"})),
    "called_object": Payload(_called_object, frozenset({f"{UNKNOWN}.Box"})),
}


def _proto(payload: bytes, proto: int) -> bytes:
    _, body = split(payload)
    return (bytes([0x80, proto]) if proto >= 2 else b"") + body + b"."


def _in_state(payload: bytes) -> bytes:
    header, body = split(payload)
    return (header or b"\x80\x02") + build(call(g("argparse", "Namespace")),
                                           dct((s("hidden"), body))) + b"."


def _in_list(payload: bytes) -> bytes:
    header, body = split(payload)
    return (header or b"\x80\x02") + lst(benign_object()[2:-1], body) + b"."


def _zip_trailing(payload: bytes, zip_template: Path) -> bytes:
    """data.pkl holds a harmless pickle, then the payload after its STOP."""
    out = io.BytesIO()
    with zipfile.ZipFile(zip_template) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                data += payload
            dst.writestr(info.filename, data)
    return out.getvalue()


CONTAINERS: dict[str, Callable[[bytes, dict[str, Path]], bytes]] = {
    "raw": lambda p, t: p,
    "protocol0_style": lambda p, t: _proto(p, 0),
    "protocol5": lambda p, t: _proto(p, 5),
    "in_object_state": lambda p, t: _in_state(p),
    "in_list": lambda p, t: _in_list(p),
    "second_pickle": lambda p, t: benign_object() + p,
    "torch_zip": lambda p, t: in_zip(p, t["zip"]),
    "zip_after_data_pkl": lambda p, t: _zip_trailing(p, t["zip"]),
    "legacy_object": lambda p, t: legacy(p),
    "legacy_sys_info": lambda p, t: legacy(benign_object(), sys_info=p),
    "legacy_after_storages": lambda p, t: t["legacy"].read_bytes() + p,
}


@pytest.fixture(scope="module")
def helpers_on_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("helpers")
    (folder / f"{UNKNOWN}.py").write_text(HELPERS)
    return folder


def test_unknown_payloads_run_under_plain_pickle(helpers_on_path: Path, tmp_path: Path) -> None:
    """The control for the new payload kinds: they are real."""
    for name in ("unknown_function",):
        canary = tmp_path / name
        code = textwrap.dedent(f"""
            import pickle, sys
            sys.path.insert(0, {str(helpers_on_path)!r})
            pickle.loads({CORPUS[name].build(canary)!r})
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert canary.exists()


def flagged_or_refused(path: Path, names: frozenset[str]) -> str:
    """How ckptool took the file: 'flagged' (read, every name unsafe) or
    'refused' (a clean error naming one); fails otherwise."""
    try:
        ckpt = ckptool.open(path)
    except CkptoolError as exc:
        assert any(n in exc.message for n in names), exc.message
        assert exc.exit_code == 3
        return "refused"
    assert names <= set(ckpt.unsafe_globals), [(g.name, g.category) for g in ckpt.globals]
    return "flagged"


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_never_clean_never_run(name: str, container: str, tmp_path: Path,
                               torch_files: dict[str, Path]) -> None:
    payload = CORPUS[name]
    canary = tmp_path / "CANARY"
    path = tmp_path / "evil.pth"
    path.write_bytes(CONTAINERS[container](payload.build(canary), torch_files))
    flagged_or_refused(path, payload.unsafe)
    assert not canary.exists(), "the payload ran"


@pytest.mark.parametrize("container", ["raw", "torch_zip", "zip_after_data_pkl",
                                       "legacy_object", "legacy_sys_info",
                                       "legacy_after_storages", "second_pickle"])
@pytest.mark.parametrize("name", ["os_system", "builtins_eval", "unknown_function",
                                  "functools_partial", "called_object"])
def test_fix_never_writes_a_payload(name: str, container: str, tmp_path: Path,
                                    torch_files: dict[str, Path]) -> None:
    """fix refuses, or its output names no unsafe global (what follows a
    pickle is not written back)."""
    payload = CORPUS[name]
    canary = tmp_path / "CANARY"
    path = tmp_path / "evil.pth"
    path.write_bytes(CONTAINERS[container](payload.build(canary), torch_files))
    before = path.read_bytes()
    out = tmp_path / "out.pth"
    for opts in (ckptool.FixOptions(to="cpu"), ckptool.FixOptions(add_prefix="x.")):
        try:
            ckptool.fix(str(path), opts, str(out), force=True)
        except CkptoolError as exc:
            assert exc.exit_code in (2, 3)
            assert not out.exists()
        else:
            assert ckptool.open(out).unsafe_globals == []
    assert path.read_bytes() == before
    assert not canary.exists()


def test_the_cli_names_what_a_trailing_pickle_would_run(tmp_path: Path, run_cli: Callable[
        ..., tuple[int, str, str]]) -> None:
    path = tmp_path / "two.pkl"
    path.write_bytes(benign_object() + PAYLOADS["os_system"].build(tmp_path / "CANARY"))
    code, out, err = run_cli("inspect", str(path))
    assert code == 0 and err == ""
    assert "UNSAFE" in out and "os.system" in out
    assert "follow the end of the pickle" in out
    data = json.loads(run_cli("inspect", "--json", str(path))[1])
    assert data["unsafe_globals"] == ["os.system"]
    assert data["warnings"] and "1 more pickle" in data["warnings"][0]
    assert [g["where"] for g in data["globals"]] == [["after the end of the pickle"]]
    code, out, _ = run_cli("diagnose", str(path))
    assert code == 1 and "trailing-data" in out and "unsafe-globals" in out


def test_eval_in_a_legacy_key_list_is_named(tmp_path: Path) -> None:
    """torch runs the storage-key list's pickle: refused naming the call,
    not as a merely 'malformed' list to fetch again."""
    path = tmp_path / "keys.pth"
    data = (pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2)
            + pickle.dumps({"protocol_version": 1001}, 2) + benign_object()
            + pkl(call(g("builtins", "eval"), s("1+1"))))
    path.write_bytes(data)
    with pytest.raises(CkptoolError) as info:
        ckptool.open(path)
    assert "builtins.eval" in info.value.message and "torch.load" in info.value.message
    assert "fetch" not in info.value.hint


# -- the other side: no false alarms ---------------------------------------------------

BENIGN_CALLS = {
    # a class called with arguments (enums pickle so): custom, its code runs
    "enum_member": pkl(call(g("mypkg.config", "Stage"), b"K\x03")),
    # NEWOBJ + BUILD, as pickle writes any object
    "plain_object": pkl(build(g("mypkg.nets", "Net") + b")\x81", dct((s("width"), b"K\x08")))),
    # a function only referenced, never called
    "referenced_function": pkl(dct((s("act"), g("mypkg.nets", "gelu")))),
    "numpy_scalar": pickle.dumps(__import__("numpy").float64(1.5), 2),
    "numpy_array": pickle.dumps(__import__("numpy").arange(6).reshape(2, 3), 2),
    "defaultdict": pickle.dumps(__import__("collections").defaultdict(list, {"a": [1]}), 2),
    "namespace": pickle.dumps(__import__("argparse").Namespace(lr=0.1), 2),
    "datetime": pickle.dumps(__import__("datetime").datetime(2026, 1, 2), 2),
}


@pytest.mark.parametrize("name", sorted(BENIGN_CALLS))
def test_benign_uses_are_not_unsafe(name: str, tmp_path: Path) -> None:
    path = tmp_path / "benign.pkl"
    path.write_bytes(BENIGN_CALLS[name])
    ckpt = ckptool.open(path)
    assert ckpt.unsafe_globals == [], [(g.name, g.reason) for g in ckpt.globals]


def test_custom_classes_say_what_runs(tmp_path: Path) -> None:
    path = tmp_path / "c.pkl"
    path.write_bytes(pkl(lst(call(g("mypkg.config", "Stage"), b"K\x03"),
                             build(g("mypkg.nets", "Net") + b")\x81", b"}"),
                             g("mypkg.nets", "gelu"))))
    reasons = {g.name: (g.category, g.uses, g.reason) for g in ckptool.open(path).globals}
    assert reasons["mypkg.config.Stage"][:2] == ("custom", ("called",))
    assert "constructor runs" in reasons["mypkg.config.Stage"][2]
    assert reasons["mypkg.nets.Net"][:2] == ("custom", ("created", "built"))
    assert reasons["mypkg.nets.gelu"][:2] == ("custom", ())
    assert "referenced only" in reasons["mypkg.nets.gelu"][2]
