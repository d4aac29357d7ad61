"""The findings of ``ckptool diagnose``, one small function per kind of problem.

Each function looks at one side of the checkpoint (its format, the devices
its storages name, the memory they need, how the weights are wrapped, the
globals it names, its keys against a model) and returns ``Finding``s with a
stable ``code``. Where ``ckptool fix`` can repair a problem, the function
also sets the options that do it on the ``FixOptions`` it is given, so that
``ckptool.check.diagnosis`` plans one command for all of them.
"""

from __future__ import annotations

from ckptool.check import loadcheck, manyfiles, notes
from ckptool.check.finding import ERROR, INFO, WARNING, Finding
from ckptool.check.fixcommand import stem
from ckptool.check.gpus.machine import Machine, describe_machine, fits, pick
from ckptool.check.loadcheck import TagLoad
from ckptool.check.modelspec import ModelKeys
from ckptool.check.reconcile import KeyReport, ShapeHint
from ckptool.describe import human_bytes, plural, shell_word
from ckptool.keys import pieces, split_key
from ckptool.model import Checkpoint, GlobalInfo
from ckptool.read import companions
from ckptool.read.pickle import policy
from ckptool.read.pickle.policy import UNSAFE
from ckptool.read.prefixes import common_prefix, describe_wrapper, split_wrappers, wrapper_prefix
from ckptool.write.fix.flags import flags as command_flags
from ckptool.write.fix.plan import FixOptions

__all__ = ["ERROR", "INFO", "WARNING", "Finding"]  # (defined in ckptool.check.finding)


def format_findings(ckpt: Checkpoint, name: str) -> list[Finding]:
    if ckpt.format != "torchscript":
        return []
    return [Finding(
        "torchscript", WARNING,
        "this is a TorchScript archive: plain torch.load refuses it (weights_only) and "
        "load_state_dict cannot take it; torch.jit.load runs its code",
        # its weights as a torch.save state dict, which torch.load and fix take
        f"ckptool convert {name} {shell_word(_weights_name(ckpt.path))}",
        f"torch.jit.load({ckpt.path!r}, map_location='cpu').state_dict()")]


def _weights_name(path: str) -> str:
    """``x.pt`` -> ``x.pth``; ``x.pth`` (a TorchScript archive so named) -> ``x.weights.pth``."""
    pth = stem(path) + ".pth"
    return pth if pth != path else stem(path) + ".weights.pth"


def device_findings(ckpt: Checkpoint, tags: list[TagLoad], machine: Machine, opts: FixOptions,
             name: str) -> list[Finding]:
    failing = [t for t in tags if t.error]
    if not failing:
        return []
    target = _best_device(machine, sum(t.nbytes for t in failing))
    every = all(t.error or t.location == target for t in tags)
    if every:
        opts.to = target
        flags = f"--to {target}"
        where: str = repr(target)
    else:
        opts.maps = tuple((t.location, target) for t in failing)
        flags = " ".join(f"--map {t.location}={target}" for t in failing)
        where = "{" + ", ".join(f"{t.location!r}: {target!r}" for t in failing) + "}"
    saved = ", ".join(f"{plural(t.tensors, 'tensor')} ({human_bytes(t.nbytes)}) on {t.location}"
                      for t in failing)
    if ckpt.is_multifile:  # .bin shards: each a torch file; their loaders map them
        return [Finding(
            "device-unavailable", WARNING,
            f"plain torch.load of its shards fails on {describe_machine(machine)}: the shards "
            f"saved {saved}; {manyfiles.loader(ckpt)} and from_pretrained load them to the "
            "CPU unless told otherwise",
            f"ckptool fix {name} {flags}", manyfiles.load_snippet(ckpt, target))]
    return [Finding(
        "device-unavailable", ERROR,
        f"plain torch.load fails on {describe_machine(machine)}: the file saved {saved}",
        f"ckptool fix {name} {flags}",
        f"torch.load({ckpt.path!r}, map_location={where})")]


def _best_device(machine: Machine, need: int) -> str:
    """The GPU with the most free memory, unless the bytes do not fit there."""
    gpu = pick(machine, need) if machine.device_count else None
    if gpu is None or fits(gpu, need) is False:
        return "cpu"
    return f"cuda:{gpu.index}"


def memory_findings(tags: list[TagLoad], machine: Machine) -> list[Finding]:
    out = []
    for index, nbytes in sorted(loadcheck.bytes_per_gpu(tags).items()):
        free = machine.gpus[index].free_bytes
        if free is not None and nbytes > free:
            out.append(Finding(
                "device-memory", WARNING,
                f"plain torch.load puts {human_bytes(nbytes)} on cuda:{index}, which has "
                f"{human_bytes(free)} free: it will run out of memory",
                None, "torch.load(path, map_location='cpu')"))
    return out


def wrapping_findings(ckpt: Checkpoint, opts: FixOptions, name: str) -> list[Finding]:
    sd = ckpt.main_state_dict
    if sd is None:
        return [Finding("no-state-dict", WARNING, companions.why_no_weights(ckpt))]
    # the entry's place as Python indexing: ['model'], [0]['state_dict']...
    index = "".join(f"[{p}]" if p.isdigit() else f"[{p!r}]"
                    for p in split_key(sd.path))
    if sd.kind == "module" and ckpt.format != "torchscript":
        opts.extract = "auto"
        where = f"'{sd.path}'" if sd.path else "the file"
        return [Finding(
            "pickled-module", ERROR,
            f"{where} is a whole pickled nn.Module, not a state dict: plain torch.load "
            "refuses it (weights_only) and loading it needs its class importable",
            f"ckptool fix {name} --extract", f"model.load_state_dict(torch.load(path, "
            f"weights_only=False){index}.state_dict())  # only for a trusted file")]
    if not sd.path:
        return []
    opts.extract = "auto"
    others = [k for k in _top_keys(ckpt) if k != pieces(sd.path)[0]]
    beside = f" next to {', '.join(others[:6])}" if others else ""
    return [Finding(
        "wrapped-state-dict", WARNING,
        f"the weights are the state dict under '{sd.path}'{beside}: "
        "load_state_dict(torch.load(path)) needs that entry taken out",
        f"ckptool fix {name} --extract", f"model.load_state_dict(torch.load(path){index})")]


def _top_keys(ckpt: Checkpoint) -> list[str]:
    seen = [pieces(t.key)[0] for t in ckpt.tensors] + [pieces(e.key)[0]
                                                       for e in ckpt.entries]
    return list(dict.fromkeys(seen))


def global_findings(ckpt: Checkpoint, opts: FixOptions, name: str) -> list[Finding]:
    out = []
    unsafe = [g for g in ckpt.globals if g.category == UNSAFE]
    # keeping only the weights leaves the rest behind (checked by the dry run)
    extract = f"ckptool fix {name} --extract" if ckpt.main_state_dict else None
    if unsafe:
        opts.extract = opts.extract or ("auto" if extract else None)
        opts.salvage = bool(extract)  # a flagged file is written from only when asked
        # what loading does with it, where that is what makes it unsafe
        how = "".join(f"; {g.reason}" for g in unsafe if g.reason.startswith(
            ("calls", "a value stored through", "unknown:", "called by")))
        out.append(Finding(
            "unsafe-globals", ERROR,
            f"the file names {', '.join(g.name for g in unsafe)}{how}: "
            "torch.load(weights_only=False) would run it; never load this file with "
            "torch.load unless you wrote it", extract))
    refused = set(loadcheck.refused_globals(ckpt))
    allowed_to_ask = [g for g in ckpt.globals if g.name in refused and g.category != UNSAFE]
    module = ckpt.main_state_dict is not None and ckpt.main_state_dict.kind == "module"
    if allowed_to_ask and not module and loadcheck.weights_only_default():
        opts.extract = opts.extract or ("auto" if extract else None)
        names = [g.name for g in allowed_to_ask]
        # torch's allowlist lets weights_only call what it lists with the
        # file's arguments: only for a class made without its constructor
        harmless = [g.name for g in allowed_to_ask if _made_harmlessly(g)]
        called = [g.name for g in allowed_to_ask if g.name not in harmless]
        why = (f"; {', '.join(called[:3])} {'is' if len(called) == 1 else 'are'} called with "
               "the file's arguments at load time, and allowing "
               f"{'it' if len(called) == 1 else 'them'} would run that code on whatever "
               "the file says" if called else "")
        out.append(Finding(
            "weights-only", ERROR,
            f"plain torch.load (weights_only=True, the default since torch 2.6) refuses "
            f"globals the file names: {', '.join(names[:5])}"
            f"{' and more' if len(names) > 5 else ''}{why}",
            extract,
            f"with torch.serialization.safe_globals([{', '.join(harmless[:5])}]): "
            "torch.load(path)  # only for classes you trust" if harmless and not called
            else None))
    return out


def _made_harmlessly(g: GlobalInfo) -> bool:
    """A class the file only makes (``__new__``) and gives state, or names:
    what torch's allowlist can admit without running it on the file's data."""
    return policy.function_like(g.name) is False and not (
        {policy.CALLED, policy.CALLED_INSTANCE} & set(g.uses))


UNNAMED_RECORDS = "no object of the pickle names"  # read/formats/torch_zip.py
UNVIEWED_STORAGES = "that no listed tensor views"  # read/reader.py


def content_findings(ckpt: Checkpoint) -> list[Finding]:
    """What the file holds that its format does not (bytes after the end of
    a pickle): torch ignores it, but nothing a writer of checkpoints puts
    there; a rewrite leaves it behind."""
    rewrites = ckpt.format in ("torch-zip", "torch-legacy")
    fix = f"ckptool fix {shell_word(ckpt.path)}" if rewrites else None
    out = []
    for warning in ckpt.warnings:
        if UNNAMED_RECORDS in warning or UNVIEWED_STORAGES in warning:  # no fix: harmless
            out.append(Finding("unreached-storage", WARNING, warning))
        elif ckpt.is_multifile:  # what reading its files noticed (a rank saved twice...)
            out.append(Finding("layout-warning", WARNING, warning))
        else:
            out.append(Finding("trailing-data", WARNING, warning, fix))
    return out


def prefix_findings(ckpt: Checkpoint, opts: FixOptions, name: str,
                    entry: str = "") -> list[Finding]:
    """A wrapper prefix every key shares; ``entry``: the DCP entry the keys
    were saved under (``model.``), which is no wrapper."""
    sd = ckpt.main_state_dict
    if sd is None or not sd.prefix:
        return []
    prefix = sd.prefix
    if entry:
        names = [k[len(entry):] for k in sd.keys]
        prefix = wrapper_prefix(names, common_prefix(names))
        if not prefix:
            return []
    after = f" after the {entry[:-1]!r} entry they were saved under" if entry else ""
    # without a model, only a prefix that is always a wrapper is advised away:
    # "model." may be the architecture's own (a fix would break a good file)
    wrapper, rest = split_wrappers(prefix)
    fw = ckpt.framework
    own = fw is not None and bool(fw.own_prefix) and rest == fw.own_prefix
    out = []
    kept = notes.saved_wrapper(fw, wrapper)  # one the folder's framework loads back
    if kept is not None:
        out.append(kept)
    elif wrapper:
        if rest:
            opts.strip_prefixes = (*opts.strip_prefixes, wrapper)
            flags = f"--strip-prefix {wrapper}"
        else:
            opts.strip_module = True
            flags = "--strip-module"
        out.append(Finding(
            "key-prefix", WARNING,
            f"every key starts with {wrapper!r} ({describe_wrapper(wrapper)}){after}: "
            "the bare model expects them without it (pass --model to check against yours)",
            f"ckptool fix {name} {flags}"))
    if rest and not own:
        out.append(Finding(
            "ambiguous-prefix", WARNING,
            f"every key{' then' if wrapper else ''} starts with {rest!r}: "
            f"{_readings(rest)}; which one depends on the model you load it into, so no "
            "fix is offered: pass --model to check the keys against yours"))
    return out


def _readings(prefix: str) -> str:
    """The two things an ambiguous prefix can be, in words."""
    if prefix.startswith("base_model.model."):
        return ("PEFT's own naming (load it into the PeftModel as it is) or a wrapper "
                "around the base model (strip it for the bare model)")
    return (f"either the model's own naming (transformers' decoders keep their layers under "
            f"'model.', and a class whose submodule is named {prefix.split('.')[0]!r} loads "
            f"them as they are) or a wrapper's attribute ({describe_wrapper(prefix)}: strip "
            "it for the bare model)")


def companion_findings(ckpt: Checkpoint) -> list[Finding]:
    """Files beside the model that loading them would run code from: a
    Trainer resuming from the folder ``torch.load``s them."""
    fw = ckpt.framework
    if fw is None:
        return []
    return [Finding(
        "unsafe-companion", ERROR,
        f"{c.path} ({c.role}), beside the model, names {', '.join(c.unsafe)}: "
        "torch.load(weights_only=False) of it would run that; resuming from this folder "
        "loads it. Delete the file, or never resume from this folder unless you wrote it")
        for c in fw.companions if c.unsafe]


def key_findings(ckpt: Checkpoint, report: KeyReport, hints: list[ShapeHint], model: ModelKeys,
          opts: FixOptions, name: str) -> list[Finding]:
    out = []
    rw = report.rewrite
    total = report.expected
    if not rw.empty:
        changes = []
        if rw.strip:
            changes.append(f"without {rw.strip!r}")
        if rw.add:
            changes.append(f"with {rw.add!r} in front")
        sd = ckpt.main_state_dict
        if rw.strip and sd is not None and rw.strip == sd.prefix:
            opts.strip_module = True
        elif rw.strip:
            opts.strip_prefixes = (rw.strip,)
        opts.add_prefix = rw.add or None
        flags = " ".join(command_flags(FixOptions(
            strip_module=opts.strip_module, strip_prefixes=opts.strip_prefixes,
            add_prefix=opts.add_prefix)))
        out.append(Finding(
            "key-prefix", ERROR,
            f"{model.source} expects its keys {' and '.join(changes)}: "
            f"{report.before} of {plural(total, 'key')} match as saved, "
            f"{len(report.matched) + len(report.mismatched)} after the rewrite",
            f"ckptool fix {name} {flags}"))
    tied = report.tied_missing
    missing = [k for k in report.missing if k not in tied]
    if missing:
        out.append(Finding(
            "missing-keys", ERROR,
            f"{len(missing)} of {plural(total, 'key')} of {model.source} "
            f"{'is' if len(missing) == 1 else 'are'} not in {_it(ckpt)}: "
            f"{some_keys(missing)}{why_missing(missing)}", None, None, tuple(missing)))
    if tied:  # (an INFO finding where the model ties them again as it loads)
        out.append(notes.tied(_it(ckpt), tied, model))
    if report.unexpected:
        out.append(Finding(
            "unexpected-keys", ERROR,
            f"{plural(len(report.unexpected), 'key')} in {_it(ckpt)} "
            f"{'is' if len(report.unexpected) == 1 else 'are'} not in {model.source}: "
            f"{some_keys(report.unexpected)}", None,
            "model.load_state_dict(sd, strict=False)  # ignores them",
            tuple(report.unexpected)))
    if report.mismatched:
        shown = "; ".join(f"{k}: file {list(a)} vs model {list(b)}"
                          for k, a, b in report.mismatched[:3])
        more = f" (and {len(report.mismatched) - 3} more)" if len(report.mismatched) > 3 else ""
        out.append(Finding(
            "shape-mismatch", ERROR,
            f"{plural(len(report.mismatched), 'key')} "
            f"differ{'s' if len(report.mismatched) == 1 else ''} in shape: {shown}{more}"
            + "".join(f"; {explain(h, len(hints) == 1)}" for h in hints[:2]),
            _argument_fix(hints, model), None, tuple(k for k, _, _ in report.mismatched)))
    return out


def _it(ckpt: Checkpoint) -> str:
    return "the checkpoint" if ckpt.is_multifile else "the file"


def why_missing(missing: list[str]) -> str:
    stats = ("running_mean", "running_var", "num_batches_tracked")
    if all(k.rsplit(".", 1)[-1] in stats for k in missing):
        return (" (BatchNorm running statistics: the saved model's BatchNorm layers had "
                "track_running_stats=False, or this model's have it True)")
    return ""


def explain(hint: ShapeHint, only: bool = False) -> str:
    """One sentence a user can act on: which value differs and where it comes from.
    ``only``: this pair accounts for every mismatched dimension."""
    if only:
        text = "every mismatched dimension is"
    else:
        verb = "has" if hint.keys == 1 else "have"
        text = f"{plural(hint.keys, 'key')} {verb} a dimension that is"
    text += f" {hint.file_value} in the file and {hint.model_value} in the model"
    if hint.arguments:
        args = " or ".join(f"{a}={hint.model_value}" for a in hint.arguments)
        text += f": the model was built with {args}"
    if hint.saved:
        text += f"; the checkpoint's saved settings have {hint.saved[0]}={hint.file_value}"
    return text


def _argument_fix(hints: list[ShapeHint], model: ModelKeys) -> str | None:
    """The constructor call that would give the file's shapes: every argument
    that differs, each set to the file's value (one argument per pair of
    values, the one the checkpoint's saved settings name when they do)."""
    args = dict(model.given)
    changed = set()
    for hint in hints:
        free = [a for a in hint.arguments if a not in changed]
        if not free:
            continue
        saved = {s.split(".")[-1] for s in hint.saved}
        name = next((a for a in free if a in saved), free[0])
        args[name] = hint.file_value
        changed.add(name)
    if not changed:
        return None
    return f"{model.name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def some_keys(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")
