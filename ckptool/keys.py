"""Keys: how ckptool writes and splits them, and which keys a pattern
matches (one rule for ``inspect --filter`` and the browser's filter box).

A key is the container path of a tensor or entry, its components joined
by ``/``: ``state_dict/module.conv.weight``, ``optimizer/state/0/exp_avg``.
A component that itself holds ``/`` or ``\\`` has them escaped as ``\\/`` and
``\\\\`` (``{"a/b": t}`` is ``a\\/b``, ``{"a": {"b": t}}`` is ``a/b``), so
every key names one place and splits back into the names it was made of.
Only ckptool's key text is escaped: a file is always written with its own
names. ``join_key``, ``key_of`` and ``escape`` make keys; ``split_key`` and
``pieces`` take them apart; nothing else joins or splits on ``/``.

A pattern without ``* ? [`` matches any key that contains it; with them,
it is a glob that must match the whole key or the part after one of its
``/`` (a state dict's dotted name: ``module.conv*`` matches
``state_dict/module.conv.weight``). Either way matching ignores case unless
the pattern has a capital letter (as ``less`` and ``rg --smart-case`` do).
"""

from __future__ import annotations

import fnmatch
import re
from itertools import repeat
from operator import contains

GLOB_CHARS = frozenset("*?[")
_PIECES = {False: re.compile(r"\\.|(/)", re.DOTALL), True: re.compile(r"\\.|([/.])", re.DOTALL)}
_UNESCAPE = re.compile(r"\\([\\/])")


def escape(name: str) -> str:
    """One component (a dict key, a state-dict name) as key text."""
    if "/" in name or "\\" in name:
        return name.replace("\\", "\\\\").replace("/", "\\/")
    return name


def join_keys(path: str, names: list[str]) -> list[str]:
    """``[join_key(path, n) for n in names]``, made in C where no name needs
    escaping (the common case: a state dict's 100,000 dotted names)."""
    everything = "".join(names)
    if "/" in everything or "\\" in everything:
        return [join_key(path, n) for n in names]
    return [f"{path}/{n}" for n in names] if path else list(names)


def unescape(text: str) -> str:
    """The name an escaped component stands for. A ``\\`` before any other
    character (or at the end) is kept as it is: a path typed by hand."""
    return _UNESCAPE.sub(r"\1", text) if "\\" in text else text


def join_key(path: str, name: str) -> str:
    """The key of ``name`` (a raw component) in the container at key ``path``
    ("" for the root: the key of a name of the file's own dict is the name)."""
    name = escape(name)
    return f"{path}/{name}" if path else name


def key_of(names: list[str]) -> str:
    """The key of a chain of raw components, outermost first."""
    return "/".join([escape(n) for n in names])


def pieces(key: str, dots: bool = False) -> list[str]:
    """``key`` cut at each ``/`` that is not escaped (and each ``.``, with
    ``dots``: the browser's tree levels). The pieces stay escaped, and are
    slices of ``key`` one separator apart."""
    if "\\" not in key:
        return key.replace(".", "/").split("/") if dots else key.split("/")
    out, start = [], 0
    for m in _PIECES[dots].finditer(key):
        if m.group(1) is not None:
            out.append(key[start:m.start()])
            start = m.end()
    out.append(key[start:])
    return out


def split_key(key: str) -> list[str]:
    """The raw components ``key`` was made of (none for "", the root)."""
    return [unescape(p) for p in pieces(key)] if key else []


class Filter:
    """A pattern compiled once (per keystroke in the browser), matched
    against many keys at a time (``mask``) or one (``test``)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern = pattern.strip()
        self.fold = pattern == pattern.lower()
        self.glob = not GLOB_CHARS.isdisjoint(pattern)
        # the whole key, or what follows a "/" in it (a state-dict name); an
        # escaped "\/" is part of a name, never where one starts
        self._rx = (re.compile(r"(?:(?:[^\\]|\\.)*/)?" + fnmatch.translate(pattern),
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
        """Which of ``keys`` (lower-cased when ``fold``) match. (Each test is
        mapped in C where it can be: a keystroke in the browser filters
        100,000 keys.)"""
        if self._plain is not None:
            core = self._core
            if self._plain == "end":
                return list(map(str.endswith, keys, repeat(core)))
            if self._plain == "start":
                after = "/" + core
                return [k.startswith(core) or (after in k and (
                    "\\" not in k or any(p.startswith(core) for p in pieces(k))))
                    for k in keys]
            return list(map(contains, keys, repeat(core)))
        if self._rx is not None:
            return list(map(bool, map(self._rx.match, keys)))  # a match object is true
        return list(map(contains, keys, repeat(self.pattern)))

    def test(self, key: str) -> bool:
        return self.mask([key.lower() if self.fold else key])[0]
