"""A plain-text screenshot of a running app: what each cell shows, no
styles. Snapshot tests compare these, the benchmark waits on them, and
they read well in a diff (Textual's own screenshots are SVG)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console


def screen_text(app: Any) -> str:
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system=None, record=True, legacy_windows=False, safe_box=False)
    # the same render Textual's export_screenshot() records, as text
    update = app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens, simplify=True)
    console.print(update)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())
