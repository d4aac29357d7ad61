"""Targets of ``ckptool convert`` on many processes (``--workers N``, issue 27),
measured in one run.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_distributed.py [--quick] [--keep] [--runs N] [--source]
                                                [--workers 1,2,4]

Targets:

  (a) bytes read per rank: ``convert DCPDIR out.safetensors --workers N
      --json`` of the ~1 GiB DCP directory of bench_multifile.py (written by
      4 ranks under torchrun with ``dcp.save``, ``Shard(0)`` DTensors, 114
      tensors, largest 64 MiB), for each N of ``--workers``: every rank's
      ``bytes_read`` (from the report's ``distributed.per_rank``) is at most
      1/N of the tensor bytes + the largest tensor + the size of the
      ``.metadata`` file. ``bytes_read`` is ckptool's own count of the tensor
      bytes a rank copies or casts; the kernel's count of what each worker
      read (``rchar`` of ``/proc/self/io``, written by a ``sitecustomize``
      hook at the worker's exit) is printed beside it as a cross-check (no
      target: it also holds the worker's imports and headers). The outputs
      of every N are compared byte for byte (``cmp``). For N >= 2, rank 0's
      reads of other files than the input's (``rchar`` less the input's
      bytes it read by system calls; the hook counts those, the kernel's
      copies and the maps apart) are at most the other ranks' + the
      ``.metadata`` + 8 MiB: the plan's check, the index or zip directory and
      the final read of the output's records are all rank 0 does more.
  (b) time: a ~2 GiB float32 DCP directory (512 tensors of 4 MiB, one
      ``dcp.save`` process) converted into one bf16 safetensors file
      (``--dtype bf16``) by ``--workers 1``, ``--workers 2`` and ``--workers
      4`` (each timed around the whole command, launch included) and by the
      plain one-process ``convert`` (a reference line, no target): ``--workers
      2`` takes at most 0.75x the time of ``--workers 1`` (fastest runs). Every
      output must be byte-identical to the one-process output (``cmp``), or
      the target fails.
  (c) planning at scale: ``convert SYNTH out.safetensors --dry-run --workers
      1000 --json`` of a synthetic DCP directory of 1,000 ranks and 100,000
      tensors (each row-sharded into 8 chunks on 8 ranks' ``__R_0.distcp``)
      takes at most 10 s (whole command: the one absolute time, "seconds" as
      the issue states it). The ``.metadata`` is pickled from torch's own
      classes (``Metadata``, ``TensorStorageMetadata``,
      ``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``), as
      ``FileSystemWriter.finish`` pickles it; the 1,000 files are sparse (each
      holds the zip magic where its first chunk starts, then a hole up to its
      size). ``inspect --json`` must read it as a DCP checkpoint of 100,000
      tensors first. Then, in one process, ``prepare()`` (reading the metadata,
      ``open_checkpoint`` timed apart inside it) against ``make()`` (the plan)
      and ``rows()``; torch's own ``pickle.load`` of the ``.metadata`` is the
      baseline ratio. A failing (c) prints a cProfile of prepare() and make()
      on the --quick synthetic (100 ranks, 2,000 tensors: same hot spots).

Inputs are generated under ``bench/_work/`` (gitignored) by torch children,
reused by later runs, and deleted at the end if this run generated them,
unless ``--keep``. Each input is read once before its target (warm page
cache), and each timed command runs once untimed first; (b)'s commands then
alternate, in an order that rotates each round, ``--runs`` rounds (3), ratios
of the fastest runs (medians beside them); with ``--quick`` the first, checked
run of each is its only, timed run. The load
average is printed around each target: the machine may be shared. ckptool
runs as installed (a line says whether that copy matches the source tree),
or from the source tree with ``--source``. ``--quick`` (~128 MiB for (a),
~256 MiB for (b), 100 ranks x 2,000 tensors for (c)) is a smoke run: its
ratios are mostly start-up. Exit code 0 if every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_inspect import MB, PY, ROOT, RUN_DIR, WORK, Row, report
from bench_multifile import (
    Input,
    bench_arguments,
    remove,
    times,
    warm,
    which_ckptool,
)
from bench_multifile import ensure as ensure_input

SPEEDUP_MAX = 0.75  # (b): --workers 2 / --workers 1
PLAN_SECONDS = 10.0  # (c)
CAST_SHAPE = (1024, 1024)  # (b): float32, 4 MiB
SYNTH_CHUNKS = 8  # (c): chunks of each tensor, on as many ranks
SYNTH_ZIP = 1600  # (c): what torch.save wraps around a chunk's bytes, about
IO_ENV = "CKPTOOL_BENCH_IO"
IO_SRC = "CKPTOOL_BENCH_SRC"  # (a): the input, whose reads the hook counts apart
RANK0_EXTRA = 8 * MB  # (a): rank 0's other reads over the other ranks', beyond .metadata

# written into bench/_work/dist_iohook/ and put first on (a)'s PYTHONPATH:
# each worker (RANK set) writes its /proc/self/io when it exits, and what it
# read of the input's files (IO_SRC) by each way: system calls into its own
# memory (which rchar counts), the kernel's copies (copy_file_range,
# sendfile: rchar does not count them) and maps (mmap: nor those), so that
# rchar less the first is what the rank read of other files (imports, the
# .metadata, the output's headers and records for the final checks)
SITECUSTOMIZE = f"""\
import atexit, mmap, os
_dir = os.environ.get("{IO_ENV}")
_src = os.environ.get("{IO_SRC}")
if _dir and _src and "RANK" in os.environ:
    _count = {{"syscall": 0, "kernel": 0, "mapped": 0}}
    def _is_src(fd):
        try:
            return os.readlink(f"/proc/self/fd/{{fd}}").startswith(_src)
        except (OSError, TypeError):
            return False
    def _wrap(name, kind, size, at=0):
        real = getattr(os, name, None)
        if real is None:
            return
        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            if _is_src(args[at]):
                _count[kind] += size(out)
            return out
        setattr(os, name, wrapped)
    _wrap("read", "syscall", len)
    _wrap("pread", "syscall", len)
    _wrap("preadv", "syscall", int)
    _wrap("readv", "syscall", int)
    _wrap("copy_file_range", "kernel", int)
    _wrap("sendfile", "kernel", int, at=1)
    class _Mapped(mmap.mmap):
        def __new__(cls, fileno, length, *args, **kwargs):
            m = super().__new__(cls, fileno, length, *args, **kwargs)
            if _is_src(fileno):
                _count["mapped"] += len(m)
            return m
    mmap.mmap = _Mapped
    def _io():
        with open("/proc/self/io") as f:
            text = f.read()
        text += "".join(f"src_{{k}}: {{v}}\\n" for k, v in _count.items())
        with open(os.path.join(_dir, "rank" + os.environ["RANK"]), "w") as f:
            f.write(text)
    atexit.register(_io)
"""

# (c) in one process: prepare() (open_checkpoint timed inside it), make(), rows()
SPLIT = """\
import json, sys, time
t0 = time.perf_counter()
import ckptool.write.convert.job as job_module
from ckptool.write.distributed.plan import make
t1 = time.perf_counter()
src, dst, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
opened = []
read = job_module.open_checkpoint
def timed(*args, **kwargs):
    start = time.perf_counter()
    out = read(*args, **kwargs)
    opened.append(time.perf_counter() - start)
    return out
job_module.open_checkpoint = timed
profile = len(sys.argv) > 4
if profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t2 = time.perf_counter()
job = job_module.prepare(src, dst)
t3 = time.perf_counter()
plan = make(job, ranks)
t4 = time.perf_counter()
rows = plan.rows()
t5 = time.perf_counter()
if profile:
    import pstats
    prof.disable()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(int(sys.argv[4]))
print(json.dumps({"import": t1 - t0, "prepare": t3 - t2, "open_checkpoint": sum(opened),
                  "make": t4 - t3, "rows": t5 - t4, "tensors": len(plan.units),
                  "ranks": len(rows)}))
"""

# (c)'s baseline: torch's own read of the .metadata (FileSystemReader.read_metadata)
TORCH_METADATA = """\
import json, pickle, sys, time
t0 = time.perf_counter()
import torch.distributed.checkpoint
t1 = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    md = pickle.load(f)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "tensors": len(md.state_dict_metadata)}))
"""


# --- running a command ------------------------------------------------------------------------

@dataclass
class Done:
    """One child process: wall time, exit code, output, and the kernel's read
    counters of its whole tree (``/proc/self/io`` grows by a reaped child's,
    its reaped children's included)."""

    wall: float
    rc: int
    out: str
    err: str
    io: dict[str, int] = field(default_factory=dict)

    def json(self) -> dict[str, Any] | None:
        start = self.out.find("{")
        try:
            data = json.loads(self.out[start:]) if start >= 0 else None
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def said(self) -> str:
        return (self.err.strip() or self.out.strip())[-400:]


def self_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}


def run(cmd: list[str], env: dict[str, str] | None = None) -> Done:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        before = self_io()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=RUN_DIR, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=err, env=env)
        wall = time.perf_counter() - t0
        after = self_io()
        out.seek(0)
        err.seek(0)
        return Done(wall, proc.returncode, out.read(), err.read(),
                    {k: after[k] - before.get(k, 0) for k in after})


def convert_cmd(*args: str) -> list[str]:
    return [PY, "-m", "ckptool", "convert", *args]


def same_bytes(a: Path, b: Path) -> bool:
    return subprocess.run(["cmp", "-s", str(a), str(b)]).returncode == 0


def fastest(runs: list[Done]) -> float:
    return min(r.wall for r in runs)


def median(runs: list[Done]) -> float:
    return statistics.median(r.wall for r in runs)


def spread(runs: list[Done]) -> str:
    walls = [r.wall for r in runs]
    return f"median {median(runs):.2f} s ({min(walls):.2f}-{max(walls):.2f}, n={len(runs)})"


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def mib(n: float) -> str:
    return f"{n / MB:.1f}"


def nice(n: float) -> str:
    return f"{n / MB:.1f} MiB" if n >= MB else f"{n / 1024:.1f} KiB"


# --- the inputs -------------------------------------------------------------------------------

def share_input(quick: bool) -> Input:
    """(a): bench_multifile.py's DCP directory of 4 ranks."""
    cols = 128 if quick else 1024
    return Input(f"mf_dcp4r_c{cols}", "dcp4", cols)


def cast_tensors(quick: bool) -> int:
    return 64 if quick else 512


def cast_path(quick: bool) -> Path:
    return WORK / f"dist_cast_{cast_tensors(quick)}t"


def synth_size(quick: bool) -> tuple[int, int]:
    return (100, 2000) if quick else (1000, 100_000)


def synth_path(ranks: int, tensors: int) -> Path:
    return WORK / f"dist_synth_{ranks}r_{tensors}t"


def synth_shape(i: int) -> tuple[int, int]:
    """Tensor ``i`` of the synthetic checkpoint: 1024 rows (8 chunks of 128),
    64 to 512 columns: 256 KiB to 2 MiB of float32."""
    return 1024, 64 * (1 + i % 8)


def generate_cast(out: str, n: int) -> None:
    """(b)'s input: ``n`` float32 tensors of 4 MiB, one dcp.save process."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(CAST_SHAPE, generator=g) for i in range(n)}
    dcp.save(sd, checkpoint_id=out)


def generate_synth(out: str, ranks: int, tensors: int) -> None:
    """(c)'s input: the .metadata pickled from torch's own classes (as
    ``FileSystemWriter.finish`` pickles it), sparse ``__R_0.distcp`` files."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    os.makedirs(out)
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    ends, firsts = [0] * ranks, [-1] * ranks
    props = TensorProperties(dtype=torch.float32)
    for i in range(tensors):
        fqn = f"model.layers.{i // 10}.block{i % 10}.weight"
        rows, cols = synth_shape(i)
        step = rows // SYNTH_CHUNKS
        chunks = []
        for j in range(SYNTH_CHUNKS):
            rank = (i * SYNTH_CHUNKS + j) % ranks
            offsets = torch.Size([j * step, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([step, cols])))
            length = step * cols * 4 + SYNTH_ZIP
            storage[MetadataIndex(fqn, offsets, j)] = _StorageInfo(
                f"__{rank}_0.distcp", ends[rank], length)
            if firsts[rank] < 0:
                firsts[rank] = ends[rank]
            ends[rank] += length
        sdm[fqn] = TensorStorageMetadata(props, torch.Size([rows, cols]), chunks)
        planner[fqn] = (fqn,)
    md = Metadata(sdm, planner, storage, StorageMeta(checkpoint_id=out), "1.0.0")
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    for rank in range(ranks):
        with open(os.path.join(out, f"__{rank}_0.distcp"), "wb") as f:
            # ckptool checks that a file's first chunk starts a zip archive
            f.seek(max(firsts[rank], 0))
            f.write(b"PK\x03\x04")
            f.truncate(ends[rank])


def ensure(path: Path, *args: str) -> str:
    """Generate ``path`` (a directory, with ``--generate KIND``) unless it is there:
    the generator writes a ``.tmp`` directory and renames it when complete."""
    if path.is_dir():
        return "reused"
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    remove(tmp)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PY, __file__, "--generate", *args, str(tmp)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"generating {path} failed (exit code {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    tmp.rename(path)
    return "generated"


def tensor_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.distcp"))


# --- (a) bytes read per rank ------------------------------------------------------------------

def target_a(src: Input, workers: list[int], detail: list[str]) -> list[Row]:
    hook = WORK / "dist_iohook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    meta = (src.path / ".metadata").stat().st_size
    total, big = src.data_bytes, src.largest
    outs = {n: WORK / f"dist_share_w{n}.safetensors" for n in workers}
    detail += [f"(a) per rank: bytes_read is ckptool's count of the tensor bytes the rank "
               f"copies; target = 1/N of {nice(total)} + largest tensor {nice(big)} + "
               f".metadata {nice(meta)}; rchar is the kernel's count of every byte the "
               "worker read (imports, headers and the .metadata included), MiB:",
               "the input's bytes each rank read, by way: into its memory by system "
               "calls (syscall: rchar counts them), copied by the kernel (kernel: "
               "copy_file_range, which rchar does not count) or mapped (mapped: nor "
               "those); other = rchar - syscall, what it read of other files (imports, "
               ".metadata, the output's headers for the final checks), MiB:",
               f"  {'N':>2} {'rank':>4} {'tensors':>7} {'bytes_read':>10} {'1/N':>8} "
               f"{'target':>8} {'read/target':>11} {'rchar':>8} {'syscall':>8} "
               f"{'kernel':>8} {'mapped':>8} {'other':>8}"]
    rows = []
    try:
        for n in workers:
            for p in hook.glob("rank*"):
                p.unlink()
            env = {**os.environ, IO_ENV: str(hook), IO_SRC: os.path.realpath(src.path),
                   "PYTHONPATH": os.pathsep.join([str(hook),
                                                  *filter(None, [os.environ.get("PYTHONPATH")])])}
            remove(outs[n])
            done = run(convert_cmd(str(src.path), str(outs[n]), "--workers", str(n), "--json"),
                       env)
            rows += _share_row(n, done, hook, total, big, meta, detail)
        made = [n for n in workers if outs[n].exists()]
        differ = [f"--workers {n}" for n in made[1:] if not same_bytes(outs[made[0]], outs[n])]
        if len(made) > 1:
            rows.append(Row(f"(a) outputs of --workers {','.join(map(str, made))}",
                            "byte-identical (cmp)" if not differ else
                            f"{', '.join(differ)} differ from --workers {made[0]}",
                            ok=None if not differ else False))
    finally:
        for out in outs.values():
            remove(out)
    return rows


def _share_row(n: int, done: Done, hook: Path, total: int, big: int, meta: int,
               detail: list[str]) -> list[Row]:
    data = done.json()
    dist = data.get("distributed") if data else None
    case = f"(a) --workers {n}: every rank's bytes_read"
    limit = total / n + big + meta
    if done.rc != 0 or not isinstance(dist, dict):
        return [Row(case, "not measured", "", "<= 1/N + largest + .metadata", False,
                    [f"convert --workers {n} failed (exit code {done.rc}): {done.said()}"])]
    per_rank = sorted(dist["per_rank"], key=lambda r: r["rank"])
    counted: dict[int, dict[str, int]] = {}
    for p in hook.glob("rank*"):
        counted[int(p.name.removeprefix("rank"))] = {
            k.strip(): int(v) for k, v in (line.split(":") for line in
                                           p.read_text().splitlines() if ":" in line)}
    worst = 0.0
    other: dict[int, int] = {}
    for r in per_rank:
        read = int(r["bytes_read"])
        worst = max(worst, read / limit)
        c = counted.get(int(r["rank"]))
        cols = "-"
        if c is not None:
            other[int(r["rank"])] = c["rchar"] - c["src_syscall"]
            cols = (f"{mib(c['rchar']):>8} {mib(c['src_syscall']):>8} "
                    f"{mib(c['src_kernel']):>8} {mib(c['src_mapped']):>8} "
                    f"{mib(other[int(r['rank'])]):>8}")
        detail.append(
            f"  {n:>2} {r['rank']:>4} {r['tensors']:>7} {mib(read):>10} {mib(total / n):>8} "
            f"{mib(limit):>8} {read / limit:>10.2f}x {cols}")
    launcher = done.io.get("rchar", 0) - sum(c["rchar"] for c in counted.values())
    detail.append(f"  {n:>2} the --workers process itself (the launcher): rchar {mib(launcher)} "
                  f"(its tree's rchar {mib(done.io.get('rchar', 0))} less its workers')")
    reads = [int(r["bytes_read"]) for r in per_rank]
    notes = [f"{len(per_rank)} rank{'s' if n > 1 else ''} read {nice(sum(reads))} of tensor "
             "bytes in all "
             f"({'each tensor once' if sum(reads) == total else 'expected ' + nice(total)}); "
             f"largest share {nice(max(reads))}, 1/N {nice(int(total / n))}",
             f"wall {done.wall:.2f} s"]
    missing = [r["rank"] for r in per_rank if int(r["rank"]) not in counted]
    if missing:
        notes.append(f"no kernel counters from ranks {missing} (the exit hook did not run)")
    rows = [Row(case, f"max {nice(max(reads))}", f"{worst:.2f}x of target",
                "<= 1/N + largest + .metadata", worst <= 1.0 and sum(reads) == total, notes)]
    if n > 1 and 0 in other and len(other) == n:
        # rank 0 alone checks the plans, writes what needs every rank's part
        # and reads the output's records back: bounded by the other ranks'
        # own reads (imports, the plan's .metadata) + the .metadata + 8 MiB
        others = max(v for r, v in other.items() if r != 0)
        bound = others + meta + RANK0_EXTRA
        rows.append(Row(f"(a) --workers {n}: rank 0's reads beyond its share",
                        f"{nice(other[0])} (others at most {nice(others)})",
                        f"+{nice(max(0, other[0] - others))}",
                        "<= others + .metadata + 8 MiB", other[0] <= bound,
                        ["rchar less the input bytes read by system calls: imports, the "
                         ".metadata, the plan's check, the output's headers read back"]))
    return rows


# --- (b) time ---------------------------------------------------------------------------------

def target_b(src: Path, workers: list[int], rounds: int) -> list[Row]:
    outs = {"plain": WORK / "dist_cast_plain.safetensors",
            **{f"w{n}": WORK / f"dist_cast_w{n}.safetensors" for n in workers}}
    cmds = {name: convert_cmd(str(src), str(out), "--dtype", "bf16", "--json",
                              *([] if name == "plain" else ["--workers", name[1:]]))
            for name, out in outs.items()}
    rows: list[Row] = []
    try:
        first = {}
        for name, cmd in cmds.items():  # untimed: warms, and makes the outputs to compare
            remove(outs[name])
            first[name] = run(cmd)
        failed = {n: d for n, d in first.items() if d.rc != 0}
        if failed:
            return [Row(f"(b) {label(n)}", "not timed", "", "", False,
                        [f"exit code {d.rc}: {d.said()}"]) for n, d in failed.items()]
        differ = [label(n) for n in outs if n != "plain"
                  and not same_bytes(outs["plain"], outs[n])]
        out_size = outs["plain"].stat().st_size
    finally:
        for out in outs.values():
            remove(out)
    names = list(cmds)
    runs: dict[str, list[Done]] = {name: [] if rounds else [first[name]] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            runs[name].append(run(cmds[name]))
            remove(outs[name])
    base = runs.get("w1")
    for name in names:
        rs = runs[name]
        bad = [r for r in rs if r.rc != 0]
        notes = [f"a timed run failed (exit code {bad[0].rc}): {bad[0].said()}"] if bad else []
        slowest = [max(float(p["seconds"]) for p in dist["per_rank"])
                   for dist in (rank_report(r) for r in rs) if dist]
        if slowest:
            inside = statistics.median(slowest)
            notes.append(f"slowest rank's own seconds (plan, read, cast, write, verify its "
                         f"share): median {inside:.2f} s; the rest (launch, join, commit, "
                         f"exit): {median(rs) - inside:.2f} s")
        ratio = f"{fastest(rs) / fastest(base):.2f}x w1" if base and name != "w1" else ""
        rows.append(Row(label(name), spread(rs), ratio, notes=notes))
    same = (f"every output byte-identical to the one-process output ({nice(out_size)}, cmp)"
            if not differ else f"DIFFER from the one-process output: {', '.join(differ)}")
    if "w1" in runs and "w2" in runs:
        w1, w2 = runs["w1"], runs["w2"]
        speed = fastest(w2) / fastest(w1)
        ok = not differ and not any(r.rc for rs in runs.values() for r in rs)
        rows.append(Row("(b) --workers 2 / --workers 1",
                        f"fastest runs; medians give {median(w2) / median(w1):.2f}x",
                        times(speed, SPEEDUP_MAX), f"<= {SPEEDUP_MAX:g}x",
                        ok and speed <= SPEEDUP_MAX, [same]))
    else:
        rows.append(Row("(b) outputs", same, ok=None if not differ else False))
    return rows


def label(name: str) -> str:
    return "convert (one process, no --workers)" if name == "plain" else \
        f"convert --workers {name[1:]}"


def rank_report(done: Done) -> dict[str, Any] | None:
    data = done.json()
    dist = data.get("distributed") if data else None
    return dist if isinstance(dist, dict) else None


# --- (c) planning at scale --------------------------------------------------------------------

def target_c(src: Path, ranks: int, tensors: int, detail: list[str]) -> list[Row]:
    out = WORK / "dist_synth_out.safetensors"
    meta = src / ".metadata"
    rows = []
    insp = run([PY, "-m", "ckptool", "inspect", "--json", str(src)])
    head = insp.out[:4000]  # the summary fields come before the tensors' list
    fmt = re.search(r'"format": "([^"]*)"', head)
    count = re.search(r'"num_tensors": (\d+)', head)
    seen = (fmt.group(1) if fmt else None, int(count.group(1)) if count else None)
    read_ok = insp.rc == 0 and seen == ("dcp", tensors)
    rows.append(Row(f"inspect --json SYNTH ({ranks} ranks, {tensors:,} tensors)",
                    f"{insp.wall:.2f} s", "", f"dcp, {tensors:,} tensors", read_ok,
                    [f"read as {seen[0]} of {seen[1]} tensors; .metadata "
                     f"{nice(meta.stat().st_size)}, {ranks} sparse .distcp files of "
                     f"{nice(tensor_bytes(src))} in all"]
                    + ([f"exit code {insp.rc}: {insp.said()}"] if insp.rc else [])))
    torch = run([PY, "-c", TORCH_METADATA, str(meta)])
    tdata = torch.json() or {}
    dry = run(convert_cmd(str(src), str(out), "--dry-run", "--workers", str(ranks), "--json"))
    data = dry.json() or {}
    plan: list[dict[str, Any]] = data.get("plan") or []
    notes = []
    planned = dry.rc == 0 and data.get("tensors") == tensors and len(plan) == ranks
    if not planned:
        notes.append(f"unexpected plan (exit code {dry.rc}, tensors {data.get('tensors')}, "
                     f"{len(plan)} ranks): {dry.said()}")
    else:
        total = int(data["tensor_bytes"])
        big = max(synth_shape(i)[0] * synth_shape(i)[1] * 4 for i in range(8))
        worst = max(int(r["bytes_read"]) for r in plan)
        notes.append(f"plan of {nice(total)}: largest share {nice(worst)}, "
                     f"{worst / (total / ranks + big):.2f}x of 1/{ranks} + largest tensor")
    if "load" in tdata:
        notes.append(f"torch's pickle.load of the .metadata: {float(tdata['load']):.2f} s "
                     f"(after import torch.distributed.checkpoint, {float(tdata['import']):.2f} s)")
    ok = planned and dry.wall <= PLAN_SECONDS
    rows.append(Row(f"(c) convert --dry-run --workers {ranks} --json", f"{dry.wall:.2f} s",
                    f"{dry.wall / float(tdata['load']):.1f}x torch's read"
                    if planned and "load" in tdata else "", f"<= {PLAN_SECONDS:g} s",
                    ok and read_ok, notes))
    split = run([PY, "-c", SPLIT, str(src), str(out), str(ranks)])
    sd = split.json()
    if split.rc == 0 and sd:
        prep, opened = float(sd["prepare"]), float(sd["open_checkpoint"])
        rows.append(Row("  in one process: prepare() / make() / rows()",
                        f"{prep:.2f} s / {float(sd['make']):.2f} s / {float(sd['rows']):.2f} s",
                        notes=[f"prepare(): open_checkpoint (reading the .metadata) {opened:.2f} s"
                               f", the rest (convert's plan of the output) {prep - opened:.2f} s; "
                               f"imports {float(sd['import']):.2f} s"]))
    else:
        rows.append(Row("  in one process: prepare() / make()", "not measured", ok=False,
                        notes=[f"exit code {split.rc}: {split.said()}"]))
    if planned and not ok:
        detail += profile_quick()
    return rows


def profile_quick(n: int = 15) -> list[str]:
    """Where prepare() and make() spend their time (cProfile, own time), on the
    --quick synthetic checkpoint: the same work per chunk, a 50th of the chunks."""
    ranks, tensors = synth_size(True)
    path = synth_path(ranks, tensors)
    made = ensure(path, "synth", str(ranks), str(tensors))
    try:
        done = run([PY, "-c", SPLIT, str(path), str(WORK / "dist_synth_out.safetensors"),
                    str(ranks), str(n)])
    finally:
        if made == "generated":
            remove(path)
    lines = done.err.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return [f"(c) where prepare() and make() spend their time on {ranks} ranks x {tensors:,} "
            "tensors (cProfile, own time; profiled, so slower):",
            *("  " + line for line in lines[start:start + n + 1])]


# --- main -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "(a) ~128 MiB, (b) ~256 MiB and one run of each, (c) 100 "
                         "ranks x 2,000 tensors: a smoke run",
                         "keep the generated inputs in bench/_work", "timed runs of each (b) "
                         "command after its checked run (3; --quick: the checked run only)")
    ap.add_argument("--workers", default="1,2,4",
                    help="worker counts of (a) and (b), comma-separated (default 1,2,4)")
    ap.add_argument("--generate", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.generate:
        kind, *rest = args.generate
        if kind == "cast":
            generate_cast(rest[1], int(rest[0]))
        else:
            generate_synth(rest[2], int(rest[0]), int(rest[1]))
        return 0
    workers = sorted({int(w) for w in args.workers.split(",")})
    rounds = args.runs or (0 if args.quick else 3)
    t0 = time.perf_counter()
    share = share_input(args.quick)
    cast = cast_path(args.quick)
    ranks, tensors = synth_size(args.quick)
    synth = synth_path(ranks, tensors)
    made = {share.path: ensure_input(share, args.quick),
            cast: ensure(cast, "cast", str(cast_tensors(args.quick))),
            synth: ensure(synth, "synth", str(ranks), str(tensors))}
    log = [f"{share.path.relative_to(ROOT)}: {share.size() / MB:.1f} MiB, 4 ranks' dcp.save, "
           f"{len(share.layout)} tensors, largest {nice(share.largest)} ({made[share.path]})",
           f"{cast.relative_to(ROOT)}: {tensor_bytes(cast) / MB:.1f} MiB, one dcp.save, "
           f"{cast_tensors(args.quick)} float32 tensors of "
           f"{nice(4 * CAST_SHAPE[0] * CAST_SHAPE[1])} ({made[cast]})",
           f"{synth.relative_to(ROOT)}: synthetic, {ranks} ranks, {tensors:,} tensors in "
           f"{SYNTH_CHUNKS} chunks each ({made[synth]})",
           which_ckptool(args.source, "dist_source")]
    detail: list[str] = []
    rows: list[Row] = []
    try:
        for name, path, target in (
                ("(a)", share.path, lambda: target_a(share, workers, detail)),
                ("(b)", cast, lambda: target_b(cast, workers, rounds)),
                ("(c)", synth, lambda: target_c(synth, ranks, tensors, detail))):
            warm(path / ".metadata" if name == "(c)" else path)
            log.append(f"{name}: {load()} before")
            try:
                rows += target()
            except Exception as exc:  # reported as that target's failure
                rows.append(Row(f"{name} not measured", "the bench broke", "", "", False,
                                [f"{type(exc).__name__}: {exc}"]))
        log.append(f"{load()} at the end")
    finally:
        for name in ("dist_source", "dist_iohook"):
            remove(WORK / name)
    timing = ("(b)'s commands run once untimed (outputs compared), then alternate, each "
              f"output deleted after its run: {rounds} timed runs each, ratios of the fastest "
              "(medians beside)" if rounds else
              "(b): one run of each, outputs compared, then deleted")
    notes = [f"warm page cache: each input read once first (for (c) its .metadata); {timing}",
             "bytes_read in (a) is ckptool's own count, rchar the kernel's"]
    code = report(rows, log, detail, notes, args.quick, t0, [])
    if not args.keep:
        for path, how in made.items():
            if how == "generated":
                remove(path)
    return code


if __name__ == "__main__":
    sys.exit(main())
