"""Finding the errors a text states: ``find_errors`` runs every pattern of
``explain_patterns`` over the text, joins the lines of one message into
one ``Error``, and reads the context of the last one (``explain_context``),
the one a log ends with and ``explain`` explains.

An error ends where a new traceback or another message begins; a match on
a line of source that a traceback quotes is no error. Log noise (timestamps,
``[rank0]:`` prefixes, colour codes, ``\\n\\t`` written out by a ``repr``,
lines of a JSON log with their newlines and quotes escaped) is passed over.
Each pattern is one pass over the text, each match is looked at within a
bounded window, and only the last error's context is read: a log of 50 MB
with a million errors in it takes seconds. Pure text: no torch.
"""

from __future__ import annotations

import gc
import re

from ckptool.check.explain import context
from ckptool.check.explain.patterns import INVALID_ID, OOM, PATTERNS, PRIMARY, Error, Facts

TRACEBACK = "Traceback (most recent call last):"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME = re.compile(r'File "[^"\n]+", line \d+')
_LOG_PREFIX = re.compile(r"^\[[^\]\n]*\]: ?")  # torchrun's "[rank0]: "
_ESCAPE = re.compile(r"\\([nrt\"'\\/])")  # a JSON string's or a repr's escapes
_ESCAPED = {"n": "\n", "r": "\n", "t": "\t"}
_WINDOW = 1000  # how far back a quoted source line or its frame line is looked for


def normalise(text: str) -> str:
    """The text as torch wrote it: no colour codes, plain newlines, and the
    escapes of a message written out by ``repr`` or into a JSON log undone
    (``\\n``, ``\\t``, ``\\"``) on each line that holds an escaped newline
    or quote; other lines are left as they are."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    if "\\n" not in text and '\\"' not in text:
        return text
    return "\n".join(_unescape(line) if "\\n" in line or '\\"' in line else line
                     for line in text.split("\n"))


def _unescape(line: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPED.get(m.group(1), m.group(1)), line)


def find_errors(text: str) -> list[Error]:
    """Every error the text states, in order (the last one is the one a log
    ends with, and the only one whose context is read)."""
    text = normalise(text)
    enabled = gc.isenabled()
    gc.disable()  # a log can hold a million errors: objects without cycles, no collections
    try:
        return _collect(text)
    finally:
        if enabled:
            gc.enable()


def _collect(text: str) -> list[Error]:
    hits: list[tuple[int, bool, int, int, str, Facts]] = []
    for kind, regex, opens, reader in PATTERNS:
        closes = not opens
        for m in regex.finditer(text):
            start = m.start()
            # most matches start a line's message: the line is not indented
            begin = text.rfind("\n", start - _WINDOW if start > _WINDOW else 0, start)
            if begin >= 0 and text[begin + 1] in " \t[" and _in_source(text, begin, start):
                continue
            facts = reader(m, text)
            if facts is not None:  # in order of the text, a message before its further lines
                hits.append((start, closes, len(hits), m.end(), kind, facts))
    hits.sort()
    errors: list[Error] = []
    last: Error | None = None
    for start, closes, _, end, kind, facts in hits:
        if (closes and last is not None and last.kind == kind
                and text.find(TRACEBACK, last.end, start) < 0):
            _merge(last.facts, facts)
            last.end = end
            continue
        last = Error(kind, start, end, "", facts)
        errors.append(last)
    if last is not None:
        last.line = _line_at(text, last.start)
        _add_context(last, text, errors[-2].end if len(errors) > 1 else 0)
    return errors


def _in_source(text: str, begin: int, offset: int) -> bool:
    """Whether ``offset``, on the line after the newline at ``begin``, is on
    a line of source a traceback quotes: indented, under its ``File "...",
    line N`` (``raise AssertionError("Invalid device id")``). Only the
    ``_WINDOW`` characters before it are looked at: a match deep inside a
    long line is not on a quoted source line."""
    line = _LOG_PREFIX.sub("", text[begin + 1:offset])
    if line[:1] not in (" ", "\t"):
        return False
    above = text[max(text.rfind("\n", max(0, begin - _WINDOW), begin) + 1,
                     begin - _WINDOW, 0):begin]
    return _FRAME.search(above) is not None


def _merge(facts: Facts, more: Facts) -> None:
    for key, value in more.items():
        if isinstance(value, list):
            facts[key] = list(dict.fromkeys([*facts.get(key, []), *value])) if all(
                isinstance(v, str) for v in value) else [*facts.get(key, []), *value]
        else:
            facts[key] = value


def _line_at(text: str, offset: int) -> str:
    begin = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    return text[begin:end if end >= 0 else len(text)].strip()


def _add_context(error: Error, text: str, since: int) -> None:
    """Facts from around the error: its exception's name, the traceback
    above it (back to the error before), and the CUDA_VISIBLE_DEVICES the
    log set before it."""
    name = context.exception_name(text, error.start)
    if name:
        error.facts["exception"] = name
    visible = context.visible_devices(text, error.start)
    if visible is not None:
        error.facts["cuda_visible_devices"] = visible
    if error.kind not in (INVALID_ID, PRIMARY, OOM):
        return
    traceback = text[since:error.start]
    ids = context.device_ids(traceback) if error.kind != OOM else None
    if ids is not None:
        error.facts["device_ids"] = ids
    elif error.kind == INVALID_ID:
        index = context.device_index(traceback)
        if index is not None:
            error.facts["device_index"] = index
    if error.kind == OOM:
        error.facts["during_load"] = context.during_load(traceback)
