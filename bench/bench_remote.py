"""Remote checkpoints (issue 36): what ``inspect`` reads of a sharded model in
a bucket, and ``convert`` from the bucket against download + local convert.

Run with the project's interpreter from the repository root, after
``make .venv/.installed`` (the installed ``ckptool`` runs, as a user runs it)::

    .venv/bin/python bench/bench_remote.py [--quick] [--keep]

The input is a ~1 GiB model of 8 safetensors shards and an index, written by
``huggingface_hub.save_torch_state_dict`` (``--quick``: ~64 MiB), uploaded
to moto's S3 server on 127.0.0.1 (``tests/fake_s3.py``, the suite's own),
which counts every request it answers. Targets:

  (a) ``inspect s3://bucket/model`` makes at most N + 2 requests for N shards
      (the listing, the index, one range per shard header: ``config.json``
      is read too where there is one, and this model has none);
  (b) ... and reads at most the header + 64 KiB of each shard (the first
      range is a speculative 64 KiB), plus the index;
  (c) ``convert s3://bucket/model out.safetensors`` (each byte read once, one
      record in memory) against the baseline a user has today: download
      every file (boto3's ``download_file``, as ``aws s3 cp`` does), then
      ``ckptool convert`` the local copy. Reported, no target: moto, a
      Python server on this machine, is the bottleneck of both sides, so the
      ratio says little about a real store. Its bytes read are checked: at
      most 1.02x the model.

Exit code 0 if every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_inspect import PY, ROOT, WORK, Row, report

sys.path.insert(0, str(ROOT / "tests"))
from fake_s3 import S3Server

CKPTOOL = str(Path(PY).with_name("ckptool"))
SHARDS = 8
GENERATE = """\
import sys, torch
from huggingface_hub import save_torch_state_dict
dim, layers, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
sd = {f"model.layers.{i}.mlp.weight": torch.randn(dim, dim, generator=g) for i in range(layers)}
save_torch_state_dict(sd, out, max_shard_size=sum(t.nbytes for t in sd.values()) // 8 + 4096)
"""


def model(quick: bool) -> Path:
    """The sharded model (generated in a child: the bench never imports torch)."""
    dim, layers = (1024, 16) if quick else (4096, 16)  # 64 MiB or 1 GiB of float32
    path = WORK / f"remote_model_{dim}x{layers}"
    if not (path / "model.safetensors.index.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        subprocess.run([PY, "-c", GENERATE, str(dim), str(layers), str(path)], check=True)
    return path


def upload(server: S3Server, folder: Path) -> tuple[str, int, list[str]]:
    bucket = server.make_bucket()
    names = sorted(p.name for p in folder.iterdir())
    for name in names:  # boto3's own upload (multipart for large files), as aws s3 cp
        server.client.upload_file(str(folder / name), bucket, f"model/{name}")
    size = sum((folder / n).stat().st_size for n in names)
    return f"s3://{bucket}/model", size, names


def run(args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, done.stdout


def header_sizes(folder: Path) -> dict[str, int]:
    """Each safetensors shard's header, with its 8-byte length."""
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        with p.open("rb") as f:
            out[p.name] = 8 + int.from_bytes(f.read(8), "little")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~64 MiB model: a smoke run")
    ap.add_argument("--keep", action="store_true", help="keep the generated model in bench/_work")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    folder = model(args.quick)
    headers = header_sizes(folder)
    server = S3Server()
    env = {**os.environ, **server.env()}
    out = WORK / "remote_out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rows: list[Row] = []
    log: list[str] = []
    try:
        t0 = time.perf_counter()
        url, size, names = upload(server, folder)
        log.append(f"uploaded {len(names)} files, {size / 2**20:.0f} MiB, to moto's S3 in "
                   f"{time.perf_counter() - t0:.1f} s")
        # (a), (b): inspect
        server.log.clear()
        wall, text = run([CKPTOOL, "inspect", "--json", url], env, out)
        said = json.loads(text)["remote"]
        served = server.log.entries
        n = len(headers)
        rows.append(Row("(a) inspect: requests", f"{len(served)} ({wall:.2f} s)",
                        f"N + {len(served) - n} for N = {n}", "<= N + 2", len(served) <= n + 2,
                        [f"ckptool counted {said['requests']} requests, "
                         f"{said['listings']} of them listings"]))
        index = (folder / "model.safetensors.index.json").stat().st_size
        allowed = index + sum(max(h, 65536) for h in headers.values())
        objects = [r for r in served if r.path.startswith(f"/{url.split('/')[2]}/model/")]
        sent = sum(r.sent for r in objects)  # (the listing's XML apart)
        rows.append(Row("(b) inspect: bytes read", f"{sent / 1024:.0f} KiB of "
                        f"{size / 2**20:.0f} MiB", f"{sent / allowed:.2f}x allowed",
                        "<= headers (64 KiB at least) + index", sent <= allowed,
                        [f"largest header {max(headers.values())} B; the listing's XML "
                         f"{sum(r.sent for r in served) - sent} B more"]))
        # (c): convert from the bucket against download + convert
        server.log.clear()
        remote_wall, _ = run([CKPTOOL, "convert", url, str(out / "remote.safetensors")], env, out)
        read = sum(r.sent for r in server.log.entries)
        requests = len(server.log.entries)
        local = out / "download"
        t0 = time.perf_counter()
        local.mkdir()
        bucket = url.split("/")[2]
        for name in names:
            server.client.download_file(bucket, f"model/{name}", str(local / name))
        download = time.perf_counter() - t0
        convert_wall, _ = run([CKPTOOL, "convert", str(local), str(out / "local.safetensors")],
                              env, out)
        same = (out / "remote.safetensors").read_bytes() == (out / "local.safetensors").read_bytes()
        baseline = download + convert_wall
        rows.append(Row("convert s3:// -> local", f"{remote_wall:.2f} s",
                        f"{remote_wall / baseline:.2f}x download + convert", "", None,
                        [f"download {download:.2f} s + convert {convert_wall:.2f} s = "
                         f"{baseline:.2f} s; the outputs are "
                         + ("identical" if same else "DIFFERENT")]))
        rows.append(Row("(c) convert: bytes read", f"{read / 2**20:.1f} MiB of "
                        f"{size / 2**20:.1f} MiB", f"{read / size:.3f}x", "<= 1.02x",
                        read <= 1.02 * size and same,
                        [f"{requests} requests"]))
    finally:
        server.close()
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return report(rows, log, [], ["moto's S3 server on 127.0.0.1 (tests/fake_s3.py)"],
                  args.quick, started, [])


if __name__ == "__main__":
    sys.exit(main())
