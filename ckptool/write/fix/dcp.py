"""``fix`` on a ``torch.distributed.checkpoint`` directory: the same layout,
fixed, written to a new directory by torch's own writer.

The whole checkpoint is kept (every tensor, the optimizer state, the
values), nested as it was saved (``convert_plan``'s WHOLE plan). Key options
rename the model's keys: the names inside the entry the state dict was saved
under (``model.module.fc.weight`` is ``fc.weight`` of ``model`` after
``--strip-module``), as they rename a single file's state-dict keys; the
entry's own name is how it loads (``dcp.load({"model": sd})``) and stays.
``--drop KEY`` takes a tensor, a value, or a whole entry (``--drop optim``)
out; ``--dtype`` casts floating tensors. A value that is not plain data
cannot be written back through torch's writer: fix refuses until it is
dropped. Files beside the checkpoint that it reads (Lightning's ``meta.pt``)
are copied as they are. DCP records no device, so ``--to`` / ``--map`` are refused, and
``--extract`` is ``convert``'s (one file of the model's state dict).
``--in-place`` is refused: the ``.distcp`` files would stay, but a new
``.metadata`` would have to be pickled.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ckptool.describe import shell_word
from ckptool.errors import UsageError
from ckptool.keys import escape, unescape
from ckptool.model import Checkpoint
from ckptool.read.prefixes import common_prefix, wrapper_prefix
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.directory import write_directory
from ckptool.write.convert.plan import WHOLE, Written
from ckptool.write.fix.plan import CASTABLE, FixOptions, Plan, check_consistent, key_function
from ckptool.write.results import FixResult

Progress = Callable[[int, int], None]


def fix(source: Checkpoint, opts: FixOptions, output: str, *, force: bool = False,
        in_place: bool = False, dry_run: bool = False, progress: Progress | None = None,
        fsync: bool = False) -> FixResult:
    """Rewrite the DCP checkpoint ``source`` as ``opts`` ask, into the directory ``output``."""
    path = shell_word(source.path)
    check_consistent(opts)
    if in_place:
        raise UsageError("--in-place on a torch.distributed.checkpoint directory is not "
                         "supported", f"write a fixed copy: ckptool fix {path} ... -o DIR")
    if opts.to or opts.maps:
        raise UsageError("DCP records no device: there is nothing to retarget",
                         "torch.distributed.checkpoint.load puts each tensor where the state "
                         "dict you pass has it")
    if opts.extract is not None:
        raise UsageError("fix keeps a DCP checkpoint whole: --extract is convert's",
                         f"the model's state dict in one file: ckptool convert {path} "
                         "model.safetensors")
    written = convert_plan.plan(source, WHOLE)
    plan = Plan(None)
    _drop(written, opts, plan)
    if written.unplain:
        raise UsageError(
            f"{written.unplain[0]} is not plain data: fix cannot write it back into a DCP "
            "checkpoint" + (f" (nor {len(written.unplain) - 1} more)"
                            if len(written.unplain) > 1 else ""),
            f"leave it out with --drop {escape(written.unplain[0])}, or convert the model "
            f"into one file: ckptool convert {path} model.safetensors")
    assert source.directory is not None
    # Lightning's meta.pt, copied as it is: never by a salvage, which writes
    # no byte of an input's pickles
    extras = [] if opts.salvage else [(os.path.join(source.directory, f.path), f.path)
                                      for f in source.files if f.role == "extra"]
    if opts.changes_keys():
        _rename(source, written, opts, plan)
    for name, t in written.tensors.items():
        if opts.dtype is not None and t.dtype in CASTABLE and t.dtype != opts.dtype:
            written.cast[name] = opts.dtype
            plan.casts[t.storage or name] = (t.dtype, opts.dtype)
    result = FixResult(plan, source, target=output)
    if dry_run:
        return result
    _, result.bytes_written = write_directory(source, written, "dcp", output, force=force,
                                              fsync=fsync, progress=progress, extras=extras)
    result.output = output
    result.verified_storages = len(written.tensors)
    return result


def _drop(written: Written, opts: FixOptions, plan: Plan) -> None:
    """Each ``--drop NAME``: a tensor or a value, or every one saved under an
    entry (``--drop optim``: the optimizer state)."""
    for drop in opts.drop:
        name = unescape(drop)
        found = 0
        for held in (written.tensors, written.entries):
            for key in [k for k in held if k == name or _under(written, k, name)]:
                del held[key]
                found += 1
        kept = [k for k in written.unplain if not (k == name or _under(written, k, name))]
        found += len(written.unplain) - len(kept)
        written.unplain = kept
        if not found:
            raise UsageError(f"cannot drop {drop!r}: the checkpoint has no tensor, value or "
                             "entry of that name", "see `ckptool inspect` for its keys")
        plan.dropped.append(drop)


def _under(written: Written, fqn: str, entry: str) -> bool:
    """Whether ``fqn`` was saved under the entry ``entry`` (its path starts there)."""
    path = written.paths.get(fqn, (fqn,))
    steps = entry.split(".")
    return len(path) > len(steps) and [str(p) for p in path[:len(steps)]] == steps


def _rename(source: Checkpoint, written: Written, opts: FixOptions, plan: Plan) -> None:
    """Rename the main state dict's names inside their entry."""
    sd = source.main_state_dict
    if sd is None:
        raise UsageError("no state dict to rename keys in", "see `ckptool inspect`")
    entry = source.metadata.get("state_dict_entry")
    head = f"{entry}." if isinstance(entry, str) and entry else ""
    inner = {k: k[len(head):] for k in sd.keys if k.startswith(head) and k in written.tensors}
    wrapper = wrapper_prefix(inner.values(), common_prefix(inner.values()))
    rename = key_function(opts, wrapper)
    names: dict[str, str] = {}
    for fqn, name in inner.items():
        new = head + rename(name)
        if new in names.values() or (new not in inner and new in written.tensors):
            raise UsageError(f"two keys would both become {new!r}",
                             "check the prefixes and --rename patterns")
        names[fqn] = new
        if new != fqn:
            plan.renames.append((fqn, new))
    if opts.strip_module and not wrapper:
        plan.notes.append("--strip-module: no module./_orig_mod./model. prefix found")
    written.tensors = {names.get(n, n): t for n, t in written.tensors.items()}
    paths = {}
    for n, p in written.paths.items():
        new = names.get(n, n)
        if new != n:  # the entry stays; the name inside it is the new one
            p = (p[0], new[len(head):]) if head and p[0] == entry else (new,)
        paths[new] = p
    written.paths = paths
