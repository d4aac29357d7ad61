"""The rest of what a careful user found: safetensors validated as the
library validates them, a file's ``__metadata__`` taken as input, keys shown
as the file's own text in the CLI and the browser, DCP metadata judged by
use, and no fix command printed for a file whose copied header pickles are
unsafe."""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError, safe_open

import ckptool
from ckptool.check.gpus import machine as gpus
from ckptool.describe import shown
from ckptool.errors import CkptoolError
from ckptool.keys import escape
from tests.test_browse import Pilot, drive
from tests.test_malicious import benign_object, call, g, pkl, s

RunCli = Callable[..., tuple[int, str, str]]
F32 = {"dtype": "F32", "shape": [2]}


def safetensors_file(path: Path, header: dict[str, Any] | bytes, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


BAD_SAFETENSORS = {
    "overlap": ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}},
                12, "overlaps"),
    "gap": ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [12, 20]}},
            20, "no tensor covers"),
    "same_range": ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [0, 8]}},
                   8, "overlaps"),
    "trailing_bytes": ({"a": {**F32, "data_offsets": [0, 8]}}, 12, "follow the last"),
    "not_from_zero": ({"a": {**F32, "data_offsets": [4, 12]}}, 12, "no tensor covers"),
    "key_twice": (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                  b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', 16, "twice"),
}


@pytest.mark.parametrize("name", sorted(BAD_SAFETENSORS))
def test_safetensors_the_library_refuses_are_refused(name: str, tmp_path: Path,
                                                     run_cli: RunCli) -> None:
    header, size, words = BAD_SAFETENSORS[name]
    path = safetensors_file(tmp_path / "bad.safetensors", header, bytes(size))
    with pytest.raises(SafetensorError), safe_open(str(path), "pt"):
        pass  # the library's own verdict, the control
    with pytest.raises(CkptoolError, match=words):
        ckptool.open(path)
    code, out, err = run_cli("diagnose", str(path))
    assert code == 3 and out == "" and "refuses this file" in err


def test_safetensors_the_library_takes_are_read(tmp_path: Path) -> None:
    """Out of order in the header, zero-size tensors, a padded header: fine."""
    header = {"b": {**F32, "data_offsets": [8, 16]}, "z": {"dtype": "F32", "shape": [0],
              "data_offsets": [0, 0]}, "a": {**F32, "data_offsets": [0, 8]}}
    path = safetensors_file(tmp_path / "ok.safetensors", json.dumps(header).encode() + b"  ",
                            bytes(16))
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "z"]
    assert sorted(t.key for t in ckptool.open(path).tensors) == ["a", "b", "z"]


@pytest.mark.parametrize("aliases", ["{not json", "[1, 2]", '{"c": "nope"}', '{"c": "c"}',
                                     '{"c": "d", "d": "c"}', '{"a": "b"}', '{"c": 3}'])
def test_metadata_aliases_are_input_not_instructions(aliases: str, tmp_path: Path,
                                                     run_cli: RunCli) -> None:
    header = {"__metadata__": {"ckptool.aliases": aliases},
              "a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [8, 16]}}
    path = safetensors_file(tmp_path / "m.safetensors", header, bytes(16))
    out = tmp_path / "m.pth"
    code, text, err = run_cli("convert", str(path), str(out))
    assert (code, err) == (0, ""), err
    assert "ignored" in text and "tied" not in text
    assert sorted(torch.load(out)) == ["a", "b"]


def test_good_aliases_are_restored(tmp_path: Path) -> None:
    header = {"__metadata__": {"ckptool.aliases": '{"c": "a"}'},
              "a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [8, 16]}}
    path = safetensors_file(tmp_path / "m.safetensors", header, bytes(16))
    result = ckptool.convert(str(path), str(tmp_path / "m.pth"))
    assert result.aliases == {"c": "a"} and result.notes == []
    sd = torch.load(tmp_path / "m.pth")
    assert sd["c"].data_ptr() == sd["a"].data_ptr()


# -- the file's own text ----------------------------------------------------------------

KEYS = ["emb[/]", "[red]x[/red]", "w[i]", "params[dense]/kernel", "enc:x:w", ":up:",
        "a\x1b[31mRED", "bidi\u202eevil", "two\nlines"]


@pytest.fixture
def odd_keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys[x].pth"
    torch.save({k: torch.ones(1) for k in KEYS}, path)
    return path


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--depth", "1"], ["diagnose"],
                                     ["fix", "--add-prefix", "p.", "--dry-run"]])
def test_cli_shows_keys_as_they_are(command: list[str], odd_keys: Path, run_cli: RunCli,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_cli(command[0], str(odd_keys), *command[1:])
    assert code in (0, 1) and err == "", err
    assert "\x1b" not in out and "\u202e" not in out and "❌" not in out
    assert "keys[x].pth" in out
    if command == ["inspect"]:
        for key in KEYS:  # keys as ckptool writes them: a name's own "/" escaped
            assert shown(escape(key)) in out, key


def test_diff_shows_keys_as_they_are(odd_keys: Path, run_cli: RunCli) -> None:
    code, out, err = run_cli("diff", str(odd_keys), "samples/tinynet.safetensors", "-n", "0")
    assert code == 1 and err == ""
    assert "emb[/]" in out and "[red]x[/red]" in out and "a\\x1b[31mRED" in out


def test_browser_shows_keys_as_they_are(odd_keys: Path) -> None:
    from ckptool.tui.textshot import screen_text

    async def script(app: Any, pilot: Pilot) -> None:
        await pilot.press("t")  # the flat list: whole keys
        await pilot.pause()
        text = screen_text(app)
        # keys as ckptool writes them: a name's own "/" escaped (ckptool.keys)
        for key in ("emb[\\/]", "[red]x[\\/red]", "w[i]", "enc:x:w", "a\\x1b[31mRED",
                    "bidi\\u202eevil", "two\\nlines"):
            assert key in text, key
        assert "\x1b" not in text

    drive(odd_keys, script, size=(120, 30))


def test_shown() -> None:
    assert shown("plain.key") == "plain.key"
    assert shown("a\x1bb\tc\u200bd\U000e0041") == "a\\x1bb\\tc\\u200bd\\U000e0041"


# -- DCP metadata and legacy headers ---------------------------------------------------------

def test_dcp_metadata_is_not_unsafe(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": torch.nn.Linear(2, 2).state_dict(), "step": 3},
             checkpoint_id=str(tmp_path / "ckpt"))
    ckpt = ckptool.open(tmp_path / "ckpt" / ".metadata")
    assert ckpt.unsafe_globals == []
    found = {g.name: g for g in ckpt.globals}
    meta = found["torch.distributed.checkpoint.metadata.Metadata"]
    assert meta.category == "torch" and "created" in meta.uses


def test_a_distributed_function_called_at_load_is_unsafe(tmp_path: Path) -> None:
    path = tmp_path / "d.pkl"
    path.write_bytes(pkl(call(g("torch.distributed.checkpoint.state_dict_loader", "load"),
                              s("x"))))
    assert ckptool.open(path).unsafe_globals == [
        "torch.distributed.checkpoint.state_dict_loader.load"]


def test_no_fix_command_for_an_unsafe_legacy_header(tmp_path: Path, run_cli: RunCli) -> None:
    """fix would copy the header pickles byte for byte: diagnose must not
    print a fix command that would write the payload."""
    path = tmp_path / "legacy.pth"
    payload = pkl(call(g("os", "system"), s("true")))
    sd = {"module.w": torch.ones(2)}
    legacy = tmp_path / "clean.pth"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    header_end = len(pickle.dumps(0x1950A86A20F9469CFC6C, 2)) + len(pickle.dumps(1001, 2))
    sys_info_len = len(data[header_end:]) - len(data[header_end:].split(b".", 1)[1])
    path.write_bytes(data[:header_end] + payload + data[header_end + sys_info_len:])
    ckpt = ckptool.open(path)
    assert ckpt.unsafe_globals == ["os.system"]
    assert [g.where for g in ckpt.globals if g.name == "os.system"] == [("sys_info",)]
    d = ckptool.diagnose(ckpt, gpus.assumed(0))
    assert d.fix_command is None and d.fix_refused and "os.system" in d.fix_refused
    code, _, err = run_cli("fix", str(path), "--strip-module", "-o", str(tmp_path / "o.pth"))
    assert code == 3 and "os.system" in err and not (tmp_path / "o.pth").exists()


def test_a_second_pickle_is_reported_even_when_harmless(tmp_path: Path) -> None:
    path = tmp_path / "two.pkl"
    path.write_bytes(benign_object() + benign_object() + b"junk")
    ckpt = ckptool.open(path)
    assert ckpt.unsafe_globals == []
    size = len(benign_object()) + 4
    assert ckpt.warnings == [f"{size} bytes follow the end of the pickle (1 more pickle, read "
                             "for what they name, then 4 bytes that are not): torch.load "
                             "ignores them, but they are not what torch.save writes"]


@pytest.mark.parametrize(("ops", "getattr_is", "unsafe"), [
    # getattr(argparse.Namespace, 'Foo'): how protocol 2 names a nested class
    (b"c__builtin__\ngetattr\ncargparse\nNamespace\nX\x03\x00\x00\x00Foo\x86R", "data", []),
    # getattr(G, 'name') names the global G.name: only referenced, it runs nothing
    (b"c__builtin__\ngetattr\ncposix\nsystem\nX\x03\x00\x00\x00Foo\x86R", "data", []),
    (b"c__builtin__\ngetattr\n", "data", []),
    # ...and called, it is judged as a call of G.name
    (b"c__builtin__\ngetattr\ncposix\nsystem\nX\x03\x00\x00\x00Foo\x86R)R", "data",
     ["posix.system.Foo"]),
    (b"c__builtin__\ngetattr\ncargparse\nNamespace\nX\x04\x00\x00\x00keys\x86R)R", "data",
     ["argparse.Namespace.keys"]),
    # getattr on a value that is not a global runs that object's own lookup: unknown
    (b"c__builtin__\ngetattr\nX\x01\x00\x00\x00aX\x04\x00\x00\x00join\x86R", "unsafe",
     ["builtins.getattr"]),
])
def test_getattr_names_the_global_it_looks_up(tmp_path: Path, ops: bytes, getattr_is: str,
                                              unsafe: list[str]) -> None:
    path = tmp_path / "g.pkl"
    path.write_bytes(b"\x80\x02" + ops + b".")
    ckpt = ckptool.open(path)
    verdicts = {g.name: g.category for g in ckpt.globals}
    assert verdicts["builtins.getattr"] == getattr_is
    assert ckpt.unsafe_globals == unsafe
