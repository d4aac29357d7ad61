"""The text around an error that ``explain_patterns`` found: the name of
its exception, the ``CUDA_VISIBLE_DEVICES`` the log set before it, and
what its traceback shows (``device_ids=[...]``, ``set_device(N)``, a
``torch.load`` frame).

A log can be tens of megabytes, one line of it megabytes long: every
reader here looks at a bounded window, or walks back from the error once,
so that reading the context of one error is linear in the text at worst.
Pure text: no torch.
"""

from __future__ import annotations

import re

# an exception's dotted name, not the tail of a longer word run: the
# look-behind keeps a search over a long run of word characters linear
_EXCEPTION = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*(?:Error|Exception)): ")
_EXCEPTION_WINDOW = 200  # characters before the error where its name may stand
_VISIBLE = "CUDA_VISIBLE_DEVICES="
# a real value: GPU indices, GPU-/MIG- UUIDs, comma-separated, quoted or
# not, ending at a space, a quote or the end of the line; or nothing (which
# hides every GPU): '' or "", or no value before a space or the line's end.
# A shell variable ($GPUS, "${SLURM_JOB_GPUS}") or a template is no value.
_ENTRY = r"(?:\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+)"
_ENTRIES = rf"{_ENTRY}(?:,{_ENTRY})*"
_VALUE = re.compile(rf"([\"'])({_ENTRIES}|)\1|({_ENTRIES})(?=[\s\"';]|$)|(?=[\s;]|$)")
_DEVICE_IDS = re.compile(r"device_ids\s*=\s*\[([\d,\s]*)\]")
_INDEX = re.compile(r"set_device\((\d+)\)|['\"]cuda:(\d+)['\"]")
_LOADING = re.compile(r"torch[/\\]serialization\.py|torch\.load\(")


def exception_name(text: str, start: int) -> str | None:
    """The exception whose message begins at ``start``, as its line gives it
    (``_pickle.UnpicklingError`` in ``_pickle.UnpicklingError: Weights only...``)."""
    begin = max(text.rfind("\n", max(0, start - _EXCEPTION_WINDOW), start) + 1,
                start - _EXCEPTION_WINDOW)
    names = _EXCEPTION.findall(text, max(begin, 0), start)
    return names[-1] if names else None


def visible_devices(text: str, end: int) -> str | None:
    """The last real ``CUDA_VISIBLE_DEVICES=...`` the text sets before ``end``
    (``0,1``, ``GPU-5ab1,GPU-77c``, ``""``), without quotes; None if none."""
    while True:
        at = text.rfind(_VISIBLE, 0, end)
        if at < 0:
            return None
        value = _VALUE.match(text, at + len(_VISIBLE))
        if value is not None:
            return value.group(2) or value.group(3) or ""
        end = at  # "$GPUS", "<ids>": walk on back


def device_ids(traceback: str) -> list[int] | None:
    """The last ``device_ids=[...]`` the traceback shows."""
    found = _DEVICE_IDS.findall(traceback)
    return [int(i) for i in found[-1].replace(",", " ").split()] if found else None


def device_index(traceback: str) -> int | None:
    """The last ``set_device(N)`` or ``'cuda:N'`` the traceback shows."""
    found = _INDEX.findall(traceback)
    return int("".join(found[-1])) if found else None


def during_load(traceback: str) -> bool:
    """Whether the traceback runs through ``torch.load``."""
    return _LOADING.search(traceback) is not None
