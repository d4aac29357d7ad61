"""A checkpoint behind a URL reads as its local copy does: ``inspect
--json`` and ``diagnose --json`` give the same report (but for the path and
the request counts) over HTTP, from S3 and from the Hub, for one file of
each format, sharded Hugging Face folders, DCP and DeepSpeed directories;
``ckptool.load`` gives the same tensors; the safety verdict is the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool.read import remote

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
ONE_FILE = ["dataparallel_cuda2.pth", "finetuned_v2.pth", "hostile_runs_code.pth",
            "legacy_compiled_ddp.pth", "lightning.ckpt", "tinynet.safetensors",
            "tinynet_script.pt", "whole_model_cuda1.pth"]
FOLDERS = ["dcp_tinynet", "deepspeed_zero3"]


pytestmark = pytest.mark.usefixtures("fresh_remote")


def report(run_cli: Any, command: str, path: str) -> dict[str, Any]:
    code, out, err = run_cli(command, "--json", path)
    assert code in (0, 1), err
    data = json.loads(out)
    return {"code": code, **data}


def same_but_path(remote_report: dict[str, Any], local_report: dict[str, Any], url: str,
                  local: str) -> None:
    remote_report.pop("remote", None)
    if "fix_command" in remote_report:  # diagnose: fix writes from a local copy only (yet)
        for data in (remote_report, local_report):
            for key in ("fix_command", "fix_output", "fix_refused", "remaining"):
                data.pop(key)
            for finding in data["findings"]:  # (and names the file it writes, in the cwd)
                finding.pop("fix", None)
                finding.pop("snippet", None)
    text = json.dumps(remote_report, sort_keys=True).replace(url.rstrip("/"), "<P>")
    expected = json.dumps(local_report, sort_keys=True).replace(local.rstrip("/"), "<P>")
    assert text == expected


@pytest.mark.parametrize("name", ONE_FILE)
def test_one_file_over_https_reads_as_the_local_file(name: str, http_server: Any,
                                                     run_cli: Any) -> None:
    url = http_server.put(name, (SAMPLES / name).read_bytes())
    for command in ("inspect", "diagnose"):
        same_but_path(report(run_cli, command, url), report(run_cli, command, str(SAMPLES / name)),
                      url, str(SAMPLES / name))


@pytest.mark.parametrize("name", ONE_FILE + FOLDERS)
def test_s3_reads_as_the_local_copy(name: str, s3_server: Any, run_cli: Any) -> None:
    bucket = s3_server.make_bucket()
    s3_server.upload(SAMPLES / name, bucket, f"runs/{name}" if (SAMPLES / name).is_dir()
                     else "runs")
    url = f"s3://{bucket}/runs/{name}"
    local = str(SAMPLES / name)
    for command in ("inspect", "diagnose"):
        same_but_path(report(run_cli, command, url), report(run_cli, command, local), url, local)


def test_a_torch_zip_takes_a_few_requests_and_no_tensor_bytes(tmp_path: Path, http_server: Any,
                                                              run_cli: Any) -> None:
    sd = {f"layer{i}.weight": torch.randn(256, 256) for i in range(40)}  # ~10 MB
    torch.save(sd, tmp_path / "m.pt")
    url = http_server.put("m.pt", (tmp_path / "m.pt").read_bytes())
    data = report(run_cli, "inspect", url)
    assert data["num_tensors"] == 40
    requests = http_server.log.entries
    # a HEAD, the first 64 KiB, the last 64 KiB (end records, directory), the pickle
    assert len(requests) <= 5, http_server.log.summary()
    assert sum(r.sent for r in requests) <= 4 * 65536
    # what ckptool counts is what it asked for (a retry the library makes on its
    # own, after a dropped keep-alive connection, is seen by the server alone)
    assert data["remote"]["requests"] <= len(requests)
    assert data["remote"]["bytes"] <= sum(r.sent for r in requests)


def test_a_safetensors_header_is_one_range(tmp_path: Path, http_server: Any,
                                           run_cli: Any) -> None:
    from safetensors.torch import save_file

    save_file({f"w{i}": torch.randn(128, 128) for i in range(50)}, tmp_path / "m.safetensors")
    url = http_server.put("m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    report(run_cli, "inspect", url)
    gets = http_server.log.select("GET")
    assert len(gets) == 1 and gets[0].range == "bytes=0-65535", http_server.log.summary()


def test_load_over_https_gives_torch_loads_tensors(tmp_path: Path, http_server: Any) -> None:
    sd = {f"l{i}": torch.randn(64, 64) for i in range(20)}
    torch.save(sd, tmp_path / "m.pt")
    url = http_server.put("m.pt", (tmp_path / "m.pt").read_bytes())
    got = ckptool.load(url)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    # each byte of the file read at most once
    assert sum(r.sent for r in http_server.log.entries) <= (tmp_path / "m.pt").stat().st_size


def test_hostile_file_gets_the_same_verdict_remotely(http_server: Any, run_cli: Any) -> None:
    url = http_server.put("x.pth", (SAMPLES / "hostile_runs_code.pth").read_bytes())
    data = report(run_cli, "inspect", url)
    assert data["unsafe_globals"]
    with pytest.raises(ckptool.CkptoolError, match="run code"):
        ckptool.load(url)


def hf_folder(tmp_path: Path, shards: int) -> tuple[Path, dict[str, torch.Tensor]]:
    from huggingface_hub import save_torch_state_dict

    sd = {f"model.layers.{i}.weight": torch.randn(64, 64) for i in range(shards * 2)}
    folder = tmp_path / "model"
    folder.mkdir()
    save_torch_state_dict(sd, folder, max_shard_size=2 * 64 * 64 * 4 + 100)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder, sd


def test_a_hub_model_of_n_shards_takes_n_plus_a_few_requests(tmp_path: Path, fake_hub: Any,
                                                             run_cli: Any) -> None:
    folder, _ = hf_folder(tmp_path, 4)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) == 4
    fake_hub.redirect_lfs = False
    fake_hub.add_repo("org/model", folder)
    url = "hf://org/model"
    data = report(run_cli, "inspect", url)
    same_but_path(data, report(run_cli, "inspect", str(folder)), url, str(folder))
    fake_hub.log.clear()
    remote.forget()
    report(run_cli, "inspect", url)
    reads = fake_hub.log.select("GET", "*/resolve/*")
    assert sorted(r.path.rsplit("/", 1)[-1] for r in reads) == sorted(
        [*shards, "model.safetensors.index.json", "config.json"]), fake_hub.log.summary()
    assert len(fake_hub.log.entries) <= len(shards) + 5, fake_hub.log.summary()


def local_and_remote_outputs(run_cli: Any, tmp_path: Path, args: list[str], url: str,
                             local: str, out: str) -> tuple[Path, Path]:
    """``args`` run on the local copy and on the URL (``IN``: the input,
    ``OUT``: the output), each into its own folder."""
    made = []
    for where, source in (("a", local), ("b", url)):  # (names of one length: DCP's
        # .metadata records the folder it was written to)
        folder = tmp_path / where
        folder.mkdir()
        code, _, err = run_cli(*[source if a == "IN" else str(folder / out) if a == "OUT" else a
                                 for a in args])
        assert code == 0, err
        made.append(folder / out)
    return made[0], made[1]


def same_files(a: Path, b: Path) -> None:
    if a.is_dir():
        names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
        assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
        for n in names:
            if n == ".metadata":  # DCP records the (unique) staging path it wrote to
                continue
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
        tensors = [[(t.key, t.shape, t.dtype, t.chunks) for t in ckptool.open(p).tensors]
                   for p in (a, b)]
        assert tensors[0] == tensors[1]
    else:
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize(("name", "out"), [
    ("dataparallel_cuda2.pth", "o.safetensors"), ("tinynet.safetensors", "o.pt"),
    ("legacy_compiled_ddp.pth", "o.safetensors"), ("dcp_tinynet", "o.safetensors"),
    ("deepspeed_zero3", "o.pt"), ("dcp_tinynet", "o_dcp")])
def test_convert_from_s3_writes_what_the_local_copy_gives(name: str, out: str, s3_server: Any,
                                                         run_cli: Any, tmp_path: Path) -> None:
    bucket = s3_server.make_bucket()
    s3_server.upload(SAMPLES / name, bucket, f"r/{name}" if (SAMPLES / name).is_dir() else "r")
    args = ["convert", "IN", "OUT", *(["--format", "dcp"] if out == "o_dcp" else [])]
    local, remote_out = local_and_remote_outputs(run_cli, tmp_path, args,
                                                 f"s3://{bucket}/r/{name}", str(SAMPLES / name),
                                                 out)
    same_files(local, remote_out)


def test_fix_from_https_writes_what_the_local_copy_gives(http_server: Any, run_cli: Any,
                                                        tmp_path: Path) -> None:
    name = "dataparallel_cuda2.pth"
    url = http_server.put(name, (SAMPLES / name).read_bytes())
    local, remote_out = local_and_remote_outputs(
        run_cli, tmp_path, ["fix", "IN", "--extract", "--strip-module", "--to", "cpu", "-o", "OUT"],
        url, str(SAMPLES / name), "fixed.pth")
    same_files(local, remote_out)


def test_convert_over_https_reads_each_byte_once_one_record_at_a_time(
        tmp_path: Path, http_server: Any, run_cli: Any) -> None:
    sd = {f"l{i}": torch.randn(512, 512) for i in range(8)}  # 1 MiB records
    torch.save(sd, tmp_path / "m.pt")
    size = (tmp_path / "m.pt").stat().st_size
    url = http_server.put("m.pt", (tmp_path / "m.pt").read_bytes())
    code, _, err = run_cli("convert", url, str(tmp_path / "o.safetensors"))
    assert code == 0, err
    from safetensors.torch import load_file

    got = load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    gets = http_server.log.select("GET")
    assert sum(r.sent for r in gets) <= size + 65536, http_server.log.summary()
    # no request asks for more than one record and what lies around it
    assert max(r.sent for r in gets) <= (1 << 20) + 65536 + 4096


def test_diagnose_of_a_url_gives_a_fix_that_runs_here(s3_server: Any, run_cli: Any,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex

    bucket = s3_server.make_bucket()
    s3_server.upload(SAMPLES / "dataparallel_cuda2.pth", bucket, "")
    monkeypatch.chdir(tmp_path)
    data = report(run_cli, "diagnose", f"s3://{bucket}/dataparallel_cuda2.pth")
    assert data["fix_output"] == "dataparallel_cuda2.fixed.pth"  # here, not beside the URL
    words = shlex.split(data["fix_command"])
    assert words[0] == "ckptool"
    code, _, err = run_cli(*words[1:])
    assert code == 0, err
    assert report(run_cli, "diagnose", data["fix_output"])["exit_code"] == 0


def test_workers_convert_from_s3_gives_the_bytes_of_one_process_each_reading_its_share(
        s3_server: Any, run_cli: Any, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    source = tmp_path / "step-500"
    torch.manual_seed(0)
    dcp.save({f"layer{i}.weight": torch.randn(256, 256) for i in range(16)},  # 4 MiB
             checkpoint_id=str(source))
    size = sum(p.stat().st_size for p in source.iterdir())
    bucket = s3_server.make_bucket()
    s3_server.upload(source, bucket, "run/step-500")
    url = f"s3://{bucket}/run/step-500"
    code, _, err = run_cli("convert", url, str(tmp_path / "one.safetensors"))
    assert code == 0, err
    s3_server.log.clear()
    done = subprocess.run([sys.executable, "-m", "ckptool", "convert", url,
                           str(tmp_path / "two.safetensors"), "--workers", "2"],
                          capture_output=True, text=True, env={**os.environ, **s3_server.env()},
                          timeout=300)
    assert done.returncode == 0, done.stderr
    one, two = (tmp_path / "one.safetensors"), (tmp_path / "two.safetensors")
    assert one.read_bytes() == two.read_bytes()
    # each rank read its own share of the tensors (and the .metadata every rank reads)
    metadata = (source / ".metadata").stat().st_size
    assert sum(e.sent for e in s3_server.log.entries) <= size + 2 * metadata + 4 * 65536


def test_the_hubs_sha256_and_scan_are_shown_beside_the_verdict(tmp_path: Path, fake_hub: Any,
                                                              run_cli: Any) -> None:
    import hashlib

    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(SAMPLES / "hostile_runs_code.pth", folder / "pytorch_model.bin")
    fake_hub.add_repo("org/model", folder)
    fake_hub.scans["org/model"] = {"scansDone": True, "filesWithIssues": [
        {"path": "pytorch_model.bin", "level": "unsafe"}]}
    data = report(run_cli, "inspect", "hf://org/model")
    assert data["unsafe_globals"]  # ckptool's own verdict
    digest = hashlib.sha256((folder / "pytorch_model.bin").read_bytes()).hexdigest()
    assert data["remote"]["sha256"] == {"pytorch_model.bin": digest}
    assert data["remote"]["hub_scan"]["filesWithIssues"][0]["path"] == "pytorch_model.bin"
    _code, out, _err = run_cli("inspect", "hf://org/model")
    assert f"sha256      {digest}  pytorch_model.bin (the Hub's)" in out
    assert "hub scan    1 file flagged: pytorch_model.bin (unsafe)" in out


def test_a_pickle_larger_than_what_is_kept_is_read_once(tmp_path: Path, http_server: Any,
                                                        run_cli: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.read.remote import rfile

    monkeypatch.setattr(rfile, "KEPT", 64 << 10)  # a pickle of ~400 kB read a few bytes at a time
    torch.save({f"layer.{i}.weight": torch.zeros(2) for i in range(5000)}, tmp_path / "m.pt",
               _use_new_zipfile_serialization=False)
    size = (tmp_path / "m.pt").stat().st_size
    url = http_server.put("m.pt", (tmp_path / "m.pt").read_bytes())
    local = str(tmp_path / "m.pt")
    same_but_path(report(run_cli, "inspect", url), report(run_cli, "inspect", local), url, local)
    gets = http_server.log.select("GET")
    assert sum(r.sent for r in gets) <= 2 * size, http_server.log.summary()[:20]
