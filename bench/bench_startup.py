"""The fixed cost of a ``ckptool`` run: start-up, ``--version`` and ``inspect``.

Run with the project's interpreter from the repository root, after
``make .venv/.installed`` (it times the installed ``ckptool`` executable,
as a user runs it)::

    .venv/bin/python bench/bench_startup.py [--quick]

Targets (each side's fastest run in this run; medians printed beside):

  (a) ``ckptool --version`` takes <= 0.08 s (it imports no command, no read
      layer, no rich: ``LazyGroup``); its ratio to ``python -c pass`` is printed;
  (b) ``ckptool inspect --json`` on a ~10 MiB / 2,000-tensor checkpoint
      takes <= 0.12 s;
  (c) ``ckptool inspect --json`` on a ~1 GiB / 2,000-tensor checkpoint is
      >= 30x faster than a subprocess running ``import torch;
      torch.load(p, map_location='cpu')`` on the same file.

``inspect`` without ``--json`` (rich's table) is timed on the ~10 MiB file
for information. The checkpoints are written by a torch subprocess
(``bench_inspect.py --generate``: ``module.``-prefixed keys, every other
layer tagged ``cuda:2``) into a temporary folder under /tmp, deleted at the
end. Warm page cache: each file is read once and each command run once
untimed first. Commands alternate, so drift on a shared machine hits every
side. Exit code 0 if every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_inspect import (
    LAYERS,
    MB,
    PY,
    TORCH_LOAD,
    Row,
    Run,
    best,
    check_rc,
    measure,
    med,
    report,
    spread,
    warm,
)

HERE = Path(__file__).resolve().parent
CKPTOOL = str(Path(PY).parent / "ckptool")  # the installed executable, beside python

VERSION_MAX = 0.08  # (a), seconds
SMALL_MAX = 0.12  # (b), seconds
SPEEDUP_MIN = 30.0  # (c)


def generate(folder: Path, dim: int) -> Path:
    """A checkpoint of 2,000 tensors, [dim, dim] weights and [dim] biases."""
    path = folder / f"startup_{LAYERS * 2}t_d{dim}.pth"
    subprocess.run([PY, str(HERE / "bench_inspect.py"), "--generate", str(path), str(dim)],
                   check=True)
    return path


def judged(case: str, runs: list[Run], limit: float, floor: list[Run]) -> Row:
    """A row judged on the fastest run against ``limit`` seconds."""
    fastest = best(runs)
    notes = check_rc(runs, case)
    return Row(case, f"fastest {fastest:.3f} s; {spread(runs)}",
               f"{fastest / best(floor):.1f}x python -c pass", f"<= {limit:g} s",
               not notes and fastest <= limit, notes)


def bench(folder: Path, quick: bool) -> tuple[list[Row], list[str]]:
    dims = (16, 160) if quick else (50, 500)
    labels = ("~1 MiB", "~100 MiB") if quick else ("~10 MiB", "~1 GiB")
    n_runs, n_torch = (4, 1) if quick else (12, 4)
    small, large = (generate(folder, dim) for dim in dims)
    log = [f"{p}: {p.stat().st_size / MB:.1f} MiB, {LAYERS * 2} tensors" for p in (small, large)]
    for path in (small, large):
        warm(path)
    import ckptool  # the installed package (the bench runs from bench/, not the tree)

    compileall.compile_dir(Path(ckptool.__file__).parent, quiet=1)  # as pip install does
    commands = {
        "bare": [PY, "-c", "pass"],
        "version": [CKPTOOL, "--version"],
        "small": [CKPTOOL, "inspect", "--json", str(small)],
        "large": [CKPTOOL, "inspect", "--json", str(large)],
        "text": [CKPTOOL, "inspect", str(small)],
    }
    torch_cmd = [PY, "-c", TORCH_LOAD, str(large)]
    for cmd in commands.values():  # untimed: .pyc files and page cache warm
        measure(cmd)
    measure(torch_cmd, capture=True)

    runs: dict[str, list[Run]] = {name: [] for name in commands}
    torch_runs: list[Run] = []
    torch_at = {round(k * n_runs / n_torch) for k in range(n_torch)}
    names = list(commands)
    for i in range(n_runs):
        if i in torch_at:
            torch_runs.append(measure(torch_cmd, capture=True))
        for name in names if i % 2 == 0 else names[::-1]:
            runs[name].append(measure(commands[name]))
    inner = [json.loads(r.out.strip().splitlines()[-1]) for r in torch_runs if r.rc == 0]

    bare = runs["bare"]
    rows = [
        Row("python -c pass (start-up floor)", spread(bare)),
        judged("(a) ckptool --version", runs["version"], VERSION_MAX, bare),
        judged(f"(b) inspect --json {labels[0]}", runs["small"], SMALL_MAX, bare),
        Row(f"inspect --json {labels[1]}", spread(runs["large"]),
            notes=check_rc(runs["large"], "inspect")),
        Row(f"inspect (text) {labels[0]}", f"fastest {best(runs['text']):.3f} s; "
            f"{spread(runs['text'])}", notes=check_rc(runs["text"], "inspect")),
        Row(f"torch.load subprocess {labels[1]}", spread(torch_runs),
            notes=check_rc(torch_runs, "torch.load")),
    ]
    if inner:
        rows.append(Row("  inside it: import torch / torch.load",
                        f"{statistics.median(d['import'] for d in inner):.3f} s / "
                        f"{statistics.median(d['load'] for d in inner):.3f} s"))
    speedup = best(torch_runs) / best(runs["large"])
    rows.append(Row(f"(c) inspect --json {labels[1]} vs torch.load",
                    f"fastest runs; medians give {med(torch_runs) / med(runs['large']):.1f}x",
                    f"{speedup:.1f}x", f">= {SPEEDUP_MIN:g}x",
                    not rows[3].notes and not rows[5].notes and speedup >= SPEEDUP_MIN))
    return rows, log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller files (~1 MiB / ~100 MiB) and fewer runs: a smoke run")
    args = ap.parse_args(argv)
    if not Path(CKPTOOL).is_file():
        sys.exit(f"{CKPTOOL} is missing: run 'make .venv/.installed' first")
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="ckptool-bench-startup-"))
    try:
        rows, log = bench(folder, args.quick)
    finally:
        shutil.rmtree(folder)
    notes = ["the installed ckptool executable, byte-compiled first as pip install does; "
             "warm page cache (each file read once, each command run once untimed)"]
    return report(rows, log, [], notes, args.quick, started, [])


if __name__ == "__main__":
    sys.exit(main())
