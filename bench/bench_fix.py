"""Speed and memory targets of ``ckptool fix``, as ratios against baselines.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_fix.py [--quick] [--keep]

The input is a ~2 GB checkpoint of 2,000 tensors, every storage tagged
``cuda:2``, every key under ``module.``. Targets (measured in this run, on
this machine, warm page cache):

  (a) ``fix --strip-module --to cuda:0 -o OUT`` takes at most 1.2x the time
      of ``cp`` of the same file (to a new path on the same filesystem);
  (b) ... and at most 0.5x the time of a subprocess that does the same with
      torch: ``torch.load(map_location='cpu')``, strip ``module.``,
      ``torch.save``. Retargeting to cuda:0 needs a GPU in torch, so the
      baseline saves on the CPU: the fair equivalent of the rewrite;
  (c) peak RSS of the fix process is at most 300 MB;
  (d) ``fix --in-place`` with the same options takes under 1 s on the 2 GB file;
  (e) ... and about the same on a ~20 MB file with the same 2,000 tensors
      (fastest runs within 1.3x);
  (f) ``convert`` to safetensors takes at most 2x ``cp`` (skipped while the
      installed ckptool has no ``convert`` command);
  (g) the fix of (a) reads each byte of its input once and writes each byte
      of its output once: at most 1.1x the file read (through system calls,
      ``rchar`` of ``/proc/self/io``, plus what it maps to read, which
      ``rchar`` does not see) and 1.1x the output written (``wchar``),
      counted in one more, untimed, run.

(a), (b), (e) and (f) are judged on the fastest run of each side, as in
bench_inspect.py (the median ratio is printed beside it); (d) is the one
absolute time, as the target states it. ``ckptool fix`` CRC-checks every
byte as it writes it (from the bytes written: nothing is read back); ``cp``
and ``torch.save`` check nothing. Neither ``fix`` nor ``cp`` waits for the
disk on a new file; ``fix --fsync`` does, and its row is compared with
``cp`` + ``sync FILE`` (no target: what durability costs).

Runs alternate between the commands, every output is deleted (untimed)
right after its run, and each ``--in-place`` run gets a fresh, fsynced copy
of its input (untimed): at most three 2 GB files exist at once. ckptool runs
as installed (from outside the source tree, byte-compiled); a line says
whether the installed copy matches the source tree. Files are generated
under ``bench/_work/`` (gitignored) and reused by later runs; they are
deleted at the end unless ``--keep``. Exit code 0 if every target passes, 1
otherwise; a failing (a), (b) or (c) prints a profile of one fix run.
"""

from __future__ import annotations

import argparse
import compileall
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_inspect import (
    MB,
    PY,
    ROOT,
    RUN_DIR,
    WORK,
    Row,
    Run,
    Spec,
    best,
    check_rc,
    ensure,
    measure,
    med,
    report,
    spread,
    warm,
)

LAYERS = 1000  # a weight and a bias each: 2,000 tensors

CP_MAX = 1.2  # (a)
TORCH_MAX = 0.5  # (b)
RSS_MAX_MB = 300.0  # (c)
IN_PLACE_MAX_S = 1.0  # (d)
IN_PLACE_GROWTH_MAX = 1.3  # (e)
CONVERT_MAX = 2.0  # (f)
ONCE_MAX = 1.1  # (g): bytes read (written) per byte of the file (of the output)

FIX_OPTS = ["--strip-module", "--to", "cuda:0"]

# the torch way of doing the same rewrite, timed as a whole process; the
# phases inside it are reported too
TORCH_FIX = """\
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
sd = torch.load(sys.argv[1], map_location="cpu")
t2 = time.perf_counter()
new = {k.removeprefix("module."): v for k, v in sd.items()}
torch.save(new, sys.argv[2])
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "save": t3 - t2}))
"""


# ckptool run as ``python -m ckptool``, counting what it reads and writes: the
# bytes of its system calls (/proc/self/io) and the bytes it maps (mmap, which
# rchar misses), printed as JSON on stderr once the command is done (ckptool's
# CLI runs atexit handlers before it exits)
COUNT_IO = """\
import atexit, json, mmap, os, runpy, sys
mapped = [0]
class CountingMap(mmap.mmap):
    def __new__(cls, *args, **kwargs):
        window = super().__new__(cls, *args, **kwargs)
        mapped[0] += len(window)
        return window
mmap.mmap = CountingMap
def report():
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    sys.stderr.write("\\n" + json.dumps({"rchar": int(io["rchar"]), "mapped": mapped[0],
                                         "wchar": int(io["wchar"])}) + "\\n")
    sys.stderr.flush()
atexit.register(report)
sys.argv = ["ckptool", *sys.argv[1:]]
runpy.run_module("ckptool", run_name="__main__", alter_sys=True)
"""


def make_spec(label: str, dim: int) -> Spec:
    """bench_inspect's file spec, under this bench's own file name."""
    return Spec(label, dim, "fix_{tensors}t_d{dim}_cuda2.pth")


def generate(path: str, dim: int) -> None:
    """Write the checkpoint in a child process: the bench never imports torch."""
    import torch
    import torch.serialization as ser

    sd = {}
    for i in range(LAYERS):  # distinct values, cheap to make
        sd[f"module.layers.{i}.proj.weight"] = torch.full((dim, dim), float(i))
        sd[f"module.layers.{i}.proj.bias"] = torch.full((dim,), -float(i))
    orig = ser.location_tag
    ser.location_tag = lambda storage: "cuda:2"  # every storage, as from a 4-GPU box
    try:
        tmp = path + ".tmp"
        torch.save(sd, tmp)
        os.replace(tmp, path)  # a killed run never leaves a half file to reuse
    finally:
        ser.location_tag = orig


def specs(quick: bool) -> tuple[Spec, Spec]:
    """(small, large): in-place runs on both, everything else on the large one."""
    if quick:
        return make_spec("~2 MB", 22), make_spec("~200 MB", 224)
    return make_spec("~20 MB", 70), make_spec("~2 GB", 724)


def fix_cmd(src: Path, out: Path, *more: str) -> list[str]:
    return [PY, "-m", "ckptool", "fix", str(src), *FIX_OPTS, "-o", str(out), "-q", *more]


def in_place_cmd(path: Path) -> list[str]:
    return [PY, "-m", "ckptool", "fix", str(path), "--in-place", *FIX_OPTS, "-q"]


def installed_state() -> str:
    """Whether the installed ckptool (what the bench measures) is the source tree's."""
    import ckptool  # the bench's own interpreter: no torch, just the path

    installed = Path(ckptool.__file__).parent
    if installed.resolve() == (ROOT / "ckptool").resolve():
        return "ckptool imported from the source tree (not installed): measuring that"
    source = ROOT / "ckptool"
    differ = []
    for path in sorted(source.rglob("*.py")):
        rel = path.relative_to(source)
        theirs = installed / rel
        if not theirs.exists() or not filecmp.cmp(path, theirs, shallow=False):
            differ.append(str(rel))
    if not differ:
        return f"installed ckptool ({installed}) matches the source tree"
    return (f"WARNING: installed ckptool ({installed}) differs from the source tree in "
            f"{', '.join(differ)}; figures are for the installed copy "
            "(reinstall: make bench, or pip install --no-deps .)")


def has_convert() -> bool:
    proc = subprocess.run([PY, "-m", "ckptool", "convert", "--help"], cwd=RUN_DIR,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc.returncode == 0


def fresh_copy(src: Path, dst: Path) -> None:
    """An untimed copy of ``src``, on disk (fsynced): an in-place run's fsync
    must not pay for writing back the copy the bench just made."""
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inspect_json(path: Path) -> dict[str, object]:
    proc = subprocess.run([PY, "-m", "ckptool", "inspect", "--json", str(path)], cwd=RUN_DIR,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-300:]}
    data = json.loads(proc.stdout)
    return {"prefix": data["main_state_dict"]["prefix"],
            "locations": sorted(data["bytes_by_location"]),
            "num_tensors": data["num_tensors"]}


def sanity(data: dict[str, object], what: str) -> list[str]:
    """The rewrite did what it says: no prefix left, every storage on cuda:0."""
    if data.get("prefix") or data.get("locations") != ["cuda:0"] or (
            data.get("num_tensors") != LAYERS * 2):
        return [f"{what}: unexpected result {data}"]
    return []


def count_io(src: Path, out: Path) -> dict[str, int] | str:
    """What one fix run reads and writes (``COUNT_IO``), or why it is not known."""
    if not Path("/proc/self/io").exists():
        return "no /proc/self/io on this system"
    proc = subprocess.run([PY, "-c", COUNT_IO, *fix_cmd(src, out)[3:]], cwd=RUN_DIR,
                          capture_output=True, text=True)
    size = out.stat().st_size if out.exists() else 0
    out.unlink(missing_ok=True)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    counts: dict[str, int] = json.loads(proc.stderr.strip().splitlines()[-1])
    counts["output"] = size
    return counts


# one fix under cProfile (``python -m cProfile -m ckptool`` prints nothing:
# ckptool's CLI ends with os._exit), its main thread's functions by own time
PROFILE_FIX = """\
import cProfile, pstats, sys
from ckptool.cli.main import main
profile = cProfile.Profile()
profile.enable()
main(sys.argv[1:])
profile.disable()
pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)
"""


def profile_fix(src: Path, out: Path, n: int = 15) -> list[str]:
    """Where one fix run spends its time (cProfile, own time per function of
    the main thread: the copy's threads show as the time it waits for them),
    for a failing target."""
    proc = subprocess.run([PY, "-c", PROFILE_FIX, *fix_cmd(src, out)[3:]],
                          cwd=RUN_DIR, capture_output=True, text=True)
    out.unlink(missing_ok=True)
    lines = proc.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return lines[start:start + n + 1]


def timed_loop(commands: dict[str, tuple[list[str], Path | None]], rounds: int,
               check: Callable[[str, Path], None] | None = None) -> dict[str, list[Run]]:
    """Every command ``rounds`` times, in an order that rotates each round so
    that drift on a shared machine hits every command; outputs are deleted
    (untimed) after each run."""
    names = list(commands)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            cmd, out = commands[name]
            runs[name].append(measure(cmd, capture=name == "torch"))
            if out is not None:
                if check is not None and i == 0 and out.exists():
                    check(name, out)
                out.unlink(missing_ok=True)
    return runs


def bench(quick: bool) -> tuple[list[Row], list[str], list[str]]:
    small, large = specs(quick)
    # in-place runs are sub-second: more of them, or noise decides (e)
    rounds, in_place_rounds = (2, 2) if quick else (3, 7)
    log = []
    for spec in (small, large):
        how = ensure(spec, __file__)
        log.append(f"{spec.path.relative_to(ROOT)}: {spec.path.stat().st_size / MB:.1f} MiB, "
                   f"{LAYERS * 2} tensors, all cuda:2, keys under module. ({how})")
    import ckptool

    compileall.compile_dir(Path(ckptool.__file__).parent, quiet=1)
    log.append(installed_state())
    src = large.path
    out = WORK / "fix_out.pth"
    out_st = WORK / "fix_out.safetensors"
    copy = WORK / "fix_in_place.pth"
    for path in (out, out_st, copy):
        path.unlink(missing_ok=True)
    for spec in (small, large):
        warm(spec.path)
    convert = has_convert()
    bare_cmd = [PY, "-c", "pass"]
    # one untimed run of the Python commands on the small file: .pyc files,
    # torch's shared libraries
    for cmd in (bare_cmd, fix_cmd(small.path, out),
                [PY, "-c", TORCH_FIX, str(small.path), str(out)]):
        measure(cmd)
        out.unlink(missing_ok=True)
    if convert:
        measure([PY, "-m", "ckptool", "convert", str(small.path), str(out_st), "-q"])
        out_st.unlink(missing_ok=True)

    commands: dict[str, tuple[list[str], Path | None]] = {
        "cp": (["cp", str(src), str(out)], out),
        "cp+sync": (["sh", "-c", 'cp "$1" "$2" && sync "$2"', "sh", str(src), str(out)], out),
        "fix": (fix_cmd(src, out), out),
        "fix+fsync": (fix_cmd(src, out, "--fsync"), out),
        "torch": ([PY, "-c", TORCH_FIX, str(src), str(out)], out),
        "bare": (bare_cmd, None),
    }
    if convert:
        commands["convert"] = (
            [PY, "-m", "ckptool", "convert", str(src), str(out_st), "-q"], out_st)
    checked: dict[str, list[str]] = {}

    def check(name: str, path: Path) -> None:
        if name == "fix":
            checked["fix"] = sanity(inspect_json(path), "fix output")

    runs = timed_loop(commands, rounds, check)
    io = count_io(src, out)

    # --in-place: a fresh copy before each run, small and large alternating
    ip: dict[str, list[Run]] = {"small": [], "large": []}
    ip_notes: list[str] = []
    for i in range(in_place_rounds):
        order = [("small", small), ("large", large)]
        for key, spec in (order if i % 2 == 0 else order[::-1]):
            fresh_copy(spec.path, copy)
            size = copy.stat().st_size
            ip[key].append(measure(in_place_cmd(copy), capture=True))
            if i == 0:
                ip_notes += sanity(inspect_json(copy), f"in-place {spec.label}")
                grew = copy.stat().st_size - size
                ip_notes.append(f"{spec.label}: the file grew by {grew / 1024:.0f} KiB "
                                "(new pickle + central directory appended)")
            copy.unlink()

    cp, cps, fx, th = runs["cp"], runs["cp+sync"], runs["fix"], runs["torch"]
    fxs = runs["fix+fsync"]
    inner = [json.loads(r.out.strip().splitlines()[-1]) for r in th if r.rc == 0]
    fix_notes = check_rc(fx, "fix") + checked.get("fix", [])
    rows = [
        Row("python -c pass (startup floor)", spread(runs["bare"])),
        Row(f"cp {large.label}", spread(cp), notes=check_rc(cp, "cp")),
        Row(f"cp + sync FILE {large.label}", spread(cps), notes=check_rc(cps, "cp+sync")),
        Row(f"fix {' '.join(FIX_OPTS)} -o", spread(fx), notes=fix_notes),
        Row("torch.load + strip + torch.save (CPU)", spread(th), notes=check_rc(th, "torch")),
    ]
    torch_row = rows[-1]
    if inner:
        rows.append(Row("  inside it: import / load / save",
                        " / ".join(f"{statistics.median(d[k] for d in inner):.2f} s"
                                   for k in ("import", "load", "save"))))
    if convert:
        rows.append(Row("convert -> .safetensors", spread(runs["convert"]),
                        notes=check_rc(runs["convert"], "convert")))
    fix_ok = not fix_notes
    r_cp = best(fx) / best(cp)
    rows.append(Row("(a) fix / cp", f"fastest runs; medians give {med(fx) / med(cp):.2f}x",
                    f"{r_cp:.2f}x", f"<= {CP_MAX:g}x", fix_ok and r_cp <= CP_MAX))
    rows.append(Row("fix --fsync / (cp + sync FILE)", spread(fxs),
                    f"{best(fxs) / best(cps):.2f}x", notes=check_rc(fxs, "fix --fsync")))
    r_torch = best(fx) / best(th)
    rows.append(Row("(b) fix / torch.load+save", f"fastest runs; medians give "
                    f"{med(fx) / med(th):.2f}x", f"{r_torch:.2f}x", f"<= {TORCH_MAX:g}x",
                    fix_ok and not torch_row.notes and r_torch <= TORCH_MAX,
                    ["torch saves on the CPU: a retarget to cuda:0 would need a GPU"]))
    rss = max(r.maxrss_kb for r in fx) / 1024
    torch_rss = max(r.maxrss_kb for r in th) / 1024
    floor = max(r.maxrss_kb for r in runs["bare"]) / 1024
    rows.append(Row(f"(c) peak RSS fix {large.label}", f"{rss:.0f} MB (max of {len(fx)})",
                    f"{rss / torch_rss:.3f}x torch", f"<= {RSS_MAX_MB:g} MB",
                    fix_ok and rss <= RSS_MAX_MB,
                    [f"torch.load+save peak {torch_rss:.0f} MB; python -c pass {floor:.0f} MB"]))
    ip_ok = not (check_rc(ip["small"], "in-place") or check_rc(ip["large"], "in-place")
                 or any("unexpected" in n for n in ip_notes))
    rows.append(Row(f"--in-place {small.label}", spread(ip["small"]),
                    notes=check_rc(ip["small"], "in-place")))
    rows.append(Row(f"(d) --in-place {large.label}", spread(ip["large"]),
                    f"{best(ip['large']):.3f} s", f"< {IN_PLACE_MAX_S:g} s",
                    ip_ok and best(ip["large"]) < IN_PLACE_MAX_S,
                    check_rc(ip["large"], "in-place") + ip_notes))
    growth = best(ip["large"]) / best(ip["small"])
    rows.append(Row(f"(e) --in-place {large.label} / {small.label}",
                    f"medians give {med(ip['large']) / med(ip['small']):.2f}x",
                    f"{growth:.2f}x", f"within {IN_PLACE_GROWTH_MAX:g}x",
                    ip_ok and max(growth, 1 / growth) <= IN_PLACE_GROWTH_MAX))
    if convert:
        cv = runs["convert"]
        r_cv = best(cv) / best(cp)
        rows.append(Row("(f) convert / cp", f"fastest runs; medians give "
                        f"{med(cv) / med(cp):.2f}x", f"{r_cv:.2f}x", f"<= {CONVERT_MAX:g}x",
                        not check_rc(cv, "convert") and r_cv <= CONVERT_MAX))
    else:
        rows.append(Row("(f) convert / cp", "not built yet: skipped", "",
                        f"<= {CONVERT_MAX:g}x"))
    rows.append(once_row(io, src.stat().st_size))
    diag = []
    if any(r.ok is False for r in rows if r.case[:3] in ("(a)", "(b)", "(c)")):
        diag = [f"where one fix run spends its time ({large.label}, cProfile, own time):"]
        diag += ["  " + line for line in profile_fix(src, out)]
    return rows, log, diag


def once_row(io: dict[str, int] | str, size: int) -> Row:
    """(g): bytes read per byte of the file, bytes written per byte of the output."""
    case = "(g) fix: bytes read / written"
    if isinstance(io, str):
        return Row(case, "not counted", target=f"<= {ONCE_MAX:g}x each", ok=False, notes=[io])
    read = (io["rchar"] + io["mapped"]) / size
    written = io["wchar"] / max(io["output"], 1)
    return Row(case, f"{(io['rchar'] + io['mapped']) / MB:.0f} MiB / {io['wchar'] / MB:.0f} MiB",
               f"{read:.2f}x / {written:.2f}x", f"<= {ONCE_MAX:g}x each",
               read <= ONCE_MAX and written <= ONCE_MAX,
               [f"read: {io['rchar'] / size:.2f}x through system calls + "
                f"{io['mapped'] / size:.2f}x mapped, of the file; written: of the output"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller files (~2 MB / ~200 MB) and fewer runs: a smoke run")
    ap.add_argument("--keep", action="store_true",
                    help="keep the generated checkpoints in bench/_work for faster reruns")
    ap.add_argument("--generate", nargs=2, metavar=("PATH", "DIM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.generate:
        generate(args.generate[0], int(args.generate[1]))
        return 0
    t0 = time.perf_counter()
    try:
        rows, log, diag = bench(args.quick)
    finally:
        for name in ("fix_out.pth", "fix_out.safetensors", "fix_in_place.pth"):
            (WORK / name).unlink(missing_ok=True)
    notes = ["warm page cache: each input read fully once, each Python command run once "
             "untimed (on the small file) before timing",
             "fix CRC-checks every byte as it writes it (nothing read back); cp and "
             "torch.save check nothing; only fix --fsync and cp + sync wait for the disk"]
    cleanup = [] if args.keep else [spec.path for spec in specs(args.quick)]
    return report(rows, log, diag, notes, args.quick, t0, cleanup)


if __name__ == "__main__":
    sys.exit(main())
