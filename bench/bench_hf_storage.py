"""Targets of ``ckptool convert`` on torch's ``HuggingFaceStorageWriter``
output, against torch's own ``consolidate_safetensors_files``, as ratios
measured in one run.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_hf_storage.py [--quick] [--keep] [--runs N] [--source]

The input: ``torch.distributed.checkpoint.save(sd,
storage_writer=HuggingFaceStorageWriter(path=DIR, save_distributed=True))``
from 4 ranks (``torchrun``, gloo, ``init_device_mesh("cpu", (4,))``): one
``shard-0000R-model-00001-of-00001.safetensors`` per rank, whose
``__metadata__`` holds ``DCP_SHARDING_INFO``. The state dict: DTensors from
``distribute_tensor``, ``Shard(0)`` (even and uneven rows), ``Shard(1)``
(even and uneven columns) and ``Replicate()``, float32 and bf16 (no integer
tensors: torch 2.13's consolidation crashes on them), 114 tensors, ~1 GiB,
the largest 64 MiB; ``--quick``: ~128 MiB, the largest 8 MiB.

Targets:

  (a) ``ckptool convert DIR out.safetensors`` takes at most 1.0x the wall
      time of a ``python -c`` child calling torch's
      ``consolidate_safetensors_files(input_dir=DIR, output_dir=OUTDIR,
      fqn_to_index_mapping={fqn: 1 for every fqn}, num_threads=1)`` (one
      ``model-00001-of-00001.safetensors``; the fqns come from the shards'
      safetensors headers, read in that child), both whole processes;
  (b) the peak RSS of the convert process is at most the largest tensor +
      300 MB (both sides' peaks printed: ``os.wait4`` rusage of each child).

The first run of each command is untimed, and their outputs are compared
tensor for tensor (``torch.equal``, dtype) in a child process; a difference
fails both targets. Then the two alternate, ``--runs`` rounds (3; 2 with
``--quick``), each output deleted after its run; ratios are of the fastest
runs (medians beside them). The input is written under ``bench/_work/``
(gitignored) by a torch child (torchrun, ``OMP_NUM_THREADS=1``), reused by
later runs, deleted at the end unless ``--keep``. ``--source`` measures the
source tree rather than the installed ckptool. Exit code 0 if both targets
pass, 1 otherwise. No absolute time is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_inspect import MB, PY, ROOT, WORK, Row, best, check_rc, med, report, spread
from bench_multifile import (
    Commands,
    bench_arguments,
    child_check,
    ckptool_cmd,
    failure,
    first_runs,
    free_port,
    human,
    last_json,
    listing,
    mb,
    remove,
    timed_rounds,
    times,
    warm,
    which_ckptool,
)

RANKS = 4
CONVERT_TORCH_MAX = 1.0  # (a)
RSS_HEADROOM_MB = 300.0  # (b)
LAYERS = 22
OUT_ST = WORK / "hfs_out.safetensors"
OUT_TORCH = WORK / "hfs_out_torch"
TORCH_FILE = "model-00001-of-00001.safetensors"

Shape = tuple[int, ...]
# (name, shape, dtype, placement): "s0" Shard(0), "s1" Shard(1), "r" Replicate()
Entry = tuple[str, Shape, str, str]

# torch's own consolidation, a whole process; import and the call reported apart.
# The fqns are every tensor key in the shards' safetensors headers.
TORCH_HF = """\
import json, os, struct, sys, time, warnings
warnings.filterwarnings("ignore")
t0 = time.perf_counter()
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
)
t1 = time.perf_counter()
src, out = sys.argv[1], sys.argv[2]
fqns = set()
for name in sorted(os.listdir(src)):
    if name.endswith(".safetensors"):
        with open(os.path.join(src, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            fqns.update(k for k in json.loads(f.read(n)) if k != "__metadata__")
os.makedirs(out, exist_ok=True)
consolidate_safetensors_files(input_dir=src, output_dir=out,
                              fqn_to_index_mapping=dict.fromkeys(sorted(fqns), 1),
                              num_threads=1)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "consolidate": t2 - t1, "fqns": len(fqns)}))
"""

# the two outputs, tensor for tensor (torch.equal and dtype)
CHECK = """\
import json, sys
from safetensors.torch import load_file
import torch
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
differ = [k for k in a if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
print(json.dumps({"differ": differ[:5], "missing": sorted(set(a) - set(b))[:5],
                  "extra": sorted(set(b) - set(a))[:5], "tensors": len(a),
                  "dtypes": sorted({str(t.dtype) for t in b.values()})}))
"""


# --- the checkpoint ---------------------------------------------------------------------------

def layout(cols: int) -> list[Entry]:
    """Every size scales with ``cols`` (but one 6 KiB bias): cols=1024 gives
    ~1 GiB (1016 MiB) in 114 tensors, the largest 64 MiB; cols=128 ~127 MiB,
    the largest 8 MiB. Uneven over 4 ranks: 16383 rows (4096 x 3 + 4095),
    4094 rows (1024 x 3 + 1022), 3070 columns (768 x 3 + 766)."""
    out: list[Entry] = [("model.embed_tokens.weight", (16384, cols), "float32", "s0"),
                        ("model.pos_embed.weight", (2048, cols), "float32", "r")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "attn.qkv.weight", (3072, cols), "float32", "s0"),
                (p + "attn.qkv.bias", (3072,), "bfloat16", "r"),
                (p + "attn.o.weight", (cols, 3070), "float32", "s1"),
                (p + "mlp.up.weight", (4094, cols), "bfloat16", "s0"),
                (p + "mlp.down.weight", (cols, 4096), "bfloat16", "s1")]
    return [*out, ("model.norm.weight", (cols,), "float32", "r"),
            ("lm_head.weight", (16383, cols), "float32", "s0")]


def nbytes(shape: Shape, dtype: str) -> int:
    n = 4 if dtype == "float32" else 2
    for d in shape:
        n *= d
    return n


def width(quick: bool) -> int:
    return 128 if quick else 1024


def checkpoint(quick: bool) -> Path:
    return WORK / f"hfs_{RANKS}r_c{width(quick)}"


def data_bytes(cols: int) -> int:
    return sum(nbytes(s, d) for _, s, d, _ in layout(cols))


def largest(cols: int) -> int:
    return max(nbytes(s, d) for _, s, d, _ in layout(cols))


def looks_complete(path: Path, cols: int) -> bool:
    # the generator renames a finished .tmp into place; this checks the rest: one
    # file per rank, the tensor bytes (each replicated tensor written once) plus
    # the safetensors headers with their DCP_SHARDING_INFO
    if not path.is_dir():
        return False
    files = sorted(path.glob("shard-*-model-00001-of-00001.safetensors"))
    size = sum(p.stat().st_size for p in files)
    return len(files) == RANKS and data_bytes(cols) <= size <= data_bytes(cols) + 4 * MB


def worker(out: str, cols: int) -> None:
    """One rank (under torchrun): distribute_tensor of every tensor of the layout
    from rank 0's values, then dcp.save with a HuggingFaceStorageWriter."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place: dict[str, list[Placement]] = {"s0": [Shard(0)], "s1": [Shard(1)], "r": [Replicate()]}
    sd = {}
    for i, (key, shape, dtype, how) in enumerate(layout(cols)):
        # distribute_tensor scatters (or broadcasts) rank 0's values: the others
        # only need a tensor of the same shape and dtype
        if rank == 0:
            g = torch.Generator().manual_seed(i)
            full = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        else:
            full = torch.empty(shape, dtype=getattr(torch, dtype))
        sd[key] = distribute_tensor(full, mesh, place[how])
        del full
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path=out, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()


def ensure(quick: bool) -> str:
    path, cols = checkpoint(quick), width(quick)
    if looks_complete(path, cols):
        return "reused"
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    remove(tmp)
    # torchrun's banner and the writer's warnings are shown only if it fails
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           __file__, "--worker", str(tmp), str(cols)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"writing the checkpoint failed (exit code {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    remove(path)
    tmp.rename(path)  # a killed run never leaves a half directory to reuse
    if not looks_complete(path, cols):
        sys.exit(f"generated {path} is not as expected: {listing(path)}")
    return "generated"


# --- the target -------------------------------------------------------------------------------

def compare(expected: int) -> list[str]:
    """torch's output and ckptool's, in a child: a note that they are equal, or why not."""
    a, b = OUT_TORCH / TORCH_FILE, OUT_ST
    missing = [str(p.relative_to(ROOT)) for p in (a, b) if not p.is_file()]
    if missing:
        return [f"outputs differ: no {', '.join(missing)} to compare"]
    data = child_check(CHECK, str(a), str(b))
    if ("error" in data or data.get("differ") or data.get("missing") or data.get("extra")
            or data.get("tensors") != expected):
        return [f"outputs differ: convert's against consolidate_safetensors_files' "
                f"({expected} tensors expected): {data}"]
    kinds = data.get("dtypes")
    kinds = ", ".join(map(str, kinds)) if isinstance(kinds, list) else kinds
    return [f"output checked: {data['tensors']} tensors ({kinds}), each equal to "
            "consolidate_safetensors_files' (torch.equal, dtype)"]


def target(quick: bool, rounds: int) -> list[Row]:
    src, cols = checkpoint(quick), width(quick)
    big = largest(cols)
    commands: Commands = {
        "torch": ([PY, "-c", TORCH_HF, str(src), str(OUT_TORCH)], OUT_TORCH),
        "convert": (ckptool_cmd("convert", str(src), str(OUT_ST), "-q"), OUT_ST),
    }
    first, checked = first_runs(commands, lambda: compare(len(layout(cols))))
    broken = (failure(first["convert"], "convert")
              + failure(first["torch"], "consolidate_safetensors_files"))
    if broken:
        return [Row("(a) convert / consolidate_safetensors_files", "not timed", "",
                    f"<= {CONVERT_TORCH_MAX:g}x", False, broken)]
    same = not any(n.startswith("outputs differ") for n in checked)
    runs = timed_rounds(commands, rounds, capture=("torch",))
    th, cv = runs["torch"], runs["convert"]
    torch_problems = check_rc(th, "consolidate_safetensors_files")
    problems = check_rc(cv, "convert")
    torch_rss = max(mb(r.maxrss_kb) for r in th)
    rss = max(mb(r.maxrss_kb) for r in cv)
    rows = [Row("consolidate_safetensors_files subprocess", spread(th),
                notes=[*torch_problems, f"peak RSS {torch_rss:.0f} MB"])]
    inner = [d for d in map(last_json, th) if d]
    if inner:
        rows.append(Row("  inside it: import / the call",
                        " / ".join(f"{statistics.median(float(d[k]) for d in inner):.2f} s"
                                   for k in ("import", "consolidate"))))
    rows.append(Row("convert DIR out.safetensors", spread(cv),
                    notes=[*problems, *checked, f"peak RSS {rss:.0f} MB"]))
    ratio = best(cv) / best(th)
    rows.append(Row("(a) convert / consolidate_safetensors_files",
                    f"fastest runs; medians give {med(cv) / med(th):.2f}x",
                    times(ratio, CONVERT_TORCH_MAX), f"<= {CONVERT_TORCH_MAX:g}x",
                    same and not problems and not torch_problems
                    and ratio <= CONVERT_TORCH_MAX))
    limit = big / MB + RSS_HEADROOM_MB
    rows.append(Row("(b) peak RSS convert", f"{rss:.0f} MB (max of {len(cv)})",
                    f"{rss / torch_rss:.3f}x torch",
                    f"<= {big / MB:.0f} + {RSS_HEADROOM_MB:g} MB",
                    same and not problems and rss <= limit,
                    [f"consolidate_safetensors_files peak {torch_rss:.0f} MB; largest tensor "
                     f"{human(big)}"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "~128 MiB (largest tensor 8 MiB), 2 runs each: a smoke run",
                         "keep the checkpoint in bench/_work for faster reruns")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return 0
    rounds = args.runs or (2 if args.quick else 3)
    t0 = time.perf_counter()
    how = ensure(args.quick)
    src, cols = checkpoint(args.quick), width(args.quick)
    size = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    log = [f"{src.relative_to(ROOT)}: {size / MB:.1f} MiB in {RANKS} shard files "
           f"(HuggingFaceStorageWriter, save_distributed, {RANKS} ranks), "
           f"{len(layout(cols))} tensors, largest {human(largest(cols))} ({how})",
           which_ckptool(args.source, "hfs_source")]
    warm(src)
    try:
        rows = target(args.quick, rounds)
    finally:
        for path in (OUT_ST, OUT_TORCH, WORK / "hfs_source"):
            remove(path)
    notes = ["warm page cache: the checkpoint read once, each command run once untimed "
             "(outputs compared) before timing; each output deleted after its run",
             f"{rounds} alternating runs per command; ratios of the fastest runs"]
    code = report(rows, log, [], notes, args.quick, t0, [])
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
