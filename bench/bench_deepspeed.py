"""Targets of ``ckptool convert`` on a DeepSpeed ZeRO-3 checkpoint, against
DeepSpeed's own ``zero_to_fp32.py``, as ratios measured in one run.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_deepspeed.py [--quick] [--keep] [--runs N] [--source]
                                              [--ds-python PATH]

DeepSpeed is not a dependency of ckptool: the checkpoint is written, and
``zero_to_fp32.py`` run, by a Python that has it (``--ds-python``, default
``$DS_PYTHON`` or ``/tmp/dsvenv/bin/python``; how to make one:
``tests/fixtures/deepspeed/make_deepspeed.py``'s docstring). Without one the
bench says so and exits 2.

The checkpoint: a stack of 8 ``Linear(5792, 5792)`` (268M fp32 parameters,
largest tensor 128 MiB) trained one AdamW step by 4 ranks (``torchrun``,
gloo, ``DS_ACCELERATOR=cpu``) under ZeRO 3 and saved by
``engine.save_checkpoint``; ``--quick``: ``Linear(1448, 1448)``, 17M.

Targets:

  (a) ``ckptool convert CKPT out.safetensors`` takes at most 0.5x the wall
      time of ``python CKPT/zero_to_fp32.py CKPT OUTDIR --safe_serialization
      --max_shard_size 100GB`` (DeepSpeed's own consolidation into one
      safetensors file), both whole processes;
  (b) the peak RSS of the convert process is at most the largest tensor +
      300 MB (both sides' peaks printed: ``os.wait4`` rusage of each child).

The first run of each command is untimed, and their outputs are compared
tensor for tensor (``torch.equal``, dtype) in a child process. Then the two
alternate, ``--runs`` rounds (3; 2 with ``--quick``), each output deleted
after its run; ratios are of the fastest runs (medians beside them). Inputs
live under ``bench/_work/`` (gitignored), deleted at the end unless
``--keep``. ``--source`` measures the source tree rather than the installed
ckptool. Exit code 0 if both targets pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_inspect import MB, ROOT, WORK, Row, best, check_rc, med, report, spread
from bench_multifile import (
    Commands,
    bench_arguments,
    ckptool_cmd,
    compared,
    failure,
    first_runs,
    free_port,
    mb,
    remove,
    timed_rounds,
    times,
    warm,
    which_ckptool,
)

RANKS = 4
CONVERT_DS_MAX = 0.5  # (a)
RSS_HEADROOM_MB = 300.0  # (b)
LAYERS = 8
TAG = "global_step1"

CHECK = """\
import json, sys
from safetensors.torch import load_file
import torch
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
differ = [k for k in a if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
print(json.dumps({"differ": differ, "missing": sorted(set(a) - set(b)),
                  "extra": sorted(set(b) - set(a)), "tensors": len(a)}))
"""


def width(quick: bool) -> int:
    return 1448 if quick else 5792


def checkpoint(quick: bool) -> Path:
    return WORK / f"ds_z3_{RANKS}r_w{width(quick)}"


def ds_python(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("DS_PYTHON"), "/tmp/dsvenv/bin/python"):
        if candidate and Path(candidate).is_file():
            probe = subprocess.run([candidate, "-c", "import deepspeed"], capture_output=True,
                                   env={**os.environ, "DS_ACCELERATOR": "cpu"})
            if probe.returncode == 0:
                return candidate
    return None


def worker(out: str, dim: int) -> None:
    """One rank: the model, one step, the save (run under torchrun by ``ensure``)."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(LAYERS)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**6}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    loss = engine(torch.randn(1, dim)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag=TAG)


def ensure(quick: bool, ds: str) -> str:
    path = checkpoint(quick)
    if (path / "latest").is_file():
        return "reused"
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    remove(tmp)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([ds, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           __file__, "--worker", str(tmp), str(width(quick))],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / "latest").is_file():
        sys.exit(f"writing the checkpoint failed (exit code {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    tmp.rename(path)
    return "generated"


def target(quick: bool, ds: str, rounds: int) -> list[Row]:
    src = checkpoint(quick)
    out_ds = WORK / "ds_out_zero_to_fp32"
    out_st = WORK / "ds_out.safetensors"
    script = src / "zero_to_fp32.py"
    dim = width(quick)
    largest = dim * dim * 4
    env = {"DS_ACCELERATOR": "cpu"}
    os.environ.update(env)  # the children inherit it (ckptool ignores it)
    commands: Commands = {
        "zero_to_fp32.py": ([ds, str(script), str(src), str(out_ds), "--safe_serialization",
                             "--max_shard_size", "100GB"], out_ds),
        "convert": (ckptool_cmd("convert", str(src), str(out_st), "-q"), out_st),
    }

    def check() -> list[str]:
        return compared(CHECK, out_ds / "model.safetensors", out_st, "zero_to_fp32")

    first, notes = first_runs(commands, check)
    broken = failure(first["convert"], "convert") + failure(first["zero_to_fp32.py"],
                                                             "zero_to_fp32.py")
    if broken:
        return [Row("(a) convert vs zero_to_fp32.py", "not timed", "", "", False, broken)]
    runs = timed_rounds(commands, rounds)
    problems = check_rc(runs["convert"], "convert") + check_rc(runs["zero_to_fp32.py"],
                                                               "zero_to_fp32.py")
    ratio = best(runs["convert"]) / best(runs["zero_to_fp32.py"])
    median = med(runs["convert"]) / med(runs["zero_to_fp32.py"])
    rss = max(r.maxrss_kb for r in runs["convert"])
    ds_rss = max(r.maxrss_kb for r in runs["zero_to_fp32.py"])
    limit = largest / MB + RSS_HEADROOM_MB
    return [
        Row("zero_to_fp32.py (DeepSpeed)", spread(runs["zero_to_fp32.py"]),
            notes=[f"peak RSS {mb(ds_rss):.0f} MB"]),
        Row("(a) ckptool convert", spread(runs["convert"]),
            f"{times(ratio, CONVERT_DS_MAX)} (median {median:.2f}x)",
            f"<= {CONVERT_DS_MAX}x", ratio <= CONVERT_DS_MAX and not problems,
            notes + problems),
        Row("(b) convert peak RSS", f"{mb(rss):.0f} MB", "",
            f"<= largest tensor {largest / MB:.0f} MiB + {RSS_HEADROOM_MB:.0f} MB",
            mb(rss) <= limit and not problems),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "a 17M-parameter checkpoint", "keep the checkpoint for reruns")
    ap.add_argument("--ds-python", default=None, help="a Python with deepspeed installed")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return 0
    ds = ds_python(args.ds_python)
    if ds is None:
        print("no Python with deepspeed found (--ds-python, $DS_PYTHON, /tmp/dsvenv/bin/python):"
              " see tests/fixtures/deepspeed/make_deepspeed.py for how to make one",
              file=sys.stderr)
        return 2
    rounds = args.runs or (2 if args.quick else 3)
    t0 = time.perf_counter()
    log = [f"DeepSpeed's Python: {ds}"]
    how = ensure(args.quick, ds)
    src = checkpoint(args.quick)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    log.append(f"{src.relative_to(ROOT)}: {size / MB:.0f} MiB, ZeRO 3, {RANKS} ranks, "
               f"{LAYERS} x Linear({width(args.quick)}) ({how})")
    log.append(which_ckptool(args.source, "ds_source"))
    warm(src)
    try:
        rows = target(args.quick, ds, rounds)
    finally:
        for name in ("ds_out_zero_to_fp32", "ds_out.safetensors", "ds_source"):
            remove(WORK / name)
    notes = ["warm page cache: the checkpoint read once, each command run once untimed "
             "(outputs compared) before timing; each output deleted after its run",
             f"{rounds} alternating runs per command; ratios of the fastest runs"]
    code = report(rows, log, [], notes, args.quick, t0, [])
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
