"""What a file's pickles named: every global, with its verdict by name
(``policy.classify``), how often, in which of the file's pickles, and what
loading does with it; ``final()`` gives the verdicts once those uses are
known (``policy.judge``).

The unpickler fills one ``GlobalsSeen`` per file, across all its pickles
(a legacy file has five, and plain pickles may hold several back to back).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from ckptool.errors import InputError
from ckptool.read.pickle import policy


class GlobalsSeen:
    """Every global a file named: its verdict by name, how often, in which of
    the file's pickles (``part``, set by the format reader), and what
    loading does with it (``uses``: ``policy.CALLED``...)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.verdicts: dict[str, policy.Verdict] = {}  # by name (policy.classify)
        self.uses: dict[str, set[str]] = {}
        # the first of each use: why it happens and where (for the verdict's reason)
        self.why: dict[str, dict[str, str]] = {}
        self.where: dict[str, list[str]] = {}  # the pickles that name it, in order
        self.part = "the pickle"  # the pickle being read

    def add(self, dotted: str, verdict: policy.Verdict) -> None:
        self.counts[dotted] += 1
        self.verdicts.setdefault(dotted, verdict)
        where = self.where.setdefault(dotted, [])
        if self.part not in where:
            where.append(self.part)

    def flag(self, dotted: str, reason: str, part: str | None = None) -> None:
        """Something ckptool cannot read, so cannot vouch for, named as a
        global that is unsafe whatever loading does with it (fail closed),
        said to be in ``part`` (else the pickle being read)."""
        outer = self.part
        self.part = part or outer
        try:
            self.add(dotted, policy.Verdict(policy.UNSAFE, reason))
        finally:
            self.part = outer
        self.uses.setdefault(dotted, set()).add(policy.FLAGGED)

    def use(self, dotted: str, use: str, why: str = "", where: str = "") -> None:
        if dotted in self.verdicts:
            self.uses.setdefault(dotted, set()).add(use)
            if why:
                self.why.setdefault(dotted, {}).setdefault(
                    use, f"{why}, {where}" if where else why)

    def merge(self, other: GlobalsSeen, part: str) -> None:
        """An embedded file's globals, as named in ``part`` of this one."""
        for name, count in other.counts.items():
            self.counts[name] += count
            self.verdicts.setdefault(name, other.verdicts[name])
            self.uses.setdefault(name, set()).update(other.uses.get(name, ()))
            where = self.where.setdefault(name, [])
            if part not in where:
                where.append(part)
        for name, whys in other.why.items():
            mine = self.why.setdefault(name, {})
            for use, why in whys.items():
                mine.setdefault(use, f"{why}, in {part}")

    def final(self) -> dict[str, policy.Verdict]:
        """Each global's verdict once its uses are known (``policy.judge``)."""
        return {name: policy.judge(name, verdict, self.uses.get(name, set()),
                                   self.why.get(name, {}))
                for name, verdict in self.verdicts.items()}

    def unsafe(self) -> list[str]:
        return sorted(n for n, v in self.final().items() if v.category == policy.UNSAFE)

    @contextlib.contextmanager
    def naming_unsafe(self) -> Iterator[None]:
        """A file that turns out unreadable is refused naming the unsafe
        globals read before the point it failed: a payload that breaks the
        rest of the file is no "malformed" file but a hostile one."""
        try:
            yield
        except InputError as exc:
            unsafe = [n for n in self.unsafe() if n not in exc.message]
            if unsafe:
                exc.message = (f"{exc.message}; before that point it names "
                               f"{', '.join(unsafe)}, which torch.load(weights_only=False) "
                               "would call")
                exc.args = (exc.message,)
                exc.hint = ("do not load this file with torch: it looks made to run code "
                            "when loaded")
            raise
