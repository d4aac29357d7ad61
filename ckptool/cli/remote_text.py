"""What the store says of a checkpoint behind a URL, and what reading it
cost: the text view of ``inspect``'s ``remote`` report (the store's sha256
of each file, the Hub's scan, requests and bytes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console

from ckptool.describe import human_bytes, plural

if TYPE_CHECKING:
    from ckptool.model import Checkpoint


def render_remote(console: Console, ckpt: Checkpoint, remote: dict[str, Any]) -> None:
    """What the store says of a checkpoint behind a URL (its files' sha256,
    the Hub's scan), and what reading it cost: requests and bytes."""
    total = sum(f.size for f in ckpt.files) if ckpt.is_multifile else ckpt.file_size
    console.print()
    for name, digest in remote["sha256"].items():
        console.print(f"sha256      {digest}  {name} (the Hub's)", highlight=False,
                      soft_wrap=True)  # (a digest is copied whole: never cut)
    scan = remote.get("hub_scan")
    if isinstance(scan, dict):
        console.print(f"hub scan    {_hub_scan(scan)}", highlight=False)
    console.print(f"read remotely: {plural(remote['requests'], 'request')}, "
                  f"{human_bytes(remote['bytes'])} of {human_bytes(total)}", style="dim")


def _hub_scan(scan: dict[str, Any]) -> str:
    """The Hub's scan of the repository, in a line (its own words)."""
    if "error" in scan:
        return f"not available ({scan['error']})"
    issues = scan.get("filesWithIssues") or []
    if not scan.get("scansDone", True):
        return "not finished"
    if not issues:
        return "no file flagged (the Hub's scanners; ckptool's verdict is above)"
    flagged = ", ".join(f"{i.get('path', '?')} ({i.get('level', 'flagged')})"
                        if isinstance(i, dict) else str(i) for i in issues[:6])
    more = f" and {len(issues) - 6} more" if len(issues) > 6 else ""
    return f"{plural(len(issues), 'file')} flagged: {flagged}{more}"
