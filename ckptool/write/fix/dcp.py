"""``fix`` on a ``torch.distributed.checkpoint`` directory: the same layout,
fixed, written to a new directory by torch's own writer.

The whole checkpoint is kept (every tensor, the optimizer state, the
values), nested as it was saved (``convert_plan``'s WHOLE plan). Key options
rename the model's keys: the names inside the entry the state dict was saved
under (``model.module.fc.weight`` is ``fc.weight`` of ``model`` after
``--strip-module``), as they rename a single file's state-dict keys; the
entry's own name is how it loads (``dcp.load({"model": sd})``) and stays.
An optimizer state saved beside it with the model's names (what
``torch.distributed.checkpoint.state_dict.get_state_dict`` writes:
``optim.state.module.fc.weight.exp_avg``, and the names in each param
group's ``params``) is renamed by the same rule, so that ``set_state_dict``
loads both into the renamed model; a name in it that is not the model's is
left as it is, and the result says so.
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

from ckptool.describe import plural, shell_word
from ckptool.errors import UsageError
from ckptool.keys import escape, unescape
from ckptool.model import Checkpoint
from ckptool.read.prefixes import common_prefix, wrapper_prefix
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.directory import write_directory
from ckptool.write.convert.folder import Extra
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
    extras = [] if opts.salvage else [Extra(f.path, os.path.join(source.directory, f.path))
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
    taken: set[str] = set()  # the new names (a set: 100,000 keys are checked each once)
    for fqn, name in inner.items():
        new = head + rename(name)
        if new in taken or (new not in inner and new in written.tensors):
            raise UsageError(f"two keys would both become {new!r}",
                             "check the prefixes and --rename patterns")
        names[fqn] = new
        taken.add(new)
        if new != fqn:
            plan.renames.append((fqn, new))
    if opts.strip_module and not wrapper:
        plan.notes.append("--strip-module: no module./_orig_mod./model. prefix found")
    written.tensors = {names.get(n, n): t for n, t in written.tensors.items()}
    # the path of the entry the model was saved under: ("model",), or
    # ("app", "model") for the DCP recipe's AppState
    entry_path = next((written.paths[k][:-1] for k in inner if k in written.paths), ())
    paths = {}
    for n, p in written.paths.items():
        new = names.get(n, n)
        if new != n:  # the entry stays; the name inside it is the new one
            p = (*entry_path, new[len(head):]) if head else (new,)
        paths[new] = p
    written.paths = paths
    moved = {old[len(head):]: new[len(head):] for old, new in names.items() if new != old}
    params = set(inner.values())
    _rename_optimizers(written, moved, params, plan)
    _rename_flat_optimizers(written, moved, params, entry_path, plan)


def _rename_optimizers(written: Written, moved: dict[str, str], params: set[str],
                       plan: Plan) -> None:
    """Rename, as the model's keys were (``moved``: old name -> new), the
    parameter names of every optimizer state keyed by them: under
    ``OPT.state.NAME...`` and in ``OPT.param_groups.N.params`` (``OPT``: a
    path holding both ``state`` and ``param_groups``). ``params``: the model's
    names; a state keyed by another string is left, and noted."""
    optimizers = {p[:i] for p in written.paths.values() for i in range(len(p))
                  if p[i] == "param_groups"}
    if not optimizers:
        return
    renamed: dict[str, tuple[str | int, ...]] = {}  # old fqn -> new path
    others: dict[str, set[str]] = {}  # optimizer -> names that are not the model's
    for fqn, p in written.paths.items():
        for i in range(len(p) - 2):
            if p[i] != "state" or p[:i] not in optimizers or not isinstance(p[i + 1], str):
                continue
            name = str(p[i + 1])
            if name in moved:
                renamed[fqn] = (*p[:i + 1], moved[name], *p[i + 2:])
            elif name not in params:
                others.setdefault(_dotted(p[:i]), set()).add(name)
            break
    _move(written, renamed, plan)
    groups = 0
    for fqn, p in written.paths.items():
        value = written.entries.get(fqn)
        if len(p) >= 3 and p[-1] == "params" and p[:-3] in optimizers \
                and p[-3] == "param_groups" and isinstance(value, list):
            strings = [v for v in value if isinstance(v, str)]
            others.setdefault(_dotted(p[:-3]), set()).update(v for v in strings
                                                             if v not in params)
            written.entries[fqn] = [moved.get(v, v) if isinstance(v, str) else v
                                    for v in value]
            groups += sum(1 for v in strings if v in moved)
    if groups:
        plan.notes.append(f"the optimizer state follows the model's keys: {groups} "
                          "parameter name(s) in its param_groups renamed as well")
    for where, odd in sorted(others.items()):
        if odd:
            plan.notes.append(
                f"{where}: {len(odd)} parameter name(s) of the optimizer state are no key of "
                f"the model (e.g. {sorted(odd)[0]!r}): left as they are, so they will not "
                "load by the model's new names")


FLAT_KINDS = ("state", "param_groups")


def _rename_flat_optimizers(written: Written, moved: dict[str, str], params: set[str],
                            entry_path: tuple[str | int, ...], plan: Plan) -> None:
    """The same for an optimizer state saved flat (``get_state_dict`` with
    ``flatten_optimizer_state_dict=True``, torchtitan's default): one key per
    value under its entry, ``state.NAME.exp_avg`` and
    ``param_groups.NAME.lr``, ``NAME`` a parameter's dotted name (found as
    the longest of the model's names the key starts with)."""
    renamed: dict[str, tuple[str | int, ...]] = {}
    for fqn, p in written.paths.items():
        if len(p) < 2 or p[:-1] == entry_path or not isinstance(p[-1], str):
            continue
        kind, _, rest = p[-1].partition(".")
        if kind not in FLAT_KINDS:
            continue
        parts = rest.split(".")
        name = next((n for n in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
                     if n in params), None)
        if name is not None and name in moved:
            renamed[fqn] = (*p[:-1], f"{kind}.{moved[name]}{rest[len(name):]}")
    if not renamed:
        return
    values = sum(1 for f in renamed if f in written.entries)
    _move(written, renamed, plan)
    plan.notes.append(f"the optimizer state, saved flat, follows the model's keys: "
                      f"{plural(len(renamed), 'key')} renamed as well ({values} of its "
                      "param_groups' values)")


def _move(written: Written, renamed: dict[str, tuple[str | int, ...]], plan: Plan) -> None:
    """Give the optimizer state's keys in ``renamed`` (old key -> new path)
    their new names, tensors and values alike; two keys that would become one
    are refused."""
    names = {fqn: _dotted(p) for fqn, p in renamed.items()}
    clash = set(names.values()) & (set(written.paths) - set(names))
    if clash:
        raise UsageError(f"two keys of the optimizer state would both become "
                         f"{sorted(clash)[0]!r}", "check the prefixes and --rename patterns")
    for held in (written.tensors, written.entries):
        for fqn in [f for f in held if f in names]:
            held[names[fqn]] = held.pop(fqn)
            if held is written.tensors:
                plan.renames.append((fqn, names[fqn]))
    written.paths = {names.get(f, f): renamed.get(f, p) for f, p in written.paths.items()}


def _dotted(path: tuple[str | int, ...]) -> str:
    """A path of the saved tree as DCP flattens it into a key."""
    return ".".join(str(p) for p in path)
