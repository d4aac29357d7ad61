"""Which keys a pattern matches: one rule for ``inspect --filter`` and the
browser's filter box.

A pattern without ``* ? [`` matches any key that contains it; with them,
it is a glob that must match the whole key or the part after one of its
``/`` (a state dict's dotted name: ``module.conv*`` matches
``state_dict/module.conv.weight``). Either way matching ignores case unless
the pattern has a capital letter (as ``less`` and ``rg --smart-case`` do).
"""

from __future__ import annotations

import fnmatch
import re

GLOB_CHARS = frozenset("*?[")


class Filter:
    """A pattern compiled once (per keystroke in the browser), matched
    against many keys at a time (``mask``) or one (``test``)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern = pattern.strip()
        self.fold = pattern == pattern.lower()
        self.glob = not GLOB_CHARS.isdisjoint(pattern)
        # the whole key, or what follows a "/" in it (a state-dict name)
        self._rx = (re.compile(r"(?:.*/)?" + fnmatch.translate(pattern),
                               re.IGNORECASE | re.DOTALL if self.fold else re.DOTALL)
                    if self.glob else None)
        # the usual globs need no regex (a tenth of the time on 100,000 keys):
        # *X ends the key; X* starts it or a part after a "/"; *X* is inside
        core = pattern.strip("*")
        self._plain = None
        if self.glob and GLOB_CHARS.isdisjoint(core):
            lead, trail = pattern.startswith("*"), pattern.endswith("*")
            self._plain = "in" if lead and trail else "end" if lead else "start"
            self._core = core

    def __bool__(self) -> bool:
        return bool(self.pattern)

    def mask(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` (lower-cased when ``fold``) match."""
        if self._plain is not None:
            core = self._core
            if self._plain == "end":
                return [k.endswith(core) for k in keys]
            if self._plain == "start":
                after = "/" + core
                return [k.startswith(core) or after in k for k in keys]
            return [core in k for k in keys]
        if self._rx is not None:
            match = self._rx.match
            return [match(k) is not None for k in keys]
        p = self.pattern
        return [p in k for k in keys]

    def test(self, key: str) -> bool:
        return self.mask([key.lower() if self.fold else key])[0]
