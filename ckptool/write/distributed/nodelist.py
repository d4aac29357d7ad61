"""SLURM node lists (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``) as
``scontrol show hostnames`` expands them: where ``world`` finds rank 0's host
under ``srun``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import product


def expand_nodelist(text: str) -> list[str]:
    """The host names of a SLURM node list, as ``scontrol show hostnames``
    gives them: ``node[01-03,07],gpu-a,rack[1-2]-n[3-4]`` is node01, node02,
    node03, node07, gpu-a, rack1-n3, rack1-n4, rack2-n3, rack2-n4. A range
    keeps the width of its low end (``[08-10]``: 08, 09, 10). ValueError for
    what is no node list (an unclosed bracket, a range that runs backwards).
    """
    hosts: list[str] = []
    for word in _split_top(text.strip()):
        parts = re.split(r"(\[[^\[\]]*\])", word)
        if any(c in part for part in parts[::2] for c in "[]"):
            raise ValueError(f"unbalanced brackets in {word!r}")
        choices = [[part] if i % 2 == 0 else _expand_group(part[1:-1], word)
                   for i, part in enumerate(parts)]
        hosts.extend("".join(pick) for pick in product(*choices))
    if not hosts:
        raise ValueError("no host in the node list")
    return hosts


def _split_top(text: str) -> Iterator[str]:
    """Words of a node list: split at commas and spaces outside brackets."""
    depth, start = 0, 0
    for i, char in enumerate(text + ","):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' without its '['")
        elif (char == "," or char.isspace()) and depth == 0:
            if text[start:i]:
                yield text[start:i]
            start = i + 1
    if depth:
        raise ValueError("a '[' without its ']'")


def _expand_group(inner: str, word: str) -> list[str]:
    """``01-03,07`` -> 01, 02, 03, 07."""
    values: list[str] = []
    for item in inner.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if not match:
            raise ValueError(f"[{inner}] in {word!r} is not numbers and ranges")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {item.strip()} in {word!r} runs backwards")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values
