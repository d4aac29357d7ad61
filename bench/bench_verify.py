"""Targets of ``ckptool verify``, as ratios against baselines timed in the same run.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_verify.py [--quick] [--keep] [--runs N] [--source]

Targets (all measured in this run, on this machine, warm page cache; whole
commands, wall time, fastest of ``--runs`` runs each):

  (a) ``ckptool verify FILE -q`` (structure and every zip record's CRC-32)
      of a ~2 GiB ``torch.save`` file takes at most 2.5x the time of
      ``cat FILE > /dev/null``;
  (b) ``ckptool verify FILE --write-manifest M -q`` (the same checks, then
      the sha256 of the file and a digest of every tensor) takes at most
      1.2x the time of ``sha256sum FILE``;
  (c) the peak RSS of every verify run (``os.wait4`` rusage of that child:
      the figure ``/usr/bin/time -f %M`` prints) is at most the checkpoint's
      largest tensor + 300 MB: memory bounded by the largest tensor, not
      the checkpoint. One row per checkpoint, the worst run named.

Measured beside them, without a target of their own: ``--write-manifest``
against ``openssl dgst -sha256`` too, where openssl is installed (GNU
``sha256sum`` uses its own code unless built with OpenSSL, several times
slower than OpenSSL's on a CPU with SHA instructions, so (b) alone says
little there); ``verify --values`` of the same file against ``cat``;
``verify --manifest M`` (checking against a manifest written before)
against ``sha256sum``; ``python -c 'import torch'`` (``--values`` imports
torch, the other runs do not); and, for a ~1 GiB
torch.distributed.checkpoint directory written by 2 ranks (``torchrun``,
gloo, ``Shard(0)`` DTensors, ``FileSystemWriter(thread_count=4)``: 8 data
files) and ~1 GiB of Hugging Face safetensors shards
(``huggingface_hub.save_torch_state_dict(..., max_shard_size="250MB")``: 4
shards and an index), ``verify -q`` and ``--write-manifest`` with
``--jobs 1`` and ``--jobs 2`` (files checked in parallel) against ``cat``
and ``sha256sum`` of all their files, the ratios printed beside the bounds
of (a) and (b).

The first run of every command is untimed and its result checked (``verify
--json`` says whole, with the tensors and files the generator wrote; each
manifest lists them, and the checkpoint verifies against it). Then the
commands of each checkpoint alternate, in an order that rotates each round,
every manifest deleted (untimed) after its run. A failing (a) or (b) prints
where the time goes: one child process timing, for the file, opening it,
the structure and CRC checks, hashing the file alone, digesting the tensors
alone and the manifest as verify builds it (``--breakdown``: for every
checkpoint, whatever the results). The machine's load average is
printed before and after.

ckptool runs as installed (from outside the source tree, byte-compiled); a
line says whether the installed copy matches the source tree. ``--source``
measures the source tree instead. Inputs are generated under
``bench/_work/`` by torch subprocesses (torchrun for the DCP directory) and
deleted at the end unless ``--keep``. ``--quick`` shrinks them (~128 MiB
each) and runs each command twice: a smoke run. Exit code 0 if every
target passes, 1 otherwise. No absolute time is ever asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_inspect import MB, PY, WORK, Row, Run, best, check_rc, measure, med, report, spread
from bench_multifile import (
    bench_arguments,
    ckptool_cmd,
    dcp_layout,
    free_port,
    hf_layout,
    nbytes,
    remove,
    timed_rounds,
    times,
    warm,
    which_ckptool,
)

OPENSSL = shutil.which("openssl")  # a second sha256 baseline, where there is one
VERIFY_CAT_MAX = 2.5  # (a)
MANIFEST_SHA_MAX = 1.2  # (b)
RSS_HEADROOM_MB = 300.0  # (c): peak RSS <= largest tensor + this
RANKS = 2  # the DCP directory: torchrun --nproc_per_node
WRITER_THREADS = 4  # FileSystemWriter(thread_count=): files per rank

Shape = tuple[int, ...]


# --- the checkpoints --------------------------------------------------------------------------

def pt_layout(cols: int) -> list[tuple[str, Shape]]:
    """The torch.save file: float32; cols=2048 gives 2 GiB in 58 tensors, an
    embedding and a head of 256 MiB, 8 blocks of 192 MiB."""
    out: list[tuple[str, Shape]] = [("embed.weight", (16 * cols, cols))]
    for i in range(8):
        p = f"blocks.{i}."
        out += [(p + f"attn.{x}.weight", (cols, cols)) for x in "qkvo"]
        out += [(p + "mlp.up.weight", (4 * cols, cols)), (p + "mlp.down.weight", (cols, 4 * cols)),
                (p + "norm.weight", (cols,))]
    return [*out, ("lm_head.weight", (16 * cols, cols))]


@dataclass
class Input:
    """A generated checkpoint under bench/_work: a file or a directory."""
    kind: str  # pt | dcp | hf
    cols: int
    shard: str = ""  # hf: max_shard_size

    @property
    def path(self) -> Path:
        suffix = ".pth" if self.kind == "pt" else ""
        return WORK / f"vf_{self.kind}_c{self.cols}{suffix}"

    @property
    def layout(self) -> list[tuple[str, Shape]]:
        return {"pt": pt_layout, "dcp": dcp_layout, "hf": hf_layout}[self.kind](self.cols)

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

    def files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        return sorted(p for p in self.path.iterdir() if p.is_file())

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files()) if self.path.exists() else 0

    def looks_complete(self) -> bool:
        # the generator renames a finished .tmp into place; the size checks the rest:
        # tensor bytes plus headers (zip records ~100 B each, DCP items ~1.5 KiB each)
        if not self.path.exists():
            return False
        items = len(self.layout) * (RANKS if self.kind == "dcp" else 1)
        return self.data_bytes <= self.size() <= self.data_bytes + items * 4096 + 4 * MB


def inputs(quick: bool) -> tuple[Input, Input, Input]:
    """The torch.save file, the DCP directory, the HF shards."""
    if quick:
        return Input("pt", 512), Input("dcp", 128), Input("hf", 64, "32MB")
    return Input("pt", 2048), Input("dcp", 1024), Input("hf", 512, "250MB")


def generate(kind: str, out: str, cols: int, shard: str) -> None:
    """Write one input (in a child process: the bench itself never imports torch)."""
    import warnings

    warnings.filterwarnings("ignore")
    tmp = out + ".tmp"
    remove(Path(tmp))
    if kind == "dcp":  # this file again under torchrun: RANKS processes over gloo
        subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                        __file__, "--worker", tmp, str(cols)], check=True)
    else:
        import torch

        g = torch.Generator().manual_seed(0)
        layout = pt_layout(cols) if kind == "pt" else hf_layout(cols)
        sd = {k: torch.randn(s, generator=g) for k, s in layout}
        if kind == "pt":
            torch.save(sd, tmp)
        else:
            from huggingface_hub import save_torch_state_dict

            os.makedirs(tmp)
            save_torch_state_dict(sd, tmp, max_shard_size=shard)
    remove(Path(out))
    os.replace(tmp, out)  # a killed run never leaves a half checkpoint to reuse


def dcp_worker(out: str, cols: int) -> None:
    """One rank of the DCP directory: its rows of every tensor, as DTensors,
    written by WRITER_THREADS threads (a file each)."""
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
    writer = dcp.FileSystemWriter(out, thread_count=WRITER_THREADS)
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def ensure(inp: Input) -> str:
    if inp.looks_complete():
        return "reused"
    WORK.mkdir(parents=True, exist_ok=True)
    # torchrun's banner and the writers' warnings are shown only if it fails
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PY, __file__, "--generate", inp.kind, str(inp.path), str(inp.cols),
                           inp.shard or "-"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"generating {inp.path} failed (exit code {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    if not inp.looks_complete():
        sys.exit(f"generated {inp.path} has an unexpected size ({inp.size()} bytes)")
    return "generated"


def described(inp: Input) -> str:
    files = inp.files()
    what = (f"{len(files)} files ({', '.join(p.name for p in files[:3])}"
            + (", ..." if len(files) > 3 else "") + ")" if len(files) > 1 else "1 file")
    return (f"{inp.path.name}: {inp.size() / MB:.1f} MiB, {what}, {len(inp.layout)} tensors, "
            f"largest {inp.largest / MB:g} MiB")


# --- the commands -----------------------------------------------------------------------------

def verify_cmd(inp: Input, *more: str) -> list[str]:
    return ckptool_cmd("verify", str(inp.path), *more)


def manifest_path(inp: Input, what: str) -> Path:
    return WORK / f"{inp.path.name}.{what}.manifest.json"


def expected(inp: Input) -> tuple[int, int]:
    """Tensors and files verify should report."""
    return len(inp.layout), len(inp.files())


def first_checks(inp: Input) -> list[str]:
    """Untimed: verify --json says whole with the expected counts; a manifest
    written lists every file and tensor; the checkpoint verifies against it
    (kept for the timed --manifest runs). Problems, as notes."""
    tensors, files = expected(inp)
    notes = []
    run = measure(verify_cmd(inp, "--json"), capture=True)
    try:
        data = json.loads(run.out[run.out.find("{"):])
    except ValueError:
        data = {}
    if run.rc != 0 or not data.get("ok") or data.get("tensors") != tensors \
            or len(data.get("files", [])) != files:
        notes.append(f"verify --json of {inp.path.name}: exit code {run.rc}, ok "
                     f"{data.get('ok')}, {data.get('tensors')} tensors (expected {tensors}), "
                     f"{len(data.get('files', []))} files (expected {files}); "
                     + (json.dumps(data.get("problems"))[:300] if data else run.out[-300:]))
    kept = manifest_path(inp, "kept")
    run = measure(verify_cmd(inp, "--write-manifest", str(kept), "-q"), capture=True)
    try:
        doc = json.loads(kept.read_text())
    except (OSError, ValueError) as exc:
        return [*notes, f"--write-manifest: exit code {run.rc}, no manifest ({exc}): "
                        f"{run.out[-300:]}"]
    if len(doc.get("files", {})) != files or len(doc.get("tensors", {})) != tensors:
        notes.append(f"manifest of {inp.path.name}: {len(doc.get('files', {}))} files, "
                     f"{len(doc.get('tensors', {}))} tensors (expected {files}, {tensors})")
    run = measure(verify_cmd(inp, "--manifest", str(kept), "-q"), capture=True)
    if run.rc != 0:
        notes.append(f"verify --manifest of {inp.path.name}: exit code {run.rc} "
                     f"{run.out[-300:]}")
    return notes


Commands = dict[str, tuple[list[str], Path | None]]


def openssl(files: list[str]) -> Commands:
    """OpenSSL's sha256 (SHA-NI where the CPU has it; GNU sha256sum uses its own
    code unless built with OpenSSL): the fastest sha256 a user has at hand."""
    return {"openssl": ([OPENSSL, "dgst", "-sha256", *files], None)} if OPENSSL else {}


def openssl_rows(runs: dict[str, list[Run]], manifest: str, bad: bool) -> list[Row]:
    """The manifest's run against openssl's sha256, where there is one."""
    if "openssl" not in runs:
        return []
    ssl = runs["openssl"]
    return [Row("openssl dgst -sha256 (same files)", spread(ssl), notes=check_rc(ssl, "openssl")),
            ratio_row("    --write-manifest / openssl", runs[manifest], ssl, MANIFEST_SHA_MAX,
                      False, bad)]


def timed(commands: Commands, rounds: int) -> dict[str, list[Run]]:
    """One untimed run of each (warm .pyc, libraries, page cache), then the
    rounds, alternating."""
    for cmd, out in commands.values():
        measure(cmd)
        if out is not None:
            remove(out)
    return timed_rounds(commands, rounds)


def rss_mb(runs: list[Run]) -> float:
    return max(r.maxrss_kb for r in runs) / 1024


def timing_row(case: str, runs: list[Run], what: str, rss: bool = True) -> Row:
    notes = check_rc(runs, what)
    if rss:
        notes.append(f"peak RSS {rss_mb(runs):.0f} MB")
    return Row(case, spread(runs), notes=notes)


def ratio_row(case: str, runs: list[Run], base: list[Run], limit: float,
              judged: bool, bad: bool) -> Row:
    """``runs`` over ``base``, fastest runs (medians beside), against ``limit``:
    PASS/FAIL where ``judged``, else shown beside the bound only."""
    ratio = best(runs) / best(base)
    target = f"<= {limit:g}x" if judged else f"({limit:g}x as (a)/(b))"
    return Row(case, f"fastest runs; medians give {med(runs) / med(base):.2f}x",
               times(ratio, limit), target,
               (not bad and ratio <= limit) if judged else None)


def rss_row(inp: Input, runs: dict[str, list[Run]], names: list[str]) -> Row:
    worst = max(names, key=lambda n: rss_mb(runs[n]))
    peak = rss_mb(runs[worst])
    limit = inp.largest / MB + RSS_HEADROOM_MB
    return Row(f"(c) peak RSS, every verify run of {inp.kind}", f"{peak:.0f} MB ({worst})",
               f"{peak / (inp.largest / MB):.2f}x largest",
               f"<= {inp.largest / MB:g} + {RSS_HEADROOM_MB:g} MB", peak <= limit,
               ["per command: " + ", ".join(f"{n} {rss_mb(runs[n]):.0f}" for n in names)])


def bench_file(inp: Input, rounds: int) -> list[Row]:
    path = str(inp.path)
    written = manifest_path(inp, "timed")
    kept = manifest_path(inp, "kept")
    commands: Commands = {
        "cat": (["cat", path], None),
        "sha256sum": (["sha256sum", path], None),
        **openssl([path]),
        "verify": (verify_cmd(inp, "-q"), None),
        "write-manifest": (verify_cmd(inp, "--write-manifest", str(written), "-q"), written),
        "manifest": (verify_cmd(inp, "--manifest", str(kept), "-q"), None),
        "values": (verify_cmd(inp, "--values", "-q"), None),
        "import torch": ([PY, "-c", "import torch"], None),  # --values imports it
    }
    checked = first_checks(inp)
    runs = timed(commands, rounds)
    bad = bool(checked) or any(r.rc != 0 for v in runs.values() for r in v)
    cat, sha = runs["cat"], runs["sha256sum"]
    verifies = ["verify", "write-manifest", "manifest", "values"]
    return [
        Row(f"torch.save file {inp.label}: cat FILE > /dev/null", spread(cat),
            notes=check_rc(cat, "cat") + checked),
        Row("sha256sum FILE", spread(sha), notes=check_rc(sha, "sha256sum")),
        timing_row("verify FILE -q", runs["verify"], "verify"),
        ratio_row("(a) verify -q / cat", runs["verify"], cat, VERIFY_CAT_MAX, True, bad),
        timing_row("verify FILE --write-manifest M -q", runs["write-manifest"],
                   "--write-manifest"),
        ratio_row("(b) --write-manifest / sha256sum", runs["write-manifest"], sha,
                  MANIFEST_SHA_MAX, True, bad),
        *openssl_rows(runs, "write-manifest", bad),
        timing_row("verify FILE --manifest M -q", runs["manifest"], "--manifest"),
        ratio_row("    --manifest / sha256sum", runs["manifest"], sha, MANIFEST_SHA_MAX,
                  False, bad),
        timing_row("verify FILE --values -q", runs["values"], "--values"),
        ratio_row("    --values / cat", runs["values"], cat, VERIFY_CAT_MAX, False, bad),
        timing_row("python -c 'import torch' (in --values)", runs["import torch"],
                   "import torch", rss=False),
        rss_row(inp, runs, verifies),
    ]


def bench_dir(inp: Input, rounds: int) -> list[Row]:
    files = [str(p) for p in inp.files()]
    written = manifest_path(inp, "timed")
    commands: Commands = {
        "cat": (["cat", *files], None),
        "sha256sum": (["sha256sum", *files], None),
        **openssl(files),
    }
    for jobs in ("1", "2"):
        commands[f"verify -j{jobs}"] = (verify_cmd(inp, "--jobs", jobs, "-q"), None)
        commands[f"write-manifest -j{jobs}"] = (
            verify_cmd(inp, "--jobs", jobs, "--write-manifest", str(written), "-q"), written)
    checked = first_checks(inp)
    runs = timed(commands, rounds)
    bad = bool(checked) or any(r.rc != 0 for v in runs.values() for r in v)
    cat, sha = runs["cat"], runs["sha256sum"]
    name = {"dcp": f"DCP dir ({RANKS} ranks)", "hf": "HF safetensors shards"}[inp.kind]
    rows = [Row(f"{name} {inp.label}: cat {len(files)} files", spread(cat),
                notes=check_rc(cat, "cat") + checked),
            Row(f"sha256sum {len(files)} files", spread(sha), notes=check_rc(sha, "sha256sum"))]
    for jobs in ("1", "2"):
        v, m = runs[f"verify -j{jobs}"], runs[f"write-manifest -j{jobs}"]
        rows += [timing_row(f"verify DIR --jobs {jobs} -q", v, "verify"),
                 ratio_row(f"    verify --jobs {jobs} / cat", v, cat, VERIFY_CAT_MAX, False,
                           bad),
                 timing_row(f"verify DIR --jobs {jobs} --write-manifest M -q", m,
                            "--write-manifest"),
                 ratio_row(f"    --write-manifest --jobs {jobs} / sha256sum", m, sha,
                           MANIFEST_SHA_MAX, False, bad)]
    rows += openssl_rows(runs, "write-manifest -j2", bad)
    return [*rows, rss_row(inp, runs, [n for n in runs if n.startswith(("verify", "write"))])]


# where the time of --write-manifest goes, in one child (for a failing (a) or (b))
BREAKDOWN = """\
import json, sys, time
from ckptool.read.reader import open_checkpoint
from ckptool.check.verify import manifest, filehash
from ckptool.check.verify.structure import check, default_jobs
path, jobs = sys.argv[1], default_jobs()
out = {}
t = time.perf_counter(); report = check(path, jobs); out["verify -q: open + structure + CRC"] \
= time.perf_counter() - t
t = time.perf_counter(); ckpt = open_checkpoint(path); out["open_checkpoint alone"] \
= time.perf_counter() - t
paths = {n: filehash.root_of(ckpt) + "/" + n for n in filehash.files_of(ckpt)}
t = time.perf_counter()
with filehash.Hashing(paths, jobs) as h:
    [h.result(n) for n in paths]
out["sha256 of the file(s) alone"] = time.perf_counter() - t
t = time.perf_counter(); manifest.tensor_entries(ckpt); out["tensor digests alone"] \
= time.perf_counter() - t
t = time.perf_counter(); manifest.build_manifest(ckpt, jobs); out["both, as verify builds " \
"them (files hashed on threads while the tensors are digested)"] = time.perf_counter() - t
print(json.dumps(out))
"""


def breakdown(inp: Input) -> list[str]:
    proc = subprocess.run([PY, "-c", BREAKDOWN, str(inp.path)], capture_output=True,
                          text=True)
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [f"  the breakdown failed: {(proc.stderr or proc.stdout).strip()[-400:]}"]
    return [f"  {v:6.2f} s  {k}" for k, v in data.items()]


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench(quick: bool, rounds: int, source: bool, explain: bool
          ) -> tuple[list[Row], list[str], list[str]]:
    pt, dcp, hf = inputs(quick)
    log = [f"machine at the start: {load()} (uptime: "
           f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()})"]
    for inp in (pt, dcp, hf):
        how = ensure(inp)
        log.append(f"{described(inp)} ({how})")
    log.append(which_ckptool(source, "vf_source"))
    for inp in (pt, dcp, hf):
        warm(inp.path)
    rows: list[Row] = []
    for name, run in (("torch.save file", lambda: bench_file(pt, rounds)),
                      ("DCP directory", lambda: bench_dir(dcp, rounds)),
                      ("HF shards", lambda: bench_dir(hf, rounds))):
        try:  # each on its own: one that breaks leaves the others measured
            rows += run()
        except Exception as exc:  # reported as that part's failure
            rows.append(Row(f"{name} not measured", "the bench broke", "", "", False,
                            [f"{type(exc).__name__}: {exc}"]))
    diag = []
    failed = any(r.ok is False for r in rows if r.case[:3] in ("(a)", "(b)"))
    for inp in (pt, dcp, hf) if explain else (pt,) if failed else ():
        diag += [f"where the time goes, one child process on {inp.path.name} (in-process, "
                 "after imports):", *breakdown(inp)]
    diag.append(f"machine at the end: {load()}")
    return rows, log, diag


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "~128 MiB inputs, 2 runs each: a smoke run",
                         "keep the generated inputs in bench/_work for faster reruns",
                         "timed runs of each command (5; 2 with --quick)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print where the time goes for every checkpoint, not only for the "
                         "file when (a) or (b) fails")
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
    rounds = args.runs or (2 if args.quick else 5)
    t0 = time.perf_counter()
    try:
        rows, log, diag = bench(args.quick, rounds, args.source, args.breakdown)
    finally:
        for inp in inputs(args.quick):
            for what in ("timed", "kept"):
                remove(manifest_path(inp, what))
        remove(WORK / "vf_source")
    notes = ["warm page cache: every input read fully once and every command run once "
             "untimed (results checked) before timing; each manifest written deleted after "
             "its run",
             f"{rounds} alternating runs per command; ratios of the fastest runs; peak RSS "
             "from os.wait4 (what /usr/bin/time -f %M prints)"]
    code = report(rows, log, diag, notes, args.quick, t0, [])
    if not args.keep:
        for inp in inputs(args.quick):
            remove(inp.path)
    return code


if __name__ == "__main__":
    sys.exit(main())
