"""Targets of ``ckptool`` on checkpoints of many files, as ratios against baselines.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_multifile.py [--quick] [--keep] [--runs N] [--source]

Targets (all measured in this run, on this machine, warm page cache):

  (a) ``ckptool convert DCPDIR out.safetensors`` of a ~1 GiB
      torch.distributed.checkpoint directory written by 4 ranks (torchrun,
      gloo, DTensors row-sharded with ``Shard(0)`` over a CPU device mesh,
      largest tensor 64 MiB) takes at most 0.5x the wall time of torch's own
      ``dcp_to_torch_save(DCPDIR, out.pt)`` in a subprocess, and the peak RSS
      of the convert process is at most the largest tensor + 300 MB (both
      sides' peaks are printed: ``os.wait4`` rusage of each child);
  (b) ``ckptool convert HFBINDIR OUTDIR --format hf --max-shard-size 500MB``
      of ~2 GB of Hugging Face torch shards (``save_torch_state_dict(...,
      safe_serialization=False, max_shard_size="500MB")``) into safetensors
      shards takes at most 2x the time of ``cp -r`` of the same directory;
  (c) ``ckptool inspect --json`` of a DCP directory of 5,000 small tensors
      (one process, ``dcp.save`` without a process group) costs about what
      ``inspect --json`` of a ``torch.save`` file of the same tensors costs:
      at most 3x (a metadata-only read on both sides).

Each target stands alone: a failing convert leaves the others measured. The
first run of every command is untimed (it warms .pyc files, torch's shared
libraries, the page cache) and its output is checked: (a) tensor for tensor
against ``dcp_to_torch_save``'s file, (b) against the input shards, with the
output shards' sizes ((c)'s tensor counts are checked after its timed runs).
Then the commands of a target alternate, in an order
that rotates each round, ``--runs`` rounds (3; (c) four times as many, its
runs are short), each output deleted (untimed) after its run; ratios are
judged on the fastest run of each side, as in bench_inspect.py (the median
ratio is printed beside it). ``--quick`` shrinks (a) and (b) to ~128 MiB
(largest tensor 8 MiB, 32 MB shards) and runs each command twice: a smoke
run, whose (b) ratio is mostly ckptool's start-up against a 50 ms ``cp``.

ckptool runs as installed (from outside the source tree, byte-compiled); a
line says whether the installed copy matches the source tree. ``--source``
measures the source tree instead (the child processes' ``PYTHONPATH`` starts
with a folder holding a link to ``ckptool/``). Inputs are generated under ``bench/_work/``
(gitignored) by torch subprocesses (torchrun for (a)) and reused by later
runs; they are deleted at the end unless ``--keep``. Exit code 0 if every
target passes, 1 otherwise; a failing (c) prints a profile of one inspect
run of the directory. No absolute time is ever asserted.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_fix import installed_state
from bench_inspect import (
    MB,
    PY,
    ROOT,
    RUN_DIR,
    WORK,
    Row,
    Run,
    best,
    check_rc,
    measure,
    med,
    report,
    spread,
)

RANKS = 4  # (a): torchrun --nproc_per_node
CONVERT_TORCH_MAX = 0.5  # (a) time
RSS_HEADROOM_MB = 300.0  # (a) peak RSS <= largest tensor + this (MiB, as MB elsewhere here)
CONVERT_CP_MAX = 2.0  # (b)
INSPECT_MAX = 3.0  # (c)
SMALL_TENSORS = 5000  # (c)

Shape = tuple[int, ...]


# --- the checkpoints --------------------------------------------------------------------------

def dcp_layout(cols: int) -> list[tuple[str, Shape]]:
    """(a): float32, every dim 0 a multiple of RANKS; cols=1024 gives 1 GiB, 114
    tensors, the largest two 64 MiB."""
    out: list[tuple[str, Shape]] = [("embed.weight", (16384, cols))]
    for i in range(28):
        out += [(f"layers.{i}.attn.weight", (4096, cols)), (f"layers.{i}.attn.bias", (4096,)),
                (f"layers.{i}.mlp.weight", (4096, cols)), (f"layers.{i}.norm.weight", (cols,))]
    return [*out, ("lm_head.weight", (16384, cols))]


def hf_layout(cols: int) -> list[tuple[str, Shape]]:
    """(b): float32, a decoder's names; cols=1024 gives ~2 GB (1.9 GiB) in 269 tensors,
    the largest two 64 MiB."""
    out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (16384, cols))]
    for i in range(38):
        p = f"model.layers.{i}."
        out += [(p + f"self_attn.{x}_proj.weight", (1024, cols)) for x in "qkvo"]
        out += [(p + "mlp.up_proj.weight", (4096, cols)),
                (p + "mlp.down_proj.weight", (4096, cols)),
                (p + "input_layernorm.weight", (cols,))]
    return [*out, ("model.norm.weight", (cols,)), ("lm_head.weight", (16384, cols))]


def small_layout() -> list[tuple[str, Shape]]:
    """(c): 5,000 small float32 tensors."""
    out: list[tuple[str, Shape]] = []
    for i in range(SMALL_TENSORS // 2):
        out += [(f"blocks.{i}.proj.weight", (8, 8)), (f"blocks.{i}.proj.bias", (8,))]
    return out


def nbytes(shape: Shape) -> int:
    n = 4
    for d in shape:
        n *= d
    return n


@dataclass
class Input:
    """A generated input under bench/_work: a directory (or file), its layout."""
    name: str
    kind: str  # dcp4 | hfbin | small (writes both small_dir and small_file)
    cols: int = 0

    @property
    def path(self) -> Path:
        return WORK / self.name

    @property
    def layout(self) -> list[tuple[str, Shape]]:
        if self.kind == "dcp4":
            return dcp_layout(self.cols)
        if self.kind == "hfbin":
            return hf_layout(self.cols)
        return small_layout()

    @property
    def data_bytes(self) -> int:
        return sum(nbytes(s) for _, s in self.layout)

    @property
    def largest(self) -> int:
        return max(nbytes(s) for _, s in self.layout)

    @property
    def label(self) -> str:
        n = self.data_bytes
        return f"~{n / MB:.0f} MiB" if n < 1024 * MB else f"~{n / 1024 / MB:.1f} GiB"

    def size(self) -> int:
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def looks_complete(self) -> bool:
        # the generator renames a finished .tmp into place; the size checks the rest:
        # tensor bytes plus per-chunk zip headers (~1.5 KiB in DCP) and the metadata
        if not self.path.exists():
            return False
        size = self.size()
        items = len(self.layout) * (RANKS if self.kind == "dcp4" else 1)
        return self.data_bytes <= size <= self.data_bytes + items * 4096 + 4 * MB


def inputs(quick: bool) -> tuple[Input, Input, Input, Input]:
    """(a)'s DCP dir, (b)'s HF bin dir, (c)'s DCP dir and (c)'s torch.save file."""
    a_cols, b_cols = (128, 64) if quick else (1024, 1024)
    return (Input(f"mf_dcp{RANKS}r_c{a_cols}", "dcp4", a_cols),
            Input(f"mf_hfbin_c{b_cols}", "hfbin", b_cols),
            Input(f"mf_dcp_{SMALL_TENSORS}t", "small"),
            Input(f"mf_{SMALL_TENSORS}t.pth", "small"))


def shard_limit(quick: bool) -> str:
    return "32MB" if quick else "500MB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def generate(kind: str, out: str, cols: int, shard: str) -> None:
    """Write one input (in a child process: the bench itself never imports torch)."""
    import warnings

    warnings.filterwarnings("ignore")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if kind == "dcp4":
        # re-run this file under torchrun: RANKS processes over gloo on this machine
        subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                        __file__, "--worker", tmp, str(cols)], check=True)
    elif kind == "hfbin":
        import torch
        from huggingface_hub import save_torch_state_dict

        g = torch.Generator().manual_seed(0)
        sd = {k: torch.randn(s, generator=g) for k, s in hf_layout(cols)}
        os.makedirs(tmp)
        save_torch_state_dict(sd, tmp, safe_serialization=False, max_shard_size=shard)
    else:  # small: a DCP directory (one process, no process group) and a torch.save file
        import torch
        import torch.distributed.checkpoint as dcp

        g = torch.Generator().manual_seed(0)
        sd = {k: torch.randn(s, generator=g) for k, s in small_layout()}
        dcp.save(sd, checkpoint_id=tmp)
        torch.save(sd, out + ".pth.tmp")
        os.replace(out + ".pth.tmp", str(WORK / f"mf_{SMALL_TENSORS}t.pth"))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # a killed run never leaves a half directory to reuse


def dcp_worker(out: str, cols: int) -> None:
    """One rank of (a): its rows of every tensor, as DTensors, saved with dcp.save."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for i, (key, shape) in enumerate(dcp_layout(cols)):
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.randn((shape[0] // world, *shape[1:]), generator=g)
        sd[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def ensure(inp: Input, quick: bool) -> str:
    if inp.looks_complete():
        return "reused"
    WORK.mkdir(parents=True, exist_ok=True)
    target = inp.path if inp.kind != "small" else WORK / f"mf_dcp_{SMALL_TENSORS}t"
    # torchrun's banner and the writers' warnings are shown only if it fails
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PY, __file__, "--generate", inp.kind, str(target), str(inp.cols),
                           shard_limit(quick)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"generating {target} failed (exit code {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    if not inp.looks_complete():
        sys.exit(f"generated {inp.path} has an unexpected size ({inp.size()} bytes)")
    return "generated"


def warm(path: Path) -> None:
    """Read every file once (chunked: the bench process must stay small)."""
    buf = bytearray(MB)
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def listing(path: Path) -> str:
    files = sorted(p for p in path.iterdir() if p.is_file())
    big = [p for p in files if p.stat().st_size > MB]
    return (f"{len(files)} files ({len(big)} over 1 MiB: "
            + ", ".join(f"{p.name} {p.stat().st_size / MB:.0f} MiB" for p in big[:8])
            + (", ..." if len(big) > 8 else "") + ")")


# --- the commands -----------------------------------------------------------------------------

# torch's own consolidation, timed as a whole process; import and the call reported apart
TORCH_DCP = """\
import json, sys, time, warnings
warnings.filterwarnings("ignore")
t0 = time.perf_counter()
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
t1 = time.perf_counter()
dcp_to_torch_save(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "convert": t2 - t1}))
"""

# (a)'s check: ckptool's safetensors file holds what dcp_to_torch_save's file holds
CHECK_A = """\
import json, sys, torch
from safetensors import safe_open
ref = torch.load(sys.argv[1], map_location="cpu", mmap=True, weights_only=True)
bad = []
with safe_open(sys.argv[2], "pt") as f:
    keys = set(f.keys())
    for k, v in ref.items():
        if k in keys and not torch.equal(f.get_tensor(k), v):
            bad.append(k)
print(json.dumps({"tensors": len(keys), "differ": bad[:5], "missing": sorted(set(ref) - keys)[:5],
                  "extra": sorted(keys - set(ref))[:5]}))
"""

# (b)'s check: every tensor of the input shards, equal, in output shards under the limit
CHECK_B = """\
import glob, json, os, sys, torch
from safetensors import safe_open
src, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
ref = {}
for p in sorted(glob.glob(os.path.join(src, "*.bin"))):
    ref.update((k, (p, None)) for k in torch.load(p, mmap=True, weights_only=True))
index = os.path.join(out, "model.safetensors.index.json")
shards = sorted(glob.glob(os.path.join(out, "*.safetensors")))
info = {"shards": len(shards), "index": os.path.exists(index), "differ": [], "largest": 0}
if info["index"]:
    wm = json.load(open(index))["weight_map"]
    info["index_ok"] = sorted(set(wm.values())) == sorted(map(os.path.basename, shards))
got = set()
loaded = {}
for p in shards:
    with safe_open(p, "pt") as f:
        size = 0
        for k in f.keys():
            t = f.get_tensor(k)
            size += t.nbytes
            got.add(k)
            if k in ref:
                srcfile = ref[k][0]
                if srcfile not in loaded:
                    loaded.clear()
                    loaded[srcfile] = torch.load(srcfile, mmap=True, weights_only=True)
                if not torch.equal(loaded[srcfile][k], t):
                    info["differ"].append(k)
        info["largest"] = max(info["largest"], size)
info["tensors"] = len(got)
info["missing"] = sorted(set(ref) - got)[:5]
info["extra"] = sorted(got - set(ref))[:5]
info["over_limit"] = info["largest"] > limit
print(json.dumps(info))
"""


def ckptool_cmd(*args: str) -> list[str]:
    return [PY, "-m", "ckptool", *args]


def last_json(run: Run) -> dict[str, object] | None:
    for line in reversed(run.out.strip().splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def child_check(script: str, *args: str) -> dict[str, object]:
    proc = subprocess.run([PY, "-c", script, *args], capture_output=True, text=True)
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (proc.stderr or proc.stdout).strip()[-400:]}
    return data if isinstance(data, dict) else {"error": str(data)}


Commands = dict[str, tuple[list[str], Path | None]]


def timed_rounds(commands: Commands, rounds: int, capture: tuple[str, ...] = ()
                 ) -> dict[str, list[Run]]:
    """Every command ``rounds`` times, in an order that rotates each round so that
    drift on a shared machine hits every command; outputs (files or directories)
    are deleted, untimed, after each run. Only the commands named in ``capture``
    keep their stdout (stderr is always kept): the bench must stay small, its
    own RSS is every child's floor (see bench_inspect.measure)."""
    names = list(commands)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            cmd, out = commands[name]
            runs[name].append(measure(cmd, capture=name in capture))
            if out is not None:
                remove(out)
    return runs


def first_runs(commands: Commands, check: Callable[[], list[str]], capture: bool = True
               ) -> tuple[dict[str, Run], list[str]]:
    """One untimed run of each command; ``check`` looks at their outputs, then
    the outputs go."""
    first = {}
    for name, (cmd, out) in commands.items():
        if out is not None:
            remove(out)
        first[name] = measure(cmd, capture=capture)
    try:
        notes = check()
    finally:
        for _, out in commands.values():
            if out is not None:
                remove(out)
    return first, notes


def failure(run: Run, what: str) -> list[str]:
    """Why the first (untimed) run failed, if it did: its timed runs are then
    skipped, and the target fails with the message (e.g. a feature not built yet)."""
    if run.rc == 0:
        return []
    return [f"{what} failed on its first run (exit code {run.rc}), not timed: "
            f"{run.out.strip()[-400:]}"]


def human(n: int) -> str:
    return f"{n / MB:g} MiB" if n >= MB else f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B"


def times(ratio: float, limit: float) -> str:
    """A ratio to two decimals, or three where two would round onto the limit."""
    text = f"{ratio:.2f}x"
    return f"{ratio:.3f}x" if text == f"{limit:.2f}x" else text


def self_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mb(kb: int) -> float:
    return kb / 1024


# --- the targets ------------------------------------------------------------------------------

def target_a(src: Input, rounds: int) -> list[Row]:
    out_pt = WORK / "mf_out.pt"
    out_st = WORK / "mf_out.safetensors"
    commands: Commands = {
        "torch": ([PY, "-c", TORCH_DCP, str(src.path), str(out_pt)], out_pt),
        "convert": (ckptool_cmd("convert", str(src.path), str(out_st), "-q"), out_st),
    }

    def check() -> list[str]:
        return compared(CHECK_A, out_pt, out_st, "dcp_to_torch_save")

    first, checked = first_runs(commands, check)
    rows = []
    torch_notes = check_rc([first["torch"]], "dcp_to_torch_save")
    conv_notes = failure(first["convert"], "convert")
    if conv_notes:  # the baseline is timed all the same
        del commands["convert"]
    runs = timed_rounds(commands, rounds, capture=("torch",))
    th = runs["torch"]
    torch_notes += check_rc(th, "dcp_to_torch_save")
    rows.append(Row(f"dcp_to_torch_save subprocess {src.label}", spread(th), notes=torch_notes))
    inner = [d for d in map(last_json, th) if d]
    if inner:
        rows.append(Row("  inside it: import / dcp_to_torch_save",
                        " / ".join(f"{statistics.median(float(d[k]) for d in inner):.2f} s"
                                   for k in ("import", "convert"))))
    torch_rss = max(mb(r.maxrss_kb) for r in th)
    limit = src.largest / MB + RSS_HEADROOM_MB
    if conv_notes:
        rows.append(Row("(a) convert DCP -> .safetensors / dcp_to_torch_save", "not measured",
                        "", f"<= {CONVERT_TORCH_MAX:g}x", False, conv_notes))
        rows.append(Row("(a) peak RSS convert", "not measured",
                        f"dcp_to_torch_save {torch_rss:.0f} MB",
                        f"<= {limit:.0f} MB", False))
        return rows
    cv = runs["convert"]
    conv_notes = check_rc(cv, "convert") + checked
    ok = not check_rc(cv, "convert") and not any("differs" in n for n in checked)
    rows.append(Row(f"convert DCP -> .safetensors {src.label}", spread(cv), notes=conv_notes))
    ratio = best(cv) / best(th)
    rows.append(Row("(a) convert / dcp_to_torch_save",
                    f"fastest runs; medians give {med(cv) / med(th):.2f}x",
                    times(ratio, CONVERT_TORCH_MAX),
                    f"<= {CONVERT_TORCH_MAX:g}x",
                    ok and not torch_notes and ratio <= CONVERT_TORCH_MAX))
    rss = max(mb(r.maxrss_kb) for r in cv)
    rows.append(Row("(a) peak RSS convert", f"{rss:.0f} MB (max of {len(cv)})",
                    f"{rss / torch_rss:.3f}x torch",
                    f"<= {src.largest / MB:.0f} + {RSS_HEADROOM_MB:g} MB", ok and rss <= limit,
                    [f"dcp_to_torch_save peak {torch_rss:.0f} MB; largest tensor "
                     f"{src.largest / MB:.0f} MiB"]))
    return rows


def target_b(src: Input, rounds: int, quick: bool) -> list[Row]:
    out_cp = WORK / "mf_out_cp"
    out_hf = WORK / "mf_out_hf"
    limit = shard_limit(quick)
    commands: Commands = {
        "cp": (["cp", "-r", str(src.path), str(out_cp)], out_cp),
        "convert": (ckptool_cmd("convert", str(src.path), str(out_hf), "--format", "hf",
                            "--max-shard-size", limit, "-q"), out_hf),
    }

    def check() -> list[str]:
        if not out_hf.is_dir():
            return []
        limit_bytes = int(limit.removesuffix("MB")) * 1000 * 1000
        data = child_check(CHECK_B, str(src.path), str(out_hf), str(limit_bytes))
        if ("error" in data or data.get("differ") or data.get("missing") or data.get("extra")
                or data.get("over_limit") or not data.get("index_ok", True)):
            return [f"convert output does not match the input shards: {data}"]
        return [f"output checked: {listing(out_hf)}",
                f"{data['tensors']} tensors equal to the input's in {data['shards']} shards, "
                f"largest {int(data['largest']) / 1e6:.0f} MB of tensors (limit {limit}), "
                + ("with" if data["index"] else "without") + " model.safetensors.index.json"]

    first, checked = first_runs(commands, check)
    rows = []
    conv_notes = failure(first["convert"], "convert")
    if conv_notes:
        del commands["convert"]
    runs = timed_rounds(commands, rounds)
    cp = runs["cp"]
    cp_notes = check_rc(cp, "cp -r")
    rows.append(Row(f"cp -r {src.label} ({len(list(src.path.iterdir()))} files)", spread(cp),
                    notes=cp_notes))
    if conv_notes:
        rows.append(Row(f"(b) convert --format hf --max-shard-size {limit} / cp -r",
                        "not measured", "", f"<= {CONVERT_CP_MAX:g}x", False, conv_notes))
        return rows
    cv = runs["convert"]
    ok = not check_rc(cv, "convert") and not any("does not match" in n for n in checked)
    rows.append(Row(f"convert --format hf --max-shard-size {limit}", spread(cv),
                    notes=check_rc(cv, "convert") + checked
                    + [f"peak RSS {max(mb(r.maxrss_kb) for r in cv):.0f} MB"]))
    ratio = best(cv) / best(cp)
    rows.append(Row("(b) convert --format hf / cp -r",
                    f"fastest runs; medians give {med(cv) / med(cp):.2f}x",
                    times(ratio, CONVERT_CP_MAX),
                    f"<= {CONVERT_CP_MAX:g}x", ok and not cp_notes and ratio <= CONVERT_CP_MAX))
    return rows


def target_c(dcp_dir: Input, pth: Input, rounds: int) -> list[Row]:
    commands: Commands = {
        "dir": (ckptool_cmd("inspect", "--json", str(dcp_dir.path)), None),
        "file": (ckptool_cmd("inspect", "--json", str(pth.path)), None),
        "bare": ([PY, "-c", "pass"], None),
    }
    bench_rss = self_rss_mb()
    first_runs(commands, list, capture=False)
    runs = timed_rounds(commands, rounds)
    # the output is checked last: parsing megabytes of JSON grows the bench, and
    # the bench's RSS is the floor of every child's peak (bench_inspect.measure)
    counts = []
    for name in ("dir", "file"):
        run = measure(commands[name][0], capture=True)
        data = json_document(run)
        n = data.get("num_tensors") if data else None
        if n != SMALL_TENSORS:
            counts.append(f"inspect --json {name}: num_tensors {n}, expected {SMALL_TENSORS}"
                          + (f" ({run.out.strip()[-300:]})" if not data else ""))
    d, f = runs["dir"], runs["file"]
    d_notes = check_rc(d, "inspect DIR")
    f_notes = check_rc(f, "inspect FILE")
    d_info = f"{listing(dcp_dir.path)}; peak RSS {max(mb(r.maxrss_kb) for r in d):.0f} MB"
    f_info = f"{pth.size() / MB:.1f} MiB; peak RSS {max(mb(r.maxrss_kb) for r in f):.0f} MB"
    rows = [
        Row("python -c pass (startup floor)", spread(runs["bare"]),
            notes=[f"peak RSS {max(mb(r.maxrss_kb) for r in runs['bare']):.0f} MB: the floor "
                   f"of every child's, the bench's own RSS at spawn ({bench_rss:.0f} MB "
                   "before these runs; see bench_inspect.measure)"]),
        Row(f"inspect --json DCP dir, {SMALL_TENSORS} tensors", spread(d),
            notes=[*d_notes, d_info]),
        Row(f"inspect --json .pth, {SMALL_TENSORS} tensors", spread(f),
            notes=[*f_notes, f_info]),
    ]
    ratio = best(d) / best(f)
    rows.append(Row("(c) inspect DCP dir / inspect .pth",
                    f"fastest runs; medians give {med(d) / med(f):.2f}x",
                    times(ratio, INSPECT_MAX),
                    f"<= {INSPECT_MAX:g}x",
                    not (d_notes or f_notes or counts) and ratio <= INSPECT_MAX, counts))
    return rows


def json_document(run: Run) -> dict[str, object] | None:
    """inspect --json prints one (multi-line) JSON document."""
    if run.rc != 0:
        return None
    text = run.out
    start = text.find("{")
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def profile(cmd: list[str], n: int = 12) -> list[str]:
    """Where one run of a ckptool command spends its time (cProfile, own time), for
    a failing target."""
    proc = subprocess.run([PY, "-m", "cProfile", "-s", "tottime", *cmd[1:]], cwd=RUN_DIR,
                          capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return lines[start:start + n + 1]


def bench_arguments(doc: str, quick: str, keep: str,
                    runs: str = "timed runs of each (3; 2 --quick)") -> argparse.ArgumentParser:
    """The options every bench of many files takes: --quick, --keep, --runs, --source."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--keep", action="store_true", help=keep)
    ap.add_argument("--runs", type=int, default=None, help=runs)
    ap.add_argument("--source", action="store_true",
                    help="measure the source tree's ckptool rather than the installed one")
    return ap


def which_ckptool(source: bool, link_name: str) -> str:
    """Point the children at the ckptool to measure (the source tree with
    ``source``, else the installed copy), byte-compiled; the line saying which."""
    if source:
        # a folder holding only a link to the source package goes first on the
        # children's path: `python -m ckptool` finds the source tree, and nothing
        # else of the repository root shadows what torch imports
        link = WORK / link_name / "ckptool"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(ROOT / "ckptool", target_is_directory=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(link.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
        compileall.compile_dir(ROOT / "ckptool", quiet=1)
        return (f"--source: measuring the source tree ({ROOT / 'ckptool'}), not the "
                "installed copy")
    import ckptool  # the bench's own interpreter: no torch, just the path

    compileall.compile_dir(Path(ckptool.__file__).parent, quiet=1)
    return installed_state()


def compared(script: str, a: Path, b: Path, baseline: str) -> list[str]:
    """``script`` (a child with torch) on the outputs ``a`` (the baseline's)
    and ``b`` (ckptool's): a note that they are equal, or why not."""
    if not (a.exists() and b.exists()):
        return []
    data = child_check(script, str(a), str(b))
    if "error" in data or data.get("differ") or data.get("missing") or data.get("extra"):
        return [f"convert output differs from {baseline}'s: {data}"]
    return [f"output checked: {data['tensors']} tensors, each equal to {baseline}'s"]


def bench(quick: bool, rounds: int, source: bool) -> tuple[list[Row], list[str], list[str]]:
    a, b, c_dir, c_file = inputs(quick)
    log = []
    for inp in (a, b, c_dir, c_file):
        how = ensure(inp, quick)
        what = f"{len(inp.layout)} tensors, largest {human(inp.largest)}"
        log.append(f"{inp.path.relative_to(ROOT)}: {inp.size() / MB:.1f} MiB, {what} ({how})")
    log.append(which_ckptool(source, "mf_source"))
    for inp in (a, b, c_dir, c_file):
        warm(inp.path)
    rows: list[Row] = []
    targets: list[tuple[str, Callable[[], list[Row]]]] = [
        ("(a)", lambda: target_a(a, rounds)),
        ("(b)", lambda: target_b(b, rounds, quick)),
        ("(c)", lambda: target_c(c_dir, c_file, rounds * 4)),
    ]
    for name, target in targets:  # each on its own: one that breaks leaves the others
        try:
            rows += target()
        except Exception as exc:  # reported as that target's failure
            rows.append(Row(f"{name} not measured", "the bench broke", "", "", False,
                            [f"{type(exc).__name__}: {exc}"]))
    diag = []
    if any(r.ok is False for r in rows if r.case.startswith("(c)")):
        diag = ["where one inspect --json of the DCP directory spends its time (cProfile, "
                "own time):"]
        diag += ["  " + line
                 for line in profile(ckptool_cmd("inspect", "--json", str(c_dir.path)))]
    return rows, log, diag


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "(a) and (b) on ~128 MiB, 2 runs each: a smoke run",
                         "keep the generated inputs in bench/_work for faster reruns",
                         "timed runs of each (a)/(b) command (3; 2 with --quick); (c) 4x as many")
    ap.add_argument("--generate", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.generate:
        kind, out, cols, shard = args.generate
        generate(kind, out, int(cols), shard)
        return 0
    if args.worker:
        dcp_worker(args.worker[0], int(args.worker[1]))
        return 0
    rounds = args.runs or (2 if args.quick else 3)
    t0 = time.perf_counter()
    outs = ("mf_out.pt", "mf_out.safetensors", "mf_out_cp", "mf_out_hf", "mf_source")
    try:
        rows, log, diag = bench(args.quick, rounds, args.source)
    finally:
        for name in outs:
            remove(WORK / name)
    notes = ["warm page cache: every input read fully once and every command run once "
             "untimed (outputs checked) before timing; each output deleted after its run",
             f"(a)/(b): {rounds} alternating runs per command, (c): {rounds * 4}; ratios of the "
             "fastest runs"]
    cleanup = [] if args.keep else [inp.path for inp in inputs(args.quick)]
    code = report(rows, log, diag, notes, args.quick, t0, [])
    for path in cleanup:
        remove(path)
    return code


if __name__ == "__main__":
    sys.exit(main())
