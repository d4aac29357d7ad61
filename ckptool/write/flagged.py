"""Writers refuse flagged input: ``fix`` and ``convert`` write nothing from
a checkpoint whose verdict is unsafe (a global that loading would run, in
its files or in the files beside it a framework loads with it), wherever
the global sits, unless asked to ``--salvage``: then the output holds only
the tensors and plain values, written by ckptool itself, and it is read
back before it is committed and refused unless clean.
"""

from __future__ import annotations

from ckptool.errors import UnsupportedCheckpointError
from ckptool.model import Checkpoint


def flagged(ckpt: Checkpoint) -> list[str]:
    """Every global in ``ckpt``'s files that loading would run, and in the
    files beside it that a framework loads with it (a Trainer's rng_state.pth)."""
    beside = [f"{c.path}: {g}" for c in (ckpt.framework.companions if ckpt.framework else ())
              for g in c.unsafe]
    return [*ckpt.unsafe_globals, *beside]


def refuse_flagged(ckpt: Checkpoint, salvage: bool, command: str) -> None:
    """A writer never writes from a file whose verdict is unsafe, wherever the
    global sits, unless asked to salvage (then what it writes is its own)."""
    names = flagged(ckpt)
    if names and not salvage:
        raise UnsupportedCheckpointError(
            f"{ckpt.path} names globals that run code when loaded ({', '.join(names[:4])}"
            f"{' …' if len(names) > 4 else ''}): {command} writes nothing from it",
            "add --salvage to take only its tensors and plain values into a fresh file "
            "(the output is re-read and must be clean)")


def prove_clean(path: str, shown: str) -> None:
    """A salvaged output, read back before it is committed: it must name no
    global that runs code (else nothing is written)."""
    from ckptool.read import dispatch

    unsafe = dispatch.read(path).seen.unsafe()
    if unsafe:
        raise UnsupportedCheckpointError(
            f"{shown} would still name globals that run code ({', '.join(unsafe[:4])}): "
            "nothing was written", "drop the entries that hold them (--drop PATH) or keep "
            "only the weights (--extract)")
