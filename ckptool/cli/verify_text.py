"""Human output of ``ckptool verify``: one line per problem
(``problem  FILE: TENSOR: message``), then what was checked in one line;
or, when nothing is wrong, that line first (``ok  PATH · layout · ...``).
A URL's report says whether its bytes were read (``--full``) and ends with
what was asked of its store (``read remotely: ...``). A snapshot checked
``--against-hub`` says so on that line, and what the Hub listed on its own
(``hub  hf://org/name@<commit>: ...``).

Each problem stays on one line (never wrapped), so that it can be found
with grep. Imported only when text is printed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from ckptool.check.verify.problems import ERROR, Problem, Report
from ckptool.cli.inputs import shown_path
from ckptool.describe import human_bytes, plural


def summary(report: Report, hub: dict[str, Any] | None = None) -> str:
    """``PATH · layout · 3 files · 20 tensors · 1.2 GB checked``."""
    parts = [shown_path(report.path), report.layout or "unknown layout",
             plural(len(report.files), "file")]
    if report.tensors is not None:
        parts.append(plural(report.tensors, "tensor"))
    remote = report.remote or {}
    if remote and not remote.get("bytes_read"):  # a URL: its structure, not its bytes
        parts.append("structure checked; tensor bytes not read (--full reads them)")
    else:
        parts.append(f"{human_bytes(report.bytes_checked)} checked")
    if "values" in report.checks:
        parts.append("values read")
    manifest = report.manifest or {}
    if "checked" in manifest:
        parts.append(f"against {manifest['checked']}")
    if hub is not None:
        parts.append("against the Hub")
    return " · ".join(parts)


def hub_line(hub: dict[str, Any]) -> str:
    """``hf://org/name@<commit>: 4 files listed, 4 compared (...)``."""
    compared, by_sha = hub["files_compared"], hub["sha256_compared"]
    return (f"{hub['url']}: {plural(hub['files_listed'], 'file')} listed, {compared} "
            f"compared by content ({by_sha} by LFS sha256, {compared - by_sha} by git blob "
            "id); no file downloaded")


def problem_line(p: Problem) -> str:
    """``FILE: TENSOR: message``, without what the problem does not name. A
    key that starts with its file's name (a DeepSpeed file's own entries:
    ``<zero_pp_rank_0_mp_rank_00_optim_states.pt>/optimizer_state_dict/...``)
    is shown without it: the line names the file once."""
    tensor = p.tensor
    if tensor and p.file:
        tensor = tensor.removeprefix(f"<{p.file.rsplit('/', 1)[-1]}>/")
    return ": ".join(part for part in (p.file, tensor, p.message) if part)


def render_verify(console: Console, report: Report, hub: dict[str, Any] | None = None) -> None:
    errors = [p for p in report.problems if p.severity == ERROR]
    warnings = [p for p in report.problems if p.severity != ERROR]
    if not errors:
        console.print(Text(f"ok  {summary(report, hub)}", style="green"), soft_wrap=True)
    for p in errors:
        console.print(Text(f"problem  {problem_line(p)}", style="red"), soft_wrap=True)
    for p in warnings:
        console.print(Text(f"warning  {problem_line(p)}", style="yellow"), soft_wrap=True)
    manifest = report.manifest or {}
    if "written" in manifest:
        console.print(Text(f"manifest  written to {manifest['written']}: "
                           f"{plural(manifest['files'], 'file')}, "
                           f"{plural(manifest['tensors'], 'tensor')}"), soft_wrap=True)
    if hub is not None:
        console.print(Text(f"hub  {hub_line(hub)}"), soft_wrap=True)
    for note in report.notes:
        console.print(Text(f"note  {note}", style="dim"), soft_wrap=True)
    if errors:
        said = plural(len(errors), "problem")
        if warnings:
            said += f", {plural(len(warnings), 'warning')}"
        console.print(Text(f"damaged  {summary(report, hub)} · {said}", style="bold red"),
                      soft_wrap=True)
    if report.remote is not None:
        total = sum(int(f["size"]) for f in report.files)
        console.print(Text(f"read remotely: {plural(report.remote['requests'], 'request')}, "
                           f"{human_bytes(report.remote['bytes'])} of {human_bytes(total)}",
                           style="dim"), soft_wrap=True)
