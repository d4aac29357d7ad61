"""What a rewrite reports: ``FixResult`` (``fix``) and ``ConvertResult``
(``convert``), shared by the writers of one file and of a directory, and by
the views that render them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptool.model import Checkpoint
from ckptool.write.fix.plan import Plan

if TYPE_CHECKING:
    from ckptool.write.convert.plan import Written


@dataclass
class FixResult:
    plan: Plan
    source: Checkpoint
    target: str = ""  # the path written, or that a dry run would write
    output: str | None = None  # None for a dry run
    bytes_written: int = 0
    verified_storages: int = 0
    metadata_only: bool = False  # --in-place appended a new pickle, bytes untouched

    def moves(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Device moves and casts, grouped: ``{"from", "to", "storages"}`` each."""
        storages = self.source.storages
        moves: dict[tuple[str, str], int] = {}
        for sid, tag in self.plan.retargets.items():
            old = (storages[sid].location if sid in storages else None) or "unrecorded"
            moves[(old, tag)] = moves.get((old, tag), 0) + 1
        casts: dict[tuple[str, str], int] = {}
        for pair in self.plan.casts.values():
            casts[pair] = casts.get(pair, 0) + 1
        return ([{"from": a, "to": b, "storages": n} for (a, b), n in moves.items()],
                [{"from": a, "to": b, "storages": n} for (a, b), n in casts.items()])


@dataclass
class ConvertResult:
    source: Checkpoint
    output: str
    output_format: str  # safetensors, torch-zip; hf-safetensors, hf-bin, dcp (a directory)
    tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> kept name
    copied_views: list[str] = field(default_factory=list)  # written as their own copy
    kept_entries: list[str] = field(default_factory=list)  # in __metadata__, or as values
    left_out: list[str] = field(default_factory=list)  # not representable, reported
    bytes_written: int = 0
    notes: list[str] = field(default_factory=list)  # what was ignored, and why
    files: list[str] = field(default_factory=list)  # a directory's files, as written
    # written by many processes: {"ranks", "plan" (per rank), "per_rank" (reports), "resumed"}
    distributed: dict[str, Any] | None = None

    @classmethod
    def of(cls, source: Checkpoint, output: str, fmt: str, written: Written) -> ConvertResult:
        return cls(source, output, fmt, len(written.tensors), written.aliases, written.copies,
                   list(written.entries), written.left_out,
                   notes=[*written.notes, *moved(written, fmt)])


# how each output format keeps a device, for the note saying what was lost
_DEVICE_AFTER = {
    "safetensors": "safetensors records no device: load_file(path, device=...) picks one",
    "hf-safetensors": "safetensors records no device: load_file(path, device=...) picks one",
    "dcp": "DCP records no device: dcp.load puts each tensor where the state dict it is "
           "given has it",
}
_RETARGET = "`ckptool fix --to DEVICE` retargets them"


def moved(written: Written, fmt: str) -> list[str]:
    """Every output's storages are written as on cpu: the note saying so of
    those that were saved elsewhere (``cuda:2``), whatever the format."""
    tags = sorted({str(t.location) for t in written.tensors.values()
                   if t.location is not None and str(t.location) != "cpu"})
    if not tags:
        return []
    return [f"storages saved on {', '.join(tags)} are written as on cpu "
            f"({_DEVICE_AFTER.get(fmt, _RETARGET)})"]
