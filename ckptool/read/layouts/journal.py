"""An in-place fix of a directory of shards, made all-or-nothing: its journal.

``fix DIR --in-place`` (``ckptool.write.fix.shards``) changes no file of
DIR before every new file is written and verified beside it: each shard
that changes and the new index, under a temporary name (``temp_name``: a
dot file naming the writing process), or, for a torch zip whose pickle
alone changes, its new records appended after the old ones, where the file
still reads as the old checkpoint (``ckptool.write.fix.inplace``). Then one
small file, the journal (``JOURNAL``), is written and made durable: it names
every change, the index last. Only then are the changes made, and the
journal removed.

Before the journal exists DIR is unchanged: readers skip the temporary
files (``is_temporary``), and the next in-place fix removes those of
processes that are gone (``remove_leftovers``). Once it exists, every change
it names can be made again: ``finish`` makes the ones still to make, so any
ckptool command that reads DIR after a crash completes the fix first, and
says so. A journal is trusted that far and no further: it may rename a
ckptool temporary file of DIR over a file the index names, or cut such a
file (a regular file, never a link) back to a size whose last bytes match a
recorded CRC, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import zlib
from dataclasses import asdict, dataclass

from ckptool.errors import CorruptCheckpointError, InputError

JOURNAL = ".ckptool-journal.json"
VERSION = 1
# .NAME.ckptool-PID-HEX.partial, and AtomicOutput's own temporary name for it
# where O_TMPFILE is missing (.<that>.HEX.ckptool-tmp)
_TEMP = re.compile(r"^\.(?P<name>.+)\.ckptool-(?P<pid>\d+)-[0-9a-f]+\.partial"
                   r"(?:\.[0-9a-f]+\.ckptool-tmp)?$")
CRASH_ENV = "CKPTOOL_TEST_CRASH_AT"  # tests: die at a named step, as kill -9 would
_BAD = ("it is what an interrupted `ckptool fix --in-place` leaves; if ckptool did not "
        "write it, remove it")


@dataclass(frozen=True)
class Step:
    """One change: the verified file ``temp`` renamed over ``name`` (``size``
    bytes); or, with no ``temp``, ``name`` cut back to ``size`` bytes, its
    bytes from ``start`` having CRC ``crc``."""

    name: str
    size: int
    temp: str = ""
    start: int = 0
    crc: int = 0


@dataclass(frozen=True)
class Finished:
    """What ``finish`` completed: the options of the fix that wrote the
    journal, and how many files it changed."""

    directory: str
    options: str
    files: int

    @property
    def note(self) -> str:
        return (f"{self.directory} held an in-place fix that was cut short (its journal "
                f"{JOURNAL}): ckptool finished it, changing {self.files} file"
                f"{'s' if self.files != 1 else ''} as the journal said")


def crash_point(name: str) -> None:
    """Tests: die here, as ``kill -9`` would, when ``CRASH_ENV`` names this step."""
    if os.environ.get(CRASH_ENV) == name:
        os._exit(137)


def temp_name(name: str) -> str:
    """A temporary name beside ``name`` that readers skip and that says whose it is."""
    return f".{name}.ckptool-{os.getpid()}-{secrets.token_hex(4)}.partial"


def is_temporary(name: str) -> bool:
    """A file ckptool is writing, or a killed run left: never read as a checkpoint."""
    return name.endswith(".ckptool-tmp") or _TEMP.match(name) is not None


def remove_leftovers(directory: str) -> list[str]:
    """Remove the temporary files of in-place fixes whose process is gone
    (their journal was never written: nothing refers to them)."""
    removed = []
    for entry in sorted(os.listdir(directory)):
        m = _TEMP.match(entry)
        if m is None or alive(int(m.group("pid"))) or not os.path.isfile(
                os.path.join(directory, entry)) or os.path.islink(os.path.join(directory, entry)):
            continue  # (a directory is a staged output's: ckptool.write.outdir's to remove)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, entry))
        removed.append(entry)
    return removed


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (its temporaries are not litter)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dumps(index: str, options: str, steps: list[Step]) -> bytes:
    """The journal of a fix (``options``: what it was asked, to tell a re-run
    of it from another fix), the index's step last."""
    return json.dumps({"ckptool_journal": VERSION, "index": index, "options": options,
                       "steps": [asdict(s) for s in steps]}, indent=1).encode() + b"\n"


def finish(directory: str) -> Finished | None:
    """Make the changes the journal of ``directory`` names that are not made
    yet, then remove it; None when there is no journal."""
    path = os.path.join(directory, JOURNAL)
    if not os.path.lexists(path):
        return None
    _, options, steps = _load(directory, path)
    try:
        for step in steps:
            _apply(directory, step)
            crash_point("renaming")
        _fsync_dir(directory)
        crash_point("renamed")
        with contextlib.suppress(FileNotFoundError):  # another reader finished it first
            os.unlink(path)
        _fsync_dir(directory)
    except OSError as exc:
        raise InputError(
            f"{directory} holds an in-place fix that was cut short, and ckptool cannot finish "
            f"it: {exc.strerror or exc} ({exc.filename or path})",
            f"run ckptool on it again where it may write there (ckptool inspect {directory}); "
            f"its journal is {JOURNAL}") from exc
    return Finished(directory, options, len(steps))


def _load(directory: str, path: str) -> tuple[str, str, list[Step]]:
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise ValueError("not a regular file")
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 24))
        if not isinstance(data, dict) or data.get("ckptool_journal") != VERSION:
            raise ValueError(f"not a version {VERSION} journal")
        index, options = data["index"], data["options"]
        steps = [Step(**s) for s in data["steps"]]
        if not all(isinstance(s.name, str) and isinstance(s.temp, str) and
                   all(type(n) is int for n in (s.size, s.start, s.crc)) for s in steps):
            raise ValueError("a step that is not names and sizes")
        if not (isinstance(index, str) and isinstance(options, str) and steps
                and steps[-1].name == index):
            raise ValueError("no index step last")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path} is not a journal ckptool can finish: {exc}",
                                     _BAD) from exc
    allowed = _files_of(directory, index, path)
    for step in steps:
        m = _TEMP.match(step.temp) if step.temp else None
        if step.name not in allowed or (step.temp and (m is None or m.group("name") != step.name
                                                       or "/" in step.temp)):
            raise CorruptCheckpointError(
                f"{path} names a change ckptool never makes ({step.name!r:.80}, "
                f"{step.temp!r:.80}): it was not finished", _BAD)
    return index, options, steps


def _files_of(directory: str, index: str, path: str) -> set[str]:
    """The index and the shard files it names (the same before and after a fix)."""
    try:
        if "/" in index or index.startswith("."):
            raise ValueError(f"index {index!r:.80}")
        with open(os.path.join(directory, index), "rb") as f:
            weight_map = json.loads(f.read()).get("weight_map")
        shards = {v for v in weight_map.values() if isinstance(v, str) and "/" not in v}
    except (OSError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{path}: the index it names cannot be read ({exc})",
                                     _BAD) from exc
    return {index, *shards}


def _apply(directory: str, step: Step) -> None:
    """One change, made if it is not made yet; a file found as neither the
    journal's before nor its after is an error, and nothing is touched."""
    target = os.path.join(directory, step.name)
    if step.temp:
        temp = os.path.join(directory, step.temp)
        try:
            st: os.stat_result | None = os.lstat(temp)
        except FileNotFoundError:
            st = None  # renamed already
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == step.size:
            os.replace(temp, target)
            return
        if st is None and _size(target) == step.size:
            return
    else:
        st = os.lstat(target)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= step.size \
                and _crc(target, step.start, step.size) == step.crc:
            if st.st_size > step.size:
                with open(target, "r+b") as f:
                    os.ftruncate(f.fileno(), step.size)
                    os.fsync(f.fileno())
            return
    raise CorruptCheckpointError(
        f"{target} is not what the in-place fix cut short left there (journal "
        f"{os.path.join(directory, JOURNAL)}): it was changed since, and ckptool cannot "
        "finish the fix", "restore the directory from a copy, or remove the journal and "
        "check each file with ckptool inspect")


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return -1


def _crc(path: str, start: int, end: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                return -1
            crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    return crc


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # not every filesystem can fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)
