"""Targets of reading at scale (issue 16): ``inspect --json`` and
``ckptool.load`` against ``torch.load``, as ratios measured in one run.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_load.py [--quick] [--keep] [--runs N] [--source]

Inputs (``torch.save`` files, written under ``bench/_work/`` by a child):

- 100,000 small tensors (an optimizer-state-like flat dict, ~31 MB);
- ~1 GB in 2,000 tensors.

Targets:

  (a) ``ckptool inspect --json`` of the 100,000-tensor file takes at most
      0.2x the time of ``torch.load(weights_only=True)`` of it;
  (b) ``ckptool.load`` of it at most 1.0x ``torch.load(weights_only=True)``;
  (c) ``ckptool.load`` of the 1 GB file at most 1.0x ``torch.load(mmap=True)``.

Each side runs as a whole process (start-up included), alternating, the
fastest runs compared (medians printed beside them). ``--quick``: 10,000
tensors and ~100 MB. Exit code 0 if every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_inspect import MB, PY, WORK, Row, best, check_rc, med, report, spread
from bench_multifile import (
    bench_arguments,
    ckptool_cmd,
    remove,
    timed_rounds,
    times,
    warm,
    which_ckptool,
)

INSPECT_MAX = 0.2  # (a)
LOAD_MAX = 1.0  # (b), (c)

TORCH_LOAD = "import sys, torch; torch.load(sys.argv[1], weights_only=True)"
TORCH_MMAP = "import sys, torch; torch.load(sys.argv[1], weights_only=True, mmap=True)"
CKPTOOL_LOAD = "import sys, ckptool; ckptool.load(sys.argv[1])"


def generate(kind: str, path: str, n: int) -> None:
    """Write one input (in a child process: the bench never imports torch)."""
    import torch

    sd = {}
    if kind == "many":
        for i in range(n // 4):
            p = f"model.layers.{i // 10}.block{i % 10}."
            sd[p + "weight"] = torch.zeros(4, 4)
            sd[p + "bias"] = torch.zeros(4)
            sd[p + "exp_avg"] = torch.zeros(4)
            sd[p + "step"] = torch.tensor(1.0)
    else:  # n tensors of ~n/2000 GB together
        dim = 350 if n >= 2000 else 112
        for i in range(2000):
            sd[f"layers.{i}.weight"] = torch.zeros(dim, dim)
    tmp = path + ".tmp"
    torch.save(sd, tmp)
    os.replace(tmp, path)


def ensure(kind: str, n: int) -> str:
    path = WORK / f"load_{kind}_{n}.pt"
    if path.exists():
        return str(path)
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run([PY, __file__, "--generate", kind, str(path), str(n)], check=True)
    return str(path)


def target(label: str, ours: list[str], theirs: list[str], baseline: str, limit: float,
           rounds: int) -> list[Row]:
    runs = timed_rounds({"ours": (ours, None), "theirs": (theirs, None)}, rounds)
    problems = check_rc(runs["ours"], label) + check_rc(runs["theirs"], baseline)
    ratio = best(runs["ours"]) / best(runs["theirs"])
    median = med(runs["ours"]) / med(runs["theirs"])
    return [Row(baseline, spread(runs["theirs"])),
            Row(label, spread(runs["ours"]), f"{times(ratio, limit)} (median {median:.2f}x)",
                f"<= {limit}x", ratio <= limit and not problems, problems)]


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "10,000 tensors and ~100 MB", "keep the inputs for reruns")
    ap.add_argument("--generate", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.generate:
        generate(args.generate[0], args.generate[1], int(args.generate[2]))
        return 0
    rounds = args.runs or (2 if args.quick else 3)
    t0 = time.perf_counter()
    many = ensure("many", 10_000 if args.quick else 100_000)
    big = ensure("big", 200 if args.quick else 2000)
    log = [f"{p}: {os.path.getsize(p) / MB:.0f} MiB" for p in (many, big)]
    log.append(which_ckptool(args.source, "load_source"))
    for p in (many, big):
        warm(Path(p))
    rows = []
    rows += target("(a) inspect --json", ckptool_cmd("inspect", "--json", many),
                   [PY, "-c", TORCH_LOAD, many], "torch.load(weights_only=True), many tensors",
                   INSPECT_MAX, rounds)
    rows += target("(b) ckptool.load", [PY, "-c", CKPTOOL_LOAD, many],
                   [PY, "-c", TORCH_LOAD, many], "torch.load(weights_only=True), many tensors",
                   LOAD_MAX, rounds)
    rows += target("(c) ckptool.load, ~1 GB", [PY, "-c", CKPTOOL_LOAD, big],
                   [PY, "-c", TORCH_MMAP, big], "torch.load(mmap=True), ~1 GB",
                   LOAD_MAX, rounds)
    code = report(rows, log, [], [f"{rounds} alternating runs per command; ratios of the "
                                  "fastest runs"], args.quick, t0, [])
    remove(WORK / "load_source")
    if not args.keep:
        for p in (many, big):
            remove(Path(p))
    return code


if __name__ == "__main__":
    sys.exit(main())
