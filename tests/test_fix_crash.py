"""Crash safety of ``ckptool fix``: what a ``kill -9`` leaves, at many moments.

(a) A real ``fix -o OUT`` of a ~200 MB checkpoint is killed (SIGKILL) at
    moments chosen by watching it through ``/proc``: while it reads, once its
    temporary file is open, at 10/50/90% of the write (the temporary file's
    size), once the write is complete (verification), after the
    rename, and at a few seeded random times. After each kill OUT is absent
    or byte-identical to an undisturbed run's output (and torch.load gives
    the expected tensors), the input is unchanged, and the directory holds
    nothing else but, at most, a complete temporary file (a kill between
    link and rename). The same with the named temporary file used where
    ``O_TMPFILE`` is missing (``CKPTOOL_NO_TMPFILE=1``): there a kill during
    the write leaves its dot-file behind, which nothing can clean up after
    SIGKILL; the target path stays absent-or-complete.
(b) ``fix --in-place`` (metadata only) dies at each named step
    (``CKPTOOL_TEST_CRASH_AT``) and at random moments of a real run on a
    2,000-tensor file; the file then loads (torch.load, with and without
    mmap, and ckptool.open) as exactly the old or exactly the new checkpoint.
(c) Failed runs leave no output and no stray files, with the documented
    exit codes.

Run with ``-s`` to see what each kill observed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import saved_on

import ckptool
from ckptool.errors import CorruptCheckpointError
from ckptool.write import verify
from ckptool.write.fix import run as fix
from ckptool.write.fix.plan import FixOptions

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
TMP_SUFFIX = ".ckptool-tmp"
PROC = Path("/proc/self/fd")

pytestmark = pytest.mark.skipif(not PROC.is_dir() or not hasattr(os, "wait4"),
                                reason="watches the child process through /proc (Linux)")

BIG_TENSORS = 200
BIG_NUMEL = 256 * 1024  # 1 MiB of float32 each: ~200 MiB in all
SMALL_TENSORS = 2000  # many tensors: a big pickle and central directory
SMALL_NUMEL = 64


# --- helpers -----------------------------------------------------------------

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(1 << 20)
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def make_checkpoint(path: Path, tensors: int, numel: int) -> dict[str, torch.Tensor]:
    """A DataParallel-style state dict saved "on cuda:2"; returns the tensors by
    their fixed (unprefixed) names."""
    gen = torch.Generator().manual_seed(tensors)
    sd = {f"module.layers.{i}.weight": torch.randn(numel, generator=gen)
          for i in range(tensors)}
    with saved_on("cuda:2"):
        torch.save(sd, path)
    return {k.removeprefix("module."): v for k, v in sd.items()}


# put first on the child's path: the rename into place waits a little, so
# that the moments between the last write and the rename (a few ms now that
# nothing is read back) are there to be hit on a busy machine too
SLOW_COMMIT = """\
from ckptool.write import commit as _commit
import time as _time
_real = _commit.AtomicOutput.commit
def _slow(self):
    _time.sleep(0.3)
    return _real(self)
_commit.AtomicOutput.commit = _slow
"""


def _slow_commit_path() -> str:
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"ckptool-slow-commit-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(SLOW_COMMIT)
    return str(folder)


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("CKPTOOL_TEST_CRASH_AT", "CKPTOOL_NO_TMPFILE")}
    full_env["PYTHONPATH"] = os.pathsep.join([_slow_commit_path(), str(ROOT)])
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "ckptool", *args], cwd=ROOT, env=full_env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def strays(folder: Path, keep: set[str]) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name not in keep)


def torch_tags(path: Path, mmap: bool = False) -> tuple[dict[str, torch.Tensor], set[str]]:
    """What plain torch.load (weights_only, CPU) gives: tensors and storage tags."""
    tags: list[str] = []

    def record(storage: Any, location: str) -> Any:
        tags.append(location)
        return storage

    sd = torch.load(path, map_location=record, mmap=mmap)
    return sd, set(tags)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


@dataclass
class Snapshot:
    """One look at the child: its open files and the target directory."""

    elapsed: float
    input_open: bool = False
    input_rw: bool = False  # the input open for writing (--in-place at work)
    temp_sizes: tuple[int, ...] = ()  # sizes of its open files in the target directory
    names: tuple[str, ...] = ()  # entries of the target directory
    input_size: int = -1


def look(pid: int, src: Path, outdir: Path, t0: float) -> Snapshot:
    snap = Snapshot(time.perf_counter() - t0)
    sizes = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    prefix = f"{outdir}/"
    for fd in fds:
        link_path = f"/proc/{pid}/fd/{fd}"
        try:
            link = os.readlink(link_path)
        except OSError:
            continue
        if link == str(src):
            snap.input_open = True
            try:
                flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1]
                snap.input_rw = int(flags.split()[0], 8) & os.O_ACCMODE == os.O_RDWR
            except (OSError, IndexError, ValueError):
                pass
        elif link.startswith(prefix):
            with contextlib.suppress(OSError):  # closed meanwhile
                sizes.append(os.stat(link_path).st_size)
    snap.temp_sizes = tuple(sizes)
    try:
        snap.names = tuple(sorted(os.listdir(outdir)))
        snap.input_size = src.stat().st_size
    except OSError:
        pass
    return snap


Trigger = Callable[[Snapshot], bool]


@dataclass
class Outcome:
    label: str
    killed: bool
    rc: int | None
    last: Snapshot  # the last look before the kill
    history: list[Snapshot] = field(default_factory=list)


def run_and_kill(args: list[str], src: Path, outdir: Path, trigger: Trigger, label: str,
                 env: dict[str, str] | None = None, keep_history: bool = False,
                 timeout: float = 60.0) -> Outcome:
    """Start ``ckptool ARGS``, look at it as often as possible, SIGKILL it the
    first time ``trigger`` holds; a run that ends first is reported as such."""
    real_src, real_out = Path(os.path.realpath(src)), Path(os.path.realpath(outdir))  # as /proc
    t0 = time.perf_counter()
    proc = spawn(args, env)
    history: list[Snapshot] = []
    snap = Snapshot(0.0)
    killed = False
    try:
        while proc.poll() is None:  # the child is not reaped: its pid stays ours
            snap = look(proc.pid, real_src, real_out, t0)
            if keep_history:
                history.append(snap)
            if trigger(snap):
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
                break
            if snap.elapsed > timeout:
                raise AssertionError(f"{label}: ckptool still running after {timeout} s")
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    if killed:
        killed = rc == -signal.SIGKILL  # else it had already exited on its own
    if not killed:
        assert rc == 0, f"{label}: ckptool failed ({rc}): {err}"
    return Outcome(label, killed, rc, snap, history)


def at_time(t: float) -> Trigger:
    return lambda s: s.elapsed >= t


def after(cond: Trigger, delay: float) -> Trigger:
    """Fires ``delay`` seconds after ``cond`` first held."""
    first: list[float] = []

    def trigger(s: Snapshot) -> bool:
        if not first and cond(s):
            first.append(s.elapsed)
        return bool(first) and s.elapsed >= first[0] + delay
    return trigger


# --- (a) kill -9 during `fix -o OUT` -----------------------------------------

@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tmp_path_factory.mktemp("big_in") / "big.pth"
    expected = make_checkpoint(src, BIG_TENSORS, BIG_NUMEL)
    return src, expected


@dataclass
class Reference:
    """An undisturbed run, looked at as closely as the killed ones."""

    digest: str
    size: int
    t_temp: float  # temporary file first seen
    t_written: float  # temporary file at its final size
    t_committed: float  # OUT first seen
    t_end: float
    looks: int


def reference_run(src: Path, outdir: Path, env: dict[str, str]) -> Reference:
    out = outdir / "out.pth"
    res = run_and_kill(fix_args(src, out), src, outdir, lambda s: False, "reference", env,
                       keep_history=True)
    size = out.stat().st_size
    hist = res.history

    def first(cond: Trigger) -> float:
        return next((s.elapsed for s in hist if cond(s)), float("nan"))

    ref = Reference(sha256(out), size, first(lambda s: bool(s.temp_sizes)),
                    first(lambda s: max(s.temp_sizes, default=0) >= size),
                    first(lambda s: "out.pth" in s.names), hist[-1].elapsed if hist else 0.0,
                    len(hist))
    out.unlink()
    return ref


def has_o_tmpfile(folder: Path) -> bool:
    try:
        os.close(os.open(folder, getattr(os, "O_TMPFILE", 0) | os.O_RDWR, 0o600))
    except (OSError, ValueError):
        return False
    return hasattr(os, "O_TMPFILE")


def fix_args(src: Path, out: Path) -> list[str]:
    return ["fix", str(src), "--strip-module", "--to", "cpu", "-o", str(out), "-q"]


def kill_points(ref: Reference, seed: int, randoms: int) -> list[tuple[str, Trigger]]:
    size = ref.size

    def writing(frac: float) -> Trigger:
        return lambda s: max(s.temp_sizes, default=0) >= frac * size

    written = writing(1.0)
    commit_gap = max(ref.t_committed - ref.t_written, 0.01)
    rng = random.Random(seed)
    points: list[tuple[str, Trigger]] = [
        ("reading input", lambda s: s.input_open and not s.temp_sizes),
        ("temp file open", lambda s: bool(s.temp_sizes)),
        ("write 10%", writing(0.10)),
        ("write 50%", writing(0.50)),
        ("write 90%", writing(0.90)),
        ("write complete", written),
        ("verify/fsync (+50%)", after(written, 0.5 * commit_gap)),
        ("verify/fsync (+90%)", after(written, 0.9 * commit_gap)),
        ("OUT appeared", lambda s: "out.pth" in s.names),
        ("link window (named temp seen)", lambda s: any(n.endswith(TMP_SUFFIX)
                                                        for n in s.names)),
    ]
    for _ in range(randoms):
        t = rng.uniform(0.0, ref.t_end)
        points.append((f"random t={t:.3f}s", at_time(t)))
    return points


def check_after_kill(res: Outcome, src: Path, src_digest: str, outdir: Path,
                     expected: dict[str, torch.Tensor], ref: Reference,
                     named_temp: bool) -> str:
    out = outdir / "out.pth"
    assert sha256(src) == src_digest, f"{res.label}: the input changed"
    assert os.listdir(src.parent) == [src.name], f"{res.label}: files beside the input"
    lock = outdir / ".out.pth.ckptool.lock"  # the writer's lock: empty, taken by the next
    if lock.exists():
        assert lock.stat().st_size == 0, res.label
    left = strays(outdir, {"out.pth", lock.name})
    for name in left:
        # the only stray ckptool may leave is its own temporary file
        assert name.startswith(".out.pth.") and name.endswith(TMP_SUFFIX), (res.label, left)
        if not named_temp:
            # O_TMPFILE: the file gets a name only after it was verified, so
            # a stray one is always complete
            assert sha256(outdir / name) == ref.digest, (res.label, name)
    assert len(left) <= 1, (res.label, left)
    if out.exists():
        assert out.stat().st_size == ref.size, res.label
        assert sha256(out) == ref.digest, f"{res.label}: OUT is not the complete output"
        sd, tags = torch_tags(out)
        assert tags == {"cpu"}
        assert_same_tensors(sd, expected)
        state = "OUT complete"
    else:
        assert res.killed, f"{res.label}: the run ended but wrote no OUT"
        state = "OUT absent"
    for name in left:
        (outdir / name).unlink()
    if out.exists():
        out.unlink()
    return state + (f", stray {left}" if left else "")


def describe(res: Outcome, ref_size: int) -> str:
    s = res.last
    temp = max(s.temp_sizes, default=0)
    how = "killed" if res.killed else "finished first"
    return (f"{res.label:30} {how:14} at {s.elapsed:6.3f}s  "
            f"temp {100 * temp / ref_size:5.1f}%  dir {list(s.names)}")


@pytest.mark.parametrize("named_temp", [False, True], ids=["o_tmpfile", "named_temp"])
def test_kill_9_during_fix_leaves_nothing_or_the_whole_output(
        big: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, named_temp: bool) -> None:
    src, expected = big
    src_digest = sha256(src)
    outdir = tmp_path / "out"
    outdir.mkdir()
    if not named_temp and not has_o_tmpfile(outdir):
        pytest.skip("this filesystem has no O_TMPFILE: ckptool uses a named temporary file")
    env = {"CKPTOOL_NO_TMPFILE": "1"} if named_temp else {}
    ref = reference_run(src, outdir, env)
    assert strays(outdir, set()) == []
    # the undisturbed output is the expected checkpoint
    points = kill_points(ref, seed=7, randoms=0 if named_temp else 2)
    if named_temp:  # the fallback only needs the moments that differ
        keep = {"write 50%", "write complete", "OUT appeared"}
        points = [p for p in points if p[0] in keep]
    lines = [f"reference: {ref.size / 2**20:.0f} MiB in {ref.t_end:.2f}s; temp at "
             f"{ref.t_temp:.3f}s, written {ref.t_written:.3f}s, OUT {ref.t_committed:.3f}s; "
             f"{ref.looks} looks"]
    states: dict[str, str] = {}
    for label, trigger in points:
        # a loaded machine can run past a moment before the poller sees it:
        # such a run proves nothing about that moment, so it is tried again
        for _ in range(3):  # check_after_kill leaves outdir empty for the next run
            res = run_and_kill(fix_args(src, outdir / "out.pth"), src, outdir, trigger, label,
                               env)
            state = check_after_kill(res, src, src_digest, outdir, expected, ref, named_temp)
            # a kill meant for a moment before the rename that finds OUT already
            # there came too late (the rename follows the last write by ~1 ms)
            overran = label.startswith("write") and "out.pth" in res.last.names
            if (res.killed and not overran) or label.startswith("random") \
                    or label == "OUT appeared":
                break
        states[label] = state if res.killed else "not killed: " + state
        lines.append(f"{describe(res, ref.size)} -> {state}")
    print(f"\n[{'named temp' if named_temp else 'O_TMPFILE'}]\n" + "\n".join(lines))
    # the moments that matter were hit: a kill mid-write left no OUT, one after
    # the rename left the whole file
    assert states["write 50%"].startswith("OUT absent")
    assert states["write complete"].startswith("OUT absent")
    # (a run that exits before the poller sees OUT is "not killed: OUT complete";
    # with a named temporary file, OUT is linked to it, then it is unlinked: a
    # kill between the two leaves it, a second name of the complete OUT)
    appeared = states["OUT appeared"]
    assert appeared.endswith("OUT complete") or (
        named_temp and re.search(r"OUT complete, stray \['\.out\.pth\.[0-9a-f]+\.ckptool-tmp'\]$",
                                 appeared)), appeared
    if not named_temp:
        # anonymous temporary file: a kill before the rename leaves no trace
        for label in ("write 10%", "write 50%", "write 90%", "write complete"):
            assert states[label] == "OUT absent", (label, states[label])
    else:
        # named temporary file: the kill mid-write leaves it (no cleanup runs on SIGKILL)
        assert "stray" in states["write 50%"]


# --- (b) --in-place: named crash points and random SIGKILLs -----------------

@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tmp_path_factory.mktemp("many") / "many.pth"
    expected = make_checkpoint(src, SMALL_TENSORS, SMALL_NUMEL)
    return src, expected


IN_PLACE = ["--in-place", "--strip-module", "--to", "cuda:0", "-q"]


def classify(path: Path, expected: dict[str, torch.Tensor]) -> str:
    """'old' or 'new', the same for torch.load, torch.load(mmap=True) and
    ckptool.open; anything else fails."""
    old = {f"module.{k}": v for k, v in expected.items()}
    seen = []
    for mmap in (False, True):
        sd, tags = torch_tags(path, mmap=mmap)
        if tags == {"cuda:2"}:
            assert_same_tensors(sd, old)
            seen.append("old")
        else:
            assert tags == {"cuda:0"}, tags
            assert_same_tensors(sd, expected)
            seen.append("new")
    ckpt = ckptool.open(path)
    keys = [t.key for t in ckpt.tensors]
    locations = {t.location for t in ckpt.tensors}
    if seen[0] == "old":
        assert (keys, locations) == (list(old), {"cuda:2"})
    else:
        assert (keys, locations) == (list(expected), {"cuda:0"})
    assert seen[0] == seen[1]
    return seen[0]


@pytest.mark.parametrize(("step", "state"), [("tail-copied", "old"),
                                             ("content-written", "old"),
                                             ("committed", "new")])
def test_in_place_crash_points(many: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
                               step: str, state: str) -> None:
    src, expected = many
    path = tmp_path / "model.pth"
    shutil.copyfile(src, path)
    size = path.stat().st_size
    proc = spawn(["fix", str(path), *IN_PLACE], {"CKPTOOL_TEST_CRASH_AT": step})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 137, err.decode()
    assert classify(path, expected) == state
    assert os.listdir(tmp_path) == ["model.pth"]
    assert path.stat().st_size > size  # appended, never rewritten from the start
    if state == "old":  # running the command again finishes the job
        proc = spawn(["fix", str(path), *IN_PLACE])
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert classify(path, expected) == "new"
        assert os.listdir(tmp_path) == ["model.pth"]


def test_in_place_random_kill_9(many: tuple[Path, dict[str, torch.Tensor]],
                                tmp_path: Path) -> None:
    src, expected = many
    path = tmp_path / "model.pth"
    size = src.stat().st_size
    grown: list[int] = []  # sizes seen above the original, this run

    def rw(s: Snapshot) -> bool:
        return s.input_rw

    def shrank(s: Snapshot) -> bool:  # step 3, ftruncate, cuts the copied tail off
        if s.input_size > size:
            grown.append(s.input_size)
        return bool(grown) and 0 < s.input_size < max(grown)

    # an undisturbed run: from opening the file for writing to the commit
    shutil.copyfile(src, path)
    ref = run_and_kill(["fix", str(path), *IN_PLACE], path, tmp_path, lambda s: False,
                       "reference", keep_history=True)
    assert classify(path, expected) == "new"
    end = ref.history[-1].elapsed
    t_rw = next((s.elapsed for s in ref.history if rw(s)), end)
    t_commit = next((s.elapsed for s in ref.history if shrank(s)), end)
    window = max(t_commit - t_rw, 0.002)
    rng = random.Random(11)
    points: list[tuple[str, Trigger]] = [
        ("opened for writing", rw),
        ("file grew (tail copied)", lambda s: s.input_size > size),
        ("file shrank (committed)", shrank),
    ]
    for _ in range(5):
        delay = rng.uniform(0.0, 1.2 * window)
        points.append((f"random +{1000 * delay:.1f} ms after open", after(rw, delay)))
    for _ in range(2):
        t = rng.uniform(0.0, end)
        points.append((f"random t={t:.3f}s", at_time(t)))
    lines = [f"reference: opened for writing at {t_rw:.3f}s, committed {t_commit:.3f}s, "
             f"ended {end:.3f}s; {len(ref.history)} looks"]
    counts = {"old": 0, "new": 0}
    for label, trigger in points:
        grown.clear()
        shutil.copyfile(src, path)
        res = run_and_kill(["fix", str(path), *IN_PLACE], path, tmp_path, trigger, label)
        state = classify(path, expected)
        counts[state] += 1
        assert os.listdir(tmp_path) == ["model.pth"], label
        how = "killed" if res.killed else "finished first"
        lines.append(f"{label:34} {how:14} at {res.last.elapsed:6.3f}s "
                     f"size {res.last.input_size - size:+8d} -> {state}")
        if label == "file shrank (committed)" and res.killed:
            assert state == "new"
    print("\n[--in-place]\n" + "\n".join(lines) + f"\n{counts}")
    assert counts["old"] >= 1 and counts["new"] >= 1


def test_in_place_verification_failure_restores_the_old_file(
        many: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.write.fix import inplace

    src, expected = many
    path = tmp_path / "model.pth"
    shutil.copyfile(src, path)

    def broken(path: str, plan: Any, size: int) -> None:  # (before the commit)
        raise CorruptCheckpointError("simulated verification failure", "")

    monkeypatch.setattr(inplace, "_verify", broken)
    with pytest.raises(CorruptCheckpointError):
        fix.fix(str(path), FixOptions(strip_module=True, to="cuda:0"), in_place=True)
    assert classify(path, expected) == "old"
    assert os.listdir(tmp_path) == ["model.pth"]


# --- (c) failed runs leave nothing -------------------------------------------

@pytest.fixture(params=["o_tmpfile", "named_temp"])
def temp_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "named_temp":
        monkeypatch.setenv("CKPTOOL_NO_TMPFILE", "1")
    else:
        monkeypatch.delenv("CKPTOOL_NO_TMPFILE", raising=False)
    yield request.param


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, Path]:
    """(input, empty output directory)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    src = tmp_path / "in" / "model.pth"
    make_checkpoint(src, 8, 1024)
    return src, tmp_path / "out"


def assert_left_nothing(outdir: Path, src: Path, digest: str,
                        keep: tuple[str, ...] = ()) -> None:
    assert strays(outdir, set(keep)) == []
    assert os.listdir(src.parent) == [src.name]
    assert sha256(src) == digest


def run_fix(run_cli: Callable[..., tuple[int, str, str]], *args: str) -> tuple[int, str, str]:
    code, out, err = run_cli("fix", *args)
    if code:
        assert out == ""
        assert err.startswith("ckptool: error: ") and "\nhint: " in err, err
        assert "Traceback" not in err
    return code, out, err


def test_truncated_input(small: tuple[Path, Path], temp_mode: str,
                         run_cli: Callable[..., tuple[int, str, str]]) -> None:
    src, outdir = small
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    digest = sha256(src)
    code, _, err = run_fix(run_cli, str(src), "--strip-module", "-o", str(outdir / "o.pth"))
    assert code == 3, err
    assert_left_nothing(outdir, src, digest)


def test_unsafe_input_without_extract(tmp_path: Path, temp_mode: str,
                                      run_cli: Callable[..., tuple[int, str, str]]) -> None:
    (tmp_path / "in").mkdir()
    outdir = tmp_path / "out"
    outdir.mkdir()
    src = tmp_path / "in" / "hostile.pth"
    shutil.copyfile(SAMPLES / "hostile_runs_code.pth", src)
    digest = sha256(src)
    out = outdir / "o.pth"
    code, _, err = run_fix(run_cli, str(src), "-o", str(out))
    assert code == 3 and "unsafe" in err, err
    assert_left_nothing(outdir, src, digest)
    # the hint's way out works and leaves only the output
    code, _, err = run_fix(run_cli, str(src), "--extract", "--salvage", "-o", str(out), "-q")
    assert code == 0, err
    assert_left_nothing(outdir, src, digest, keep=("o.pth",))
    assert "callback" not in {t.key.split("/")[0] for t in ckptool.open(out).tensors}


def test_existing_output_without_force(small: tuple[Path, Path], temp_mode: str,
                                       run_cli: Callable[..., tuple[int, str, str]]) -> None:
    src, outdir = small
    digest = sha256(src)
    out = outdir / "o.pth"
    out.write_bytes(b"precious")
    code, _, err = run_fix(run_cli, str(src), "--strip-module", "-o", str(out))
    assert code == 2 and "already exists" in err, err
    assert out.read_bytes() == b"precious"
    assert_left_nothing(outdir, src, digest, keep=("o.pth",))
    code, _, err = run_fix(run_cli, str(src), "--strip-module", "-o", str(out), "--force", "-q")
    assert code == 0, err
    assert ckptool.open(out).tensors[0].key == "layers.0.weight"
    assert_left_nothing(outdir, src, digest, keep=("o.pth",))


@pytest.mark.parametrize("args", [["--in-place", "-o", "{out}"], ["-o", "{missing}/o.pth"]],
                         ids=["in_place_and_output", "missing_directory"])
def test_usage_errors(small: tuple[Path, Path], temp_mode: str, args: list[str],
                      run_cli: Callable[..., tuple[int, str, str]]) -> None:
    src, outdir = small
    digest = sha256(src)
    args = [a.format(out=outdir / "o.pth", missing=outdir / "missing") for a in args]
    code, _, err = run_fix(run_cli, str(src), "--strip-module", *args)
    assert code == 2, err
    assert_left_nothing(outdir, src, digest)


def test_verification_failure(small: tuple[Path, Path], temp_mode: str,
                              monkeypatch: pytest.MonkeyPatch,
                              run_cli: Callable[..., tuple[int, str, str]]) -> None:
    src, outdir = small
    digest = sha256(src)
    out = outdir / "o.pth"
    seen: list[str] = []

    def broken(written: Any, plan: Any) -> None:
        seen.append(written)
        # the output is read back before it is at OUT
        assert not out.exists()
        raise CorruptCheckpointError("simulated verification failure", "nothing was written")

    monkeypatch.setattr(verify, "check_tensors", broken)
    with pytest.raises(CorruptCheckpointError):
        fix.fix(str(src), FixOptions(strip_module=True), str(out))
    assert_left_nothing(outdir, src, digest)
    code, _, err = run_fix(run_cli, str(src), "--strip-module", "-o", str(out))
    assert code == 3 and "simulated verification failure" in err, err
    assert_left_nothing(outdir, src, digest)
    assert len(seen) == 2


def test_a_corrupted_write_is_caught_by_verification(
        small: tuple[Path, Path], temp_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real verifier (no stand-in): a byte flipped in the tensor data the
    copy reads is written, and caught by the CRC taken from what is written."""
    from ckptool.write import mapcopy

    src, outdir = small
    digest = sha256(src)
    out = outdir / "o.pth"
    real_pieces = mapcopy.pieces

    def flipping(fd: int, offset: int, size: int) -> Iterator[mapcopy.Piece]:
        for buffer, start, n in real_pieces(fd, offset, size):
            piece = bytearray(buffer[start:start + n])
            piece[n // 2] ^= 0xFF
            yield piece, 0, n

    monkeypatch.setattr(mapcopy, "pieces", flipping)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        fix.fix(str(src), FixOptions(strip_module=True), str(out))
    assert_left_nothing(outdir, src, digest)
