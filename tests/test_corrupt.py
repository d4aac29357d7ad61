"""Damaged, truncated and wrong-kind inputs: every one is a CkptoolError with
a one-line message and a hint, and the CLI turns it into exit code 3, nothing
on stdout, and exactly two lines on stderr (``ckptool: error: ...`` and
``hint: ...``), never a traceback.

Each case builds its file in ``tmp_path`` from a real torch.save file, a
real safetensors file, or plain bytes, and names a pattern its message must
match, so a case that stops failing for its own reason shows up.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import random
import re
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptool
from ckptool.errors import CkptoolError

Build = Callable[[Path, dict[str, Path]], Path]  # (folder, torch files) -> input path


def write(data: bytes) -> Build:
    def make(folder: Path, torch_files: dict[str, Path]) -> Path:
        path = folder / "input.pth"
        path.write_bytes(data)
        return path
    return make


def from_torch(kind: str, change: Callable[[bytes], bytes]) -> Build:
    """A torch.save file ('zip' or 'legacy'), changed."""
    def make(folder: Path, torch_files: dict[str, Path]) -> Path:
        path = folder / "input.pth"
        path.write_bytes(change(torch_files[kind].read_bytes()))
        return path
    return make


def cut_at(fraction: float) -> Callable[[bytes], bytes]:
    return lambda data: data[: int(len(data) * fraction)]


def central_directory(data: bytes) -> tuple[int, int]:
    """(offset, size) of a zip's central directory, from its end record."""
    end = data.rindex(b"PK\x05\x06")
    size, offset = struct.unpack("<II", data[end + 12:end + 20])
    return offset, size


def cut_in_central_directory(data: bytes) -> bytes:
    offset, size = central_directory(data)
    return data[: offset + size // 2]


def rezip(change: Callable[[str, bytes], bytes | None],
          compression: int = zipfile.ZIP_STORED) -> Callable[[bytes], bytes]:
    """Rewrite each record through ``change`` (None drops the record)."""
    def apply(data: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                new = change(info.filename, src.read(info))
                if new is not None:
                    dst.writestr(info.filename, new, compress_type=compression)
        return out.getvalue()
    return apply


def record(suffix: str, new: Callable[[bytes], bytes | None]) -> Callable[[bytes], bytes]:
    return rezip(lambda name, data: new(data) if name.endswith(suffix) else data)


def patch_central_entry(data: bytes, name_suffix: bytes, offset: int, value: bytes) -> bytes:
    """Overwrite a field of the central-directory entry whose name ends with ``name_suffix``."""
    start, size = central_directory(data)
    pos = start
    while pos < start + size:
        name_len, extra_len, comment_len = struct.unpack("<HHH", data[pos + 28:pos + 34])
        name = data[pos + 46:pos + 46 + name_len]
        if name.endswith(name_suffix):
            return data[:pos + offset] + value + data[pos + offset + len(value):]
        pos += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"no entry {name_suffix!r}")


def deflated_then(patch: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    return lambda data: patch(rezip(lambda n, d: d, zipfile.ZIP_DEFLATED)(data))


def damage_deflate_stream(data: bytes) -> bytes:
    """Flip bytes inside data.pkl's compressed bytes (its local header says where)."""
    pos = data.index(b"/data.pkl") + len(b"/data.pkl")
    return data[:pos + 2] + bytes(b ^ 0xFF for b in data[pos + 2:pos + 40]) + data[pos + 40:]


def bad_name_encoding(data: bytes) -> bytes:
    """Mark data.pkl's name as UTF-8 (flag bit 11) and put an invalid byte in it."""
    flagged = patch_central_entry(data, b"/data.pkl", 8, struct.pack("<H", 0x800))
    start, _ = central_directory(flagged)
    pos = flagged.index(b"/data.pkl", start)
    return flagged[:pos] + b"\xff" + flagged[pos + 1:]


def safetensors(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def legacy_pickles(data: bytes) -> list[int]:
    """Start offsets of the five pickles of a legacy file, and where storage data starts."""
    import pickletools

    starts, pos = [0], 0
    for _ in range(5):
        for op, _arg, at in pickletools.genops(io.BytesIO(data[pos:])):
            if op.name == "STOP":
                pos += at + 1
                break
        starts.append(pos)
    return starts


def cut_legacy(index: int) -> Callable[[bytes], bytes]:
    """Cut in the middle of pickle ``index`` (0 magic ... 4 keys), or of the storage data (5)."""
    def apply(data: bytes) -> bytes:
        starts = [*legacy_pickles(data), len(data)]
        return data[: (starts[index] + starts[index + 1]) // 2]
    return apply


def replace_legacy_pickle(index: int, new: bytes) -> Callable[[bytes], bytes]:
    def apply(data: bytes) -> bytes:
        starts = legacy_pickles(data)
        return data[:starts[index]] + new + data[starts[index + 1]:]
    return apply


def npz(folder: Path, torch_files: dict[str, Path]) -> Path:
    import numpy as np

    path = folder / "arrays.npz"
    np.savez(path, a=np.zeros(3))
    return path


def tar_of_text(folder: Path, torch_files: dict[str, Path]) -> Path:
    path = folder / "bundle.tar"
    with tarfile.open(path, "w") as tf:
        info = tarfile.TarInfo("readme.txt")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"hello"))
    return path


def missing(folder: Path, torch_files: dict[str, Path]) -> Path:
    return folder / "no_such_file.pth"


def directory(folder: Path, torch_files: dict[str, Path]) -> Path:
    (folder / "ckpt_dir").mkdir()
    return folder / "ckpt_dir"


def zip_without_data_pkl() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("docs/readme.txt", "not a checkpoint")
    return out.getvalue()


RANDOM = random.Random(1234).randbytes(4096)

CASES: dict[str, tuple[Build, str]] = {
    # (how to make the input, pattern its message must match)
    "missing_path": (missing, r"no such file"),
    "directory": (directory, r"is an empty directory"),
    "empty_file": (write(b""), r"empty \(0 bytes\)"),
    "one_byte": (write(b"\x80"), r"not a checkpoint"),
    "one_byte_zip_letter": (write(b"P"), r"not a checkpoint"),
    "random_bytes": (write(RANDOM), r"not a checkpoint"),
    "text_file": (write(b"epoch: 12\nlr: 0.1\n"), r"not a checkpoint"),
    "html_page": (write(b"<!DOCTYPE html>\n<html><body>404</body></html>\n"), r"HTML"),
    "gzip_file": (write(gzip.compress(b"\x80\x02}q\x00.")), r"gzip"),
    "git_lfs_pointer": (write(b"version https://git-lfs.github.com/spec/v1\n"
                              b"oid sha256:0123\nsize 1000\n"), r"Git LFS"),
    "hdf5_file": (write(b"\x89HDF\r\n\x1a\n" + bytes(64)), r"HDF5"),
    "npz_archive": (npz, r"numpy \.npz"),
    "zip_without_data_pkl": (write(zip_without_data_pkl()), r"without a data\.pkl"),
    "tar_of_text": (tar_of_text, r"tar archive"),
    # torch zip
    "zip_cut_after_first_header": (from_torch("zip", lambda d: d[:40]), r"truncated or corrupt"),
    "zip_cut_mid_data": (from_torch("zip", cut_at(0.5)), r"truncated or corrupt"),
    "zip_cut_mid_central_directory": (from_torch("zip", cut_in_central_directory),
                                      r"truncated or corrupt"),
    "zip_cut_last_byte": (from_torch("zip", lambda d: d[:-1]), r"truncated or corrupt"),
    "zip_data_pkl_garbage": (from_torch("zip", record("/data.pkl", lambda d: RANDOM[:300])),
                             r"cannot read pickle"),
    "zip_data_pkl_truncated": (from_torch("zip", record("/data.pkl", lambda d: d[:len(d) // 2])),
                               r"cannot read pickle"),
    "zip_missing_storage_record": (from_torch("zip", record("/data/0", lambda d: None)),
                                   r"storage record .*data/0 is missing"),
    "zip_storage_record_too_short": (from_torch("zip", record("/data/1", lambda d: d[:4])),
                                     r"holds 4 bytes, 12 expected"),
    "zip_damaged_deflate": (from_torch("zip", deflated_then(damage_deflate_stream)),
                            r"cannot read .*data\.pkl"),
    "zip_unknown_compression": (from_torch("zip", deflated_then(
        lambda d: patch_central_entry(d, b"/data.pkl", 10, struct.pack("<H", 99)))),
        r"cannot read .*data\.pkl|corrupt"),
    "zip_bad_name_encoding": (from_torch("zip", bad_name_encoding), r"truncated or corrupt"),
    "zip_compressed_pickle_claims_4gb": (from_torch("zip", deflated_then(
        lambda d: patch_central_entry(d, b"/data.pkl", 24, struct.pack("<I", 0xF000_0000)))),
        r"compressed and claims"),
    # legacy torch
    "legacy_cut_in_magic": (from_torch("legacy", cut_legacy(0)), r"cannot read pickle"),
    "legacy_cut_in_sys_info": (from_torch("legacy", cut_legacy(2)), r"cannot read pickle"),
    "legacy_cut_in_object": (from_torch("legacy", cut_legacy(3)), r"cannot read pickle"),
    "legacy_cut_in_storage_keys": (from_torch("legacy", cut_legacy(4)), r"cannot read pickle"),
    "legacy_cut_in_storage_data": (from_torch("legacy", cut_legacy(5)), r"truncated"),
    "legacy_bad_magic": (from_torch("legacy", lambda d: d[:4] + b"\x00" * 10 + d[14:]),
                         r"bad magic number"),
    "legacy_other_protocol_version": (from_torch("legacy", replace_legacy_pickle(
        1, pickle.dumps(1000, 2))), r"protocol version 1000"),
    "legacy_keys_not_a_list": (from_torch("legacy", replace_legacy_pickle(
        4, pickle.dumps("keys", 2))), r"malformed storage key list"),
    # safetensors
    "safetensors_header_longer_than_file": (write(safetensors({"a": F32_2x2}, length=4096)),
                                            r"header is longer than the file"),
    "safetensors_header_not_json": (write(safetensors(b"{not json at all}")),
                                    r"not valid JSON"),
    "safetensors_header_nests_deeply": (write(safetensors(
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")), r"nests too deeply"),
    "safetensors_bad_dtype": (write(safetensors({"a": {**F32_2x2, "dtype": "F33"}}, bytes(16))),
                              r"unknown dtype"),
    "safetensors_offsets_past_end": (write(safetensors({"a": F32_2x2}, bytes(8))),
                                     r"past the end of the file"),
    "safetensors_size_mismatch": (write(safetensors(
        {"a": {**F32_2x2, "data_offsets": [0, 12]}}, bytes(16))), r"spans 12 bytes, 16 expected"),
    "safetensors_negative_shape": (write(safetensors(
        {"a": {**F32_2x2, "shape": [-2, -2]}}, bytes(16))), r"bad shape"),
    "safetensors_metadata_not_strings": (write(safetensors(
        {"__metadata__": {"epoch": 3}, "a": F32_2x2}, bytes(16))), r"__metadata__"),
    # plain pickles
    "pickle_truncated": (write(pickle.dumps({"epoch": 3, "lr": [0.1] * 20}, 2)[:-7]),
                         r"cannot read pickle"),
    "pickle_unknown_opcode": (write(b"\x80\x02}\xfe."), r"cannot read pickle"),
    "pickle_memo_miss": (write(b"\x80\x02h\x07."), r"cannot read pickle"),
    "pickle_stack_underflow": (write(b"\x80\x02s."), r"cannot read pickle"),
}


def check_error(exc: CkptoolError, pattern: str) -> None:
    assert exc.exit_code == 3
    assert re.search(pattern, exc.message), exc.message
    for text in (exc.message, exc.hint):
        assert text.strip() and "\n" not in text, repr(text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_open_raises_a_ckptool_error(case: str, tmp_path: Path,
                                     torch_files: dict[str, Path]) -> None:
    make, pattern = CASES[case]
    path = make(tmp_path, torch_files)
    with pytest.raises(CkptoolError) as info:
        ckptool.open(path)
    check_error(info.value, pattern)


@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_reports_one_error_and_a_hint(case: str, as_json: bool, tmp_path: Path,
                                          torch_files: dict[str, Path],
                                          run_cli: Callable[..., tuple[int, str, str]]) -> None:
    make, pattern = CASES[case]
    path = make(tmp_path, torch_files)
    code, out, err = run_cli("inspect", *(["--json"] if as_json else []), str(path))
    assert (code, out) == (3, "")
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("ckptool: error: ") and re.search(pattern, lines[0])
    assert lines[1].startswith("hint: ") and len(lines[1]) > len("hint: ")
    assert "Traceback" not in err


def test_the_templates_themselves_read(torch_files: dict[str, Path], tmp_path: Path) -> None:
    """The control: every damaged torch file above starts from one that reads."""
    for path in torch_files.values():
        assert {t.key for t in ckptool.open(path).tensors} == {"w", "b"}
    path = write(safetensors({"a": F32_2x2}, bytes(16)))(tmp_path, torch_files)
    assert ckptool.open(path).tensors[0].shape == (2, 2)
    path.write_bytes(rezip(lambda n, d: d, zipfile.ZIP_DEFLATED)(
        torch_files["zip"].read_bytes()))
    assert len(ckptool.open(path).tensors) == 2  # a deflated archive still reads
