"""What goes wrong with a checkpoint behind a URL is said in one line
naming the URL (never its credentials), with a hint and exit code 3, and
nothing half-read is reported: a missing file or repository, access
denied, a server that fails (retried a few times first), a truncated
response, a file replaced while it is read (never two versions mixed), a
scheme's library not installed (exit 2, naming the extra), a damaged
record met while converting (nothing written), a URL to write to, and a
URL to fix in place."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.read import remote
from ckptool.read.remote import stores

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


pytestmark = pytest.mark.usefixtures("fresh_remote")


def one_error(code: int, out: str, err: str, expected_code: int = 3) -> str:
    assert code == expected_code, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("ckptool: error: ") and lines[1].startswith("hint: "), err
    return err


def big_zip(tmp_path: Path) -> bytes:
    torch.save({f"l{i}": torch.randn(256, 256) for i in range(8)}, tmp_path / "m.pt")
    return (tmp_path / "m.pt").read_bytes()


def test_a_missing_file_is_not_found(http_server: Any, run_cli: Any) -> None:
    err = one_error(*run_cli("inspect", http_server.url_for("nothing.pt")))
    assert "nothing.pt: not found" in err


def test_a_missing_bucket_key_and_repo_are_not_found(s3_server: Any, fake_hub: Any,
                                                     run_cli: Any) -> None:
    bucket = s3_server.make_bucket()
    assert "not found" in one_error(*run_cli("inspect", f"s3://{bucket}/no/such/run"))
    assert "not found" in one_error(*run_cli("inspect", "hf://org/no-such-model"))


def test_credentials_in_a_url_are_never_printed(http_server: Any, run_cli: Any) -> None:
    host = http_server.url.split("://", 1)[1]
    url = f"http://user:hunter2@{host}/gone.pt?X-Amz-Signature=s3cr3t"
    code, out, err = run_cli("inspect", url)
    one_error(code, out, err)
    assert "hunter2" not in err + out and "s3cr3t" not in err + out
    assert f"http://{host}/gone.pt" in err


def test_a_server_that_fails_twice_is_asked_again(tmp_path: Path, http_server: Any,
                                                   run_cli: Any) -> None:
    url = http_server.put("m.pt", big_zip(tmp_path))
    http_server.faults.fail("/m.pt", 503, times=2, method="GET")
    code, _out, err = run_cli("inspect", "--json", url)
    assert code == 0, err


def test_a_server_that_keeps_failing_is_said(tmp_path: Path, http_server: Any,
                                             run_cli: Any) -> None:
    url = http_server.put("m.pt", big_zip(tmp_path))
    http_server.faults.fail("/m.pt", 503, times=None, method="GET")
    err = one_error(*run_cli("inspect", url))
    assert "the server failed (503)" in err and "4 attempts" in err


def test_throttling_is_said(tmp_path: Path, http_server: Any, run_cli: Any) -> None:
    url = http_server.put("m.pt", big_zip(tmp_path))
    http_server.faults.fail("/m.pt", 429, times=None, method="GET")
    assert "throttling" in one_error(*run_cli("inspect", url))


def test_access_denied_is_said(tmp_path: Path, s3_server: Any, run_cli: Any) -> None:
    bucket = s3_server.make_bucket()
    s3_server.put(bucket, "m.pt", big_zip(tmp_path))
    s3_server.faults.fail(f"/{bucket}/*", 403, times=None)
    assert "access denied" in one_error(*run_cli("inspect", f"s3://{bucket}/m.pt"))


def test_a_private_repo_needs_the_token(tmp_path: Path, fake_hub: Any, run_cli: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    fake_hub.add_repo("org/private", folder, token="hf_secret")
    err = one_error(*run_cli("inspect", "hf://org/private"))
    assert "private" in err and "hf_secret" not in err
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    stores.drop()
    remote.forget()
    code, _out, err = run_cli("inspect", "--json", "hf://org/private")
    assert code == 0, err


def test_a_truncated_response_is_said(tmp_path: Path, http_server: Any, run_cli: Any) -> None:
    url = http_server.put("m.pt", big_zip(tmp_path))
    http_server.faults.truncate("/m.pt", keep=100, times=None, method="GET")
    err = one_error(*run_cli("inspect", url))
    assert "m.pt" in err


def test_a_file_replaced_while_read_is_refused_over_https(tmp_path: Path, http_server: Any,
                                                          run_cli: Any) -> None:
    data = big_zip(tmp_path)
    url = http_server.put("m.pt", data)
    http_server.replace_after("m.pt", data[::-1], requests=2)  # after the HEAD and one range
    err = one_error(*run_cli("inspect", url))
    assert "changed while ckptool read it" in err


def test_an_object_replaced_while_read_is_refused_on_s3(tmp_path: Path, s3_server: Any,
                                                        run_cli: Any) -> None:
    data = big_zip(tmp_path)
    bucket = s3_server.make_bucket()
    s3_server.put(bucket, "m.pt", data)
    s3_server.faults.after(f"/{bucket}/m.pt", lambda: s3_server.put(bucket, "m.pt", data[::-1]),
                           requests=1, method="GET")
    err = one_error(*run_cli("inspect", f"s3://{bucket}/m.pt"))
    assert "changed while ckptool read it" in err


def test_a_hub_revision_reads_that_commit(tmp_path: Path, fake_hub: Any, run_cli: Any) -> None:
    import json

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    torch.save({"w": torch.ones(2)}, old / "pytorch_model.bin")
    torch.save({"w": torch.ones(3), "b": torch.ones(1)}, new / "pytorch_model.bin")
    first = fake_hub.add_repo("org/model", old)
    fake_hub.add_commit("org/model", new)
    _, out, err = run_cli("inspect", "--json", f"hf://org/model@{first}")
    assert json.loads(out)["num_tensors"] == 1, err
    remote.forget()
    _, out, err = run_cli("inspect", "--json", "hf://org/model")
    assert json.loads(out)["num_tensors"] == 2, err


def test_a_missing_library_names_its_extra(monkeypatch: pytest.MonkeyPatch,
                                           run_cli: Any) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs fails
    err = one_error(*run_cli("inspect", "s3://bucket/model.pt"), expected_code=2)
    assert "needs s3fs" in err and "pip install 'ckptool[s3]'" in err


def test_a_scheme_ckptool_does_not_read_is_a_usage_error(run_cli: Any) -> None:
    err = one_error(*run_cli("inspect", "ftp://host/model.pt"), expected_code=2)
    assert "ftp:// is not a scheme ckptool reads" in err


def test_a_url_is_never_fixed_in_place(http_server: Any, run_cli: Any, tmp_path: Path) -> None:
    url = http_server.put("m.pt", big_zip(tmp_path))
    err = one_error(*run_cli("fix", url, "--strip-module", "--in-place"), expected_code=2)
    assert "does not change it in place" in err and "m.fixed.pt" in err


def test_a_damaged_remote_record_writes_nothing(tmp_path: Path, http_server: Any, run_cli: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import zipfile

    data = bytearray(big_zip(tmp_path))
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/3"))
    data[info.header_offset + 30 + len(info.filename) + 64 + 1000] ^= 0xFF  # in its bytes
    url = http_server.put("m.pt", bytes(data))
    monkeypatch.chdir(tmp_path)
    err = one_error(*run_cli("convert", url, "out.safetensors"))
    assert "does not match the CRC" in err
    err = one_error(*run_cli("fix", url, "--strip-module", "-o", "fixed.pt"))
    assert "CRC" in err
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "fixed.pt").exists()


@pytest.mark.parametrize("args", [
    ["convert", "IN", "s3://bucket/out.safetensors"],
    ["convert", "IN", "o.safetensors", "--manifest", "gs://bucket/m.json"],
    ["fix", "IN", "--strip-module", "-o", "https://host/out.pth"],
    ["fix", "IN", "--strip-module", "-o", "hf://org/model/out.pth"]])
def test_outputs_are_local_files(args: list[str], run_cli: Any, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    source = str(SAMPLES / "dataparallel_cuda2.pth")
    err = one_error(*run_cli(*[source if a == "IN" else a for a in args]), expected_code=2)
    assert "ckptool writes local files" in err and "upload" in err
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_stops_answering_is_said_after_the_timeout(
        tmp_path: Path, http_server: Any, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    url = http_server.put("m.pt", big_zip(tmp_path))
    http_server.faults.delay("/m.pt", 2.0, method="GET")
    monkeypatch.setenv("CKPTOOL_REMOTE_TIMEOUT", "0.2")
    started = time.monotonic()
    err = one_error(*run_cli("inspect", url))
    assert "no answer" in err and "4 attempts" in err
    assert time.monotonic() - started < 2.0 * 4  # never a whole delay per attempt


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_timeout_that_is_no_time_is_a_usage_error(value: str, http_server: Any, run_cli: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTOOL_REMOTE_TIMEOUT", value)
    err = one_error(*run_cli("inspect", http_server.url_for("m.pt")), expected_code=2)
    assert "CKPTOOL_REMOTE_TIMEOUT" in err


def test_a_hub_that_cannot_be_reached_is_said(fake_hub: Any, run_cli: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    stores.drop()
    err = one_error(*run_cli("inspect", "hf://org/model"))
    assert "hf://org/model" in err and "no answer" in err
