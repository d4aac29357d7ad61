"""The safe read of a ``torch.distributed.checkpoint`` ``.metadata`` at scale
(issue 35, item 18), against torch's own ``pickle.load`` of the same file.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_dcp_metadata.py [--quick] [--keep] [--runs N] [--source]
                                                 [--ordinary]

The input is bench_distributed.py's (c): a synthetic DCP directory of 1,000
ranks and 100,000 tensors, each row-sharded into 8 chunks on 8 ranks, its
``.metadata`` (~116 MiB) pickled from torch's own classes as
``FileSystemWriter.finish`` pickles it (``--quick``: 100 ranks, 2,000
tensors). Targets, each timed in a fresh process, the commands alternating
for ``--runs`` rounds (3), fastest runs compared (medians beside them):

  (a) ckptool's safe read of the ``.metadata``
      (``layouts.dcp_metadata.parse``: the grammar, the C unpickler, the
      checks) is no slower than torch's ``pickle.load`` of it (after
      ``import torch.distributed.checkpoint``, the collector on, as torch
      reads it): ratio <= 1.0;
  (b) the whole ``convert SYNTH out.safetensors --dry-run --workers 1000
      --json`` takes at most 10 s (the one absolute time, "seconds" as the
      issue states it).

``--ordinary`` adds one run of the read the C unpickler replaces (the same
parse with the fast path switched off: every opcode through ckptool's own
unpickler), for the record; it takes minutes at full size. Exit code 0 if
every target passes, 1 otherwise.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_distributed import PLAN_SECONDS, convert_cmd, ensure, synth_path, synth_size
from bench_inspect import PY, ROOT, WORK, Row, report
from bench_multifile import bench_arguments, remove, warm, which_ckptool

READ_MAX = 1.0  # (a): ckptool's read / torch's pickle.load

TORCH_READ = """\
import json, pickle, sys, time
import torch.distributed.checkpoint
t0 = time.perf_counter()
with open(sys.argv[1] + "/.metadata", "rb") as f:
    md = pickle.load(f)
t1 = time.perf_counter()
print(json.dumps({"read": t1 - t0, "tensors": len(md.state_dict_metadata)}))
"""

CKPTOOL_READ = """\
import json, sys, time
from ckptool.read.layouts import dcp_fast, dcp_metadata
from ckptool.read.seen import GlobalsSeen
if len(sys.argv) > 2:  # the ordinary read: the fast path off
    dcp_fast.read = lambda *args: None
seen = GlobalsSeen()
taken = []
real = dcp_fast.read
def spy(*args):
    found = real(*args)
    taken.append(found is not None)
    return found
dcp_fast.read = spy
t0 = time.perf_counter()
md = dcp_metadata.parse(sys.argv[1], ".metadata", seen)
t1 = time.perf_counter()
print(json.dumps({"read": t1 - t0, "tensors": len(md.tensors), "fast": all(taken),
                  "unsafe": seen.unsafe()}))
"""


def child(script: str, *args: str) -> dict[str, Any]:
    done = subprocess.run([PY, "-c", script, *args], capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def dry_run(src: Path, ranks: int) -> dict[str, Any]:
    out = WORK / "dcp_metadata_out.safetensors"
    t0 = time.perf_counter()
    done = subprocess.run(convert_cmd(str(src), str(out), "--dry-run", "--workers", str(ranks),
                                      "--json"), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"error": f"exit code {done.returncode}: {done.stderr[-2000:]}"}
    data = json.loads(done.stdout)
    return {"read": wall, "tensors": data.get("tensors"), "ranks": len(data.get("plan") or [])}


def measure(src: Path, ranks: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Each command once untimed (warm page cache, imports compiled), then
    ``rounds`` alternating rounds, the order rotating each round."""
    commands = {"torch": lambda: child(TORCH_READ, str(src)),
                "ckptool": lambda: child(CKPTOOL_READ, str(src)),
                "dry-run": lambda: dry_run(src, ranks)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in commands}
    for name, command in commands.items():
        first = command()
        if "error" in first:
            runs[name].append(first)
            return runs
    names = list(commands)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(commands[name]())
    return runs


def seconds(runs: list[dict[str, Any]]) -> tuple[float, float]:
    values = [float(r["read"]) for r in runs]
    return min(values), statistics.median(values)


def rows_of(runs: dict[str, list[dict[str, Any]]], tensors: int,
            ordinary: dict[str, Any] | None) -> list[Row]:
    broken = [f"{name}: {r['error']}" for name, rs in runs.items() for r in rs if "error" in r]
    if broken:
        return [Row("not measured", "a command failed", ok=False, notes=broken)]
    torch_best, torch_median = seconds(runs["torch"])
    read_best, read_median = seconds(runs["ckptool"])
    dry_best, dry_median = seconds(runs["dry-run"])
    fast = all(r.get("fast") for r in runs["ckptool"])
    counts = {r.get("tensors") for rs in runs.values() for r in rs}
    right = counts == {tensors} and fast and not any(r.get("unsafe") for r in runs["ckptool"])
    ratio = read_best / torch_best
    rows = [
        Row("torch: pickle.load(.metadata)", f"{torch_best:.2f} s",
            notes=[f"median {torch_median:.2f} s"]),
        Row("(a) ckptool: safe read of .metadata", f"{read_best:.2f} s", f"{ratio:.2f}x torch's",
            f"<= {READ_MAX:.1f}x", ratio <= READ_MAX and right,
            [f"median {read_median:.2f} s ({read_median / torch_median:.2f}x torch's median); "
             f"{'the C unpickler' if fast else 'NOT the C unpickler'} read it; "
             f"{tensors:,} tensors on every side: {counts == {tensors}}"]),
        Row("(b) convert --dry-run --workers N --json", f"{dry_best:.2f} s",
            f"{dry_best / torch_best:.1f}x torch's read", f"<= {PLAN_SECONDS:g} s",
            dry_best <= PLAN_SECONDS and right, [f"median {dry_median:.2f} s"]),
    ]
    if ordinary is not None:
        rows.append(Row("  the ordinary read (fast path off)",
                        "failed" if "error" in ordinary else f"{float(ordinary['read']):.2f} s",
                        "" if "error" in ordinary
                        else f"{float(ordinary['read']) / torch_best:.1f}x torch's",
                        notes=["one run, for the record: what (a) replaces"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "100 ranks x 2,000 tensors, one timed run of each: a "
                         "smoke run", "keep the generated directory in bench/_work",
                         "timed rounds after the untimed one (3; --quick: 1)")
    ap.add_argument("--ordinary", action="store_true",
                    help="also time the ordinary read once (minutes at full size)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ranks, tensors = synth_size(args.quick)
    src = synth_path(ranks, tensors)
    made = ensure(src, "synth", str(ranks), str(tensors))
    meta = src / ".metadata"
    log = [f"{src.relative_to(ROOT)}: synthetic, {ranks} ranks, {tensors:,} tensors in 8 chunks "
           f"each; .metadata {meta.stat().st_size / (1 << 20):.1f} MiB ({made})",
           which_ckptool(args.source, "dcpmeta_source")]
    try:
        warm(meta)
        runs = measure(src, ranks, args.runs or (1 if args.quick else 3))
        ordinary = child(CKPTOOL_READ, str(src), "ordinary") if args.ordinary else None
        rows = rows_of(runs, tensors, ordinary)
    finally:
        remove(WORK / "dcpmeta_source")
        remove(WORK / "dcp_metadata_out.safetensors")
    notes = ["each command in a fresh process; page cache warm; the first run of each "
             "untimed; fastest runs compared, medians beside"]
    code = report(rows, log, [], notes, args.quick, t0, [])
    if made == "generated" and not args.keep:
        remove(src)
    return code


if __name__ == "__main__":
    sys.exit(main())
