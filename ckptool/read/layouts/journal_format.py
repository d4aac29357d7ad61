"""What the journal of an in-place fix of a directory holds, and checking it.

The journal (``JOURNAL``) and the temporary files of the fix it names
(``new_temp``) are ``ckptool.read.layouts.journal``'s: this module is their
format. A ``Record`` is read back only when every field is what ckptool
writes, every name a plain file name of the directory (temporary files:
ckptool's own pattern), and it was written for this very directory (its
inode): a journal copied or downloaded with a directory is not applied.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from dataclasses import asdict, dataclass, field

from ckptool.describe import shell_word
from ckptool.errors import CorruptCheckpointError

JOURNAL = ".ckptool-journal.json"
VERSION = 2
PREPARE, COMMIT = "prepare", "commit"
TAIL = 1 << 16  # the bytes of a shard's end whose CRC tells it is as it was
# a fix's temporary file (.ckptool-PID-HEX.partial), or AtomicOutput's own
# temporary name for one of them where O_TMPFILE is missing (.<that>.HEX.ckptool-tmp)
_NAME = re.compile(r"^\.ckptool-(?P<pid>\d+)-[0-9a-f]{8}\.partial$")
TEMP = re.compile(r"^\.?\.ckptool-(?P<pid>\d+)-[0-9a-f]{8}\.partial"
                   r"(?:\.[0-9a-f]+\.ckptool-tmp)?$")
JOURNAL_TEMP = re.compile(rf"^\.{re.escape(JOURNAL)}\.[0-9a-f]+\.ckptool-tmp$")
CRASH_ENV = "CKPTOOL_TEST_CRASH_AT"  # tests: die at a named step, as kill -9 would


@dataclass(frozen=True)
class Step:
    """One change of phase commit: the file ``temp`` (inode ``ino``) renamed
    over ``name`` (found as ``old``: its inode and size, None where absent),
    ``size`` bytes; or, with no ``temp``, ``name`` cut back to ``size``
    bytes, its bytes from ``start`` having CRC ``crc``."""

    name: str
    size: int
    temp: str = ""
    start: int = 0
    crc: int = 0
    ino: int = 0
    old: tuple[int, int] | None = None


@dataclass(frozen=True)
class Grown:
    """A shard the fix may append to: its ``size`` before, and the CRC of
    its bytes from ``start`` to there."""

    name: str
    size: int
    start: int
    crc: int


@dataclass
class Pending:
    """What a shard's fix writes beside it: its temporary file's name, and
    the steps the commit will make (it appends its own)."""

    temp: str
    steps: list[Step]


@dataclass
class Record:
    """A journal: the fix (``options`` to compare, ``command`` to show), who
    wrote it (the directory's inode, process, host), what it may change."""

    phase: str
    directory: int
    pid: int
    host: str
    index: str
    options: str
    command: str
    files: list[str]  # every name a step may change (the old index's and the new one's)
    grown: list[Grown] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)

    def dumps(self) -> bytes:
        return json.dumps({"ckptool_journal": VERSION, **asdict(self)}, indent=1).encode() + b"\n"


def crash_point(name: str) -> None:
    """Tests: die here, as ``kill -9`` would, when ``CRASH_ENV`` names this step."""
    if os.environ.get(CRASH_ENV) == name:
        os._exit(137)


def new_temp() -> str:
    """A temporary name for a file of the fix (its journal says which), short
    whatever the shard's name, that readers skip."""
    import secrets  # (here: every read imports this module; few fix in place)

    return f".ckptool-{os.getpid()}-{secrets.token_hex(4)}.partial"


def is_temporary(name: str) -> bool:
    """A file ckptool is writing, or a killed run left: never read as a checkpoint."""
    return name.endswith(".ckptool-tmp") or TEMP.fullmatch(name) is not None


def grown(directory: str, name: str) -> Grown | None:
    """``name`` as it is before a fix may append to it; None where it never
    would (a link or a file with other hard links: it is replaced instead)."""
    path = os.path.join(directory, name)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return None
    start = max(0, st.st_size - TAIL)
    return Grown(name, st.st_size, start, crc_of(path, start, st.st_size))


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (its temporaries are not litter)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, its parent yet to reap it) runs no more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: as os.kill says


def holder(directory: str) -> str:
    """Who holds ``directory``, as its journal says (for a message)."""
    return f"another ckptool process{fix_of(directory)}"


def fix_of(directory: str) -> str:
    """`` (pid N: ckptool fix ...)``, as the journal of ``directory`` says; "" if it cannot."""
    try:
        with open(os.path.join(directory, JOURNAL), "rb") as f:
            data = json.loads(f.read(1 << 20))
        return f" (pid {int(data['pid'])}: ckptool fix {str(data['command'])[:200]})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def load(directory: str) -> Record:
    """The journal of ``directory``, every name and step checked."""
    path = os.path.join(directory, JOURNAL)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise ValueError("not a regular file")
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 24))
        if not isinstance(data, dict) or data.pop("ckptool_journal", None) != VERSION:
            raise ValueError(f"not a version {VERSION} journal")
        record = Record(**data)
        record.grown = [Grown(**g) for g in data["grown"]]
        record.steps = [Step(**{**s, "old": tuple(s["old"]) if s.get("old") else None})
                        for s in data["steps"]]
        _check_types(record)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path} is not a journal ckptool can settle: {exc}",
                                     bad_hint(directory)) from exc
    if record.directory != os.stat(directory).st_ino:
        raise CorruptCheckpointError(
            f"{path} is the journal of an in-place fix of another directory (copied or "
            "downloaded with it?): ckptool does not apply it here",
            "if this is a copy of a directory whose fix was cut short, run ckptool inspect "
            "on the original (it settles the fix), then copy it again; otherwise remove "
            f"{shell_word(path)} and the .ckptool-*.partial files beside it")
    temps = set(record.temps)
    names = [s.name for s in record.steps]
    if not (all(_plain(n) for n in record.files) and record.index in record.files
            and all(_NAME.fullmatch(t) for t in temps)
            and all(g.name in record.files for g in record.grown)
            and len(set(names)) == len(names)
            and (not record.steps if record.phase == PREPARE else
                 names and names[-1] == record.index)):
        raise CorruptCheckpointError(f"{path} is not a journal ckptool can settle: its names "
                                     "do not hold together", bad_hint(directory))
    for step in record.steps:
        if step.name not in record.files or (step.temp and step.temp not in temps):
            raise CorruptCheckpointError(
                f"{path} names a change ckptool never makes ({step.name!r:.80}, "
                f"{step.temp!r:.80}): it was not applied", bad_hint(directory))
    return record


def _check_types(record: Record) -> None:
    ints = [record.directory, record.pid, *(n for g in record.grown
                                            for n in (g.size, g.start, g.crc)),
            *(n for s in record.steps for n in (s.size, s.start, s.crc, s.ino, *(s.old or ())))]
    texts = [record.phase, record.host, record.index, record.options, record.command,
             *record.files, *record.temps, *(g.name for g in record.grown),
             *(n for s in record.steps for n in (s.name, s.temp))]
    lists = [record.files, record.temps, record.grown, record.steps]
    if not (all(isinstance(x, list) for x in lists)
            and all(type(n) is int for n in ints) and all(isinstance(t, str) for t in texts)
            and record.phase in (PREPARE, COMMIT)
            and all(s.old is None or len(s.old) == 2 for s in record.steps)):
        raise ValueError("a field that is not what ckptool writes")


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".") and "\0" not in name


def bad_hint(directory: str) -> str:
    """What to do about a journal ckptool will not apply: it changed nothing."""
    return (f"ckptool changed nothing; if no `ckptool fix --in-place` of it was cut short, "
            f"remove {shell_word(os.path.join(directory, JOURNAL))}; otherwise restore "
            f"{shell_word(directory)} from a copy")


def crc_of(path: str, start: int, end: int) -> int:
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
