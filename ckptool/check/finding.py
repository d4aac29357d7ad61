"""A finding: one thing ``diagnose`` says about a checkpoint, with a stable
code, a severity, and the fix where there is one.

``ERROR`` and ``WARNING`` findings are problems: they make ``diagnose`` exit
1 and are listed in its ``findings``. An ``INFO`` finding is a fact worth
saying that is no problem (a tie the model makes again as it loads, a
wrapper's prefix that the framework which wrote the folder loads back): it
is said in the report's ``notes`` and never counts.
"""

from __future__ import annotations

from dataclasses import dataclass

ERROR, WARNING = "error", "warning"  # error: loading fails; warning: not as wanted
INFO = "info"  # no problem: said, never counted


@dataclass(frozen=True)
class Finding:
    code: str  # stable: device-unavailable, key-prefix, wrapped-state-dict...
    severity: str  # error (loading fails), warning (loads, but not as wanted), or info
    message: str
    fix: str | None = None  # a runnable ckptool command, or a code change
    snippet: str | None = None  # the same fix as Python, where there is one
    keys: tuple[str, ...] = ()  # the keys concerned, for missing/unexpected/mismatch
