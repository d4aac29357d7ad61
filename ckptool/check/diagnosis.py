"""``ckptool diagnose``: why a checkpoint will not load on a target machine
or into a model, as findings with stable codes, and the one ``ckptool fix``
command that repairs everything fixable at once.

Each check is a small function returning findings. The fix command is not
guessed: it is planned with the same core as ``ckptool fix --dry-run``
before it is printed, so a command that ``fix`` would refuse is never shown.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool.check import loadcheck
from ckptool.check.gpus import Machine, fits, pick, probe
from ckptool.check.loadcheck import TagLoad
from ckptool.check.modelspec import ModelKeys
from ckptool.check.reconcile import KeyReport, ShapeHint, explain_shapes, reconcile
from ckptool.describe import human_bytes
from ckptool.errors import EXIT_FINDINGS, EXIT_OK, CkptoolError
from ckptool.model import Checkpoint
from ckptool.read.prefixes import describe_wrapper
from ckptool.write.plan import FixOptions

ERROR, WARNING = "error", "warning"  # error: loading fails; warning: not as wanted
# entries where training scripts keep their settings: constructor values
SETTINGS = ("hyper_parameters", "hparams", "args", "config", "cfg", "opt", "params")


@dataclass(frozen=True)
class Finding:
    code: str  # stable: device-unavailable, key-prefix, wrapped-state-dict...
    severity: str  # error (loading fails) or warning (loads, but not as wanted)
    message: str
    fix: str | None = None  # a runnable ckptool command, or a code change
    snippet: str | None = None  # the same fix as Python, where there is one
    keys: tuple[str, ...] = ()  # the keys concerned, for missing/unexpected/mismatch


@dataclass
class Diagnosis:
    checkpoint: Checkpoint
    machine: Machine
    tags: list[TagLoad]
    findings: list[Finding]
    model: ModelKeys | None = None
    keys: KeyReport | None = None
    shape_hints: list[ShapeHint] = field(default_factory=list)
    fix_command: str | None = None
    fix_output: str | None = None  # the file fix_command writes
    fix_refused: str | None = None  # why no command could be planned
    fix_options: FixOptions | None = None  # what fix_command asks for

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.findings else EXIT_OK

    @property
    def remaining(self) -> list[str]:
        """Codes of findings that ``fix_command`` does not repair."""
        fixed = self.fix_command is not None
        return [f.code for f in self.findings
                if not (fixed and f.fix and f.fix.startswith("ckptool fix "))]

    def load_errors(self) -> list[str]:
        """What plain ``torch.load(path)`` raises here, one line per cause."""
        out = [f"RuntimeError: {t.error}" for t in self.tags if t.error]
        refused = loadcheck.refused_globals(self.checkpoint)
        if not loadcheck.weights_only_default():
            return out
        if self.checkpoint.format == "torchscript":
            out.append("RuntimeError: Cannot use ``weights_only=True`` with TorchScript "
                       "archives passed to ``torch.load``.")
        elif refused:
            out.append(f"UnpicklingError: Weights only load failed. ... Unsupported global: "
                       f"GLOBAL {refused[0]} was not an allowed global by default.")
        return out


def diagnose(ckpt: Checkpoint, machine: Machine | None = None,
             model: ModelKeys | None = None) -> Diagnosis:
    """Every finding about ``ckpt`` loading on ``machine`` (default: this
    one) and into ``model`` (from ``modelspec``), when given."""
    if machine is None:
        machine = probe()
    tags = loadcheck.plan_tags(ckpt, machine)
    result = Diagnosis(ckpt, machine, tags, [], model)
    opts = FixOptions()
    name = shell_name(ckpt.path)
    result.findings += _format(ckpt, name)
    result.findings += _devices(ckpt, tags, machine, opts, name)
    result.findings += _memory(tags, machine)
    result.findings += _wrapping(ckpt, opts, name)
    result.findings += _globals(ckpt, opts, name)
    if ckpt.main_state_dict is not None and model is not None:
        tensors = ckpt.state_dict()
        names = ckpt.main_state_dict.keys  # extra-state entries too: strict loading checks them
        result.keys = reconcile({n: tensors[n].shape if n in tensors else None for n in names},
                                model.shapes, model.tied)
        result.shape_hints = explain_shapes(result.keys.mismatched, model.arguments,
                                            saved_settings(ckpt.root))
        result.findings += _keys(ckpt, result.keys, result.shape_hints, model, opts, name)
    elif ckpt.main_state_dict is not None:
        result.findings += _bare_prefix(ckpt, opts, name)
    _plan_command(result, opts)
    return result


# -- findings ---------------------------------------------------------------

def _format(ckpt: Checkpoint, name: str) -> list[Finding]:
    if ckpt.format != "torchscript":
        return []
    return [Finding(
        "torchscript", WARNING,
        "this is a TorchScript archive: plain torch.load refuses it (weights_only) and "
        "load_state_dict cannot take it; torch.jit.load runs its code",
        f"ckptool convert {name} {shell_name(_stem(ckpt.path) + '.safetensors')}",
        f"torch.jit.load({os.path.basename(ckpt.path)!r}, map_location='cpu').state_dict()")]


def _devices(ckpt: Checkpoint, tags: list[TagLoad], machine: Machine, opts: FixOptions,
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
    saved = ", ".join(f"{_n(t.tensors, 'tensor')} ({human_bytes(t.nbytes)}) on {t.location}"
                      for t in failing)
    return [Finding(
        "device-unavailable", ERROR,
        f"plain torch.load fails on {describe_machine(machine)}: the file saved {saved}",
        f"ckptool fix {name} {flags}",
        f"torch.load({os.path.basename(ckpt.path)!r}, map_location={where})")]


def _best_device(machine: Machine, need: int) -> str:
    """The GPU with the most free memory, unless the bytes do not fit there."""
    gpu = pick(machine, need) if machine.device_count else None
    if gpu is None or fits(gpu, need) is False:
        return "cpu"
    return f"cuda:{gpu.index}"


def _memory(tags: list[TagLoad], machine: Machine) -> list[Finding]:
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


def _wrapping(ckpt: Checkpoint, opts: FixOptions, name: str) -> list[Finding]:
    sd = ckpt.main_state_dict
    if sd is None:
        return [Finding("no-state-dict", WARNING,
                        "no state dict found: no dict of tensors a model could load, so "
                        "there are no keys to compare with a model")]
    if sd.kind == "module" and ckpt.format != "torchscript":
        opts.extract = "auto"
        where = f"'{sd.path}'" if sd.path else "the file"
        return [Finding(
            "pickled-module", ERROR,
            f"{where} is a whole pickled nn.Module, not a state dict: plain torch.load "
            "refuses it (weights_only) and loading it needs its class importable",
            f"ckptool fix {name} --extract", "model.load_state_dict(torch.load(path, "
            "weights_only=False).state_dict())  # only for a trusted file")]
    if not sd.path:
        return []
    opts.extract = "auto"
    others = [k for k in _top_keys(ckpt) if k != sd.path.split("/")[0]]
    beside = f" next to {', '.join(others[:6])}" if others else ""
    index = "".join(f"[{p}]" if p.isdigit() else f"[{p!r}]" for p in sd.path.split("/"))
    return [Finding(
        "wrapped-state-dict", WARNING,
        f"the weights are the state dict under '{sd.path}'{beside}: "
        "load_state_dict(torch.load(path)) needs that entry taken out",
        f"ckptool fix {name} --extract", f"model.load_state_dict(torch.load(path){index})")]


def _top_keys(ckpt: Checkpoint) -> list[str]:
    seen = [t.key.split("/")[0] for t in ckpt.tensors] + [e.key.split("/")[0]
                                                          for e in ckpt.entries]
    return list(dict.fromkeys(seen))


def _globals(ckpt: Checkpoint, opts: FixOptions, name: str) -> list[Finding]:
    out = []
    unsafe = ckpt.unsafe_globals
    # keeping only the weights leaves the rest behind (checked by the dry run)
    extract = f"ckptool fix {name} --extract" if ckpt.main_state_dict else None
    if unsafe:
        opts.extract = opts.extract or ("auto" if extract else None)
        out.append(Finding(
            "unsafe-globals", ERROR,
            f"the file names {', '.join(unsafe)}: torch.load(weights_only=False) would run "
            "it; never load this file with torch.load unless you wrote it", extract))
    refused = [n for n in loadcheck.refused_globals(ckpt) if n not in unsafe]
    module = ckpt.main_state_dict is not None and ckpt.main_state_dict.kind == "module"
    if refused and not module and loadcheck.weights_only_default():
        opts.extract = opts.extract or ("auto" if extract else None)
        out.append(Finding(
            "weights-only", ERROR,
            f"plain torch.load (weights_only=True, the default since torch 2.6) refuses "
            f"globals the file names: {', '.join(refused[:5])}"
            f"{' and more' if len(refused) > 5 else ''}",
            extract,
            f"with torch.serialization.safe_globals([{', '.join(refused[:5])}]): "
            "torch.load(path)  # only for classes you trust"))
    return out


def _bare_prefix(ckpt: Checkpoint, opts: FixOptions, name: str) -> list[Finding]:
    sd = ckpt.main_state_dict
    if sd is None or not sd.prefix:
        return []
    opts.strip_module = True
    return [Finding(
        "key-prefix", WARNING,
        f"every key starts with {sd.prefix!r} ({describe_wrapper(sd.prefix)}): the bare model "
        "expects them without it (pass --model to check against yours)",
        f"ckptool fix {name} --strip-module")]


def _keys(ckpt: Checkpoint, report: KeyReport, hints: list[ShapeHint], model: ModelKeys,
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
            f"{report.before} of {total} keys match as saved, "
            f"{len(report.matched) + len(report.mismatched)} after the rewrite",
            f"ckptool fix {name} {flags}"))
    tied = report.tied_missing
    missing = [k for k in report.missing if k not in tied]
    if missing:
        out.append(Finding(
            "missing-keys", ERROR,
            f"{len(missing)} of {total} keys of {model.source} are not in the file: "
            f"{_some(missing)}{_why_missing(missing)}", None, None, tuple(missing)))
    if tied:
        pairs = ", ".join(f"{k} (tied to {v})" for k, v in list(tied.items())[:3])
        out.append(Finding(
            "tied-keys", WARNING,
            f"{len(tied)} missing keys are tied weights whose twin the file has: {pairs}; "
            "strict loading still wants them",
            None, "model.load_state_dict(sd, strict=False)  # the tie fills them",
            tuple(tied)))
    if report.unexpected:
        out.append(Finding(
            "unexpected-keys", ERROR,
            f"{_n(len(report.unexpected), 'key')} in the file "
            f"{'is' if len(report.unexpected) == 1 else 'are'} not in {model.source}: "
            f"{_some(report.unexpected)}", None,
            "model.load_state_dict(sd, strict=False)  # ignores them",
            tuple(report.unexpected)))
    if report.mismatched:
        shown = "; ".join(f"{k}: file {list(a)} vs model {list(b)}"
                          for k, a, b in report.mismatched[:3])
        more = f" (and {len(report.mismatched) - 3} more)" if len(report.mismatched) > 3 else ""
        out.append(Finding(
            "shape-mismatch", ERROR,
            f"{_n(len(report.mismatched), 'key')} "
            f"differ{'s' if len(report.mismatched) == 1 else ''} in shape: {shown}{more}"
            + "".join(f"; {explain(h, len(hints) == 1)}" for h in hints[:2]),
            _argument_fix(hints, model), None, tuple(k for k, _, _ in report.mismatched)))
    return out


def _why_missing(missing: list[str]) -> str:
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
        text = f"{_n(hint.keys, 'key')} {'has' if hint.keys == 1 else 'have'} a dimension that is"
    text += f" {hint.file_value} in the file and {hint.model_value} in the model"
    if hint.arguments:
        args = " or ".join(f"{a}={hint.model_value}" for a in hint.arguments)
        text += f": the model was built with {args}"
    if hint.saved:
        text += f"; the checkpoint's saved settings have {hint.saved[0]}={hint.file_value}"
    return text


def _argument_fix(hints: list[ShapeHint], model: ModelKeys) -> str | None:
    """The constructor call that would give the file's shapes."""
    for hint in hints:
        if hint.arguments:
            saved = {s.split(".")[-1] for s in hint.saved}
            name = next((a for a in hint.arguments if a in saved), hint.arguments[0])
            args = {**model.given, name: hint.file_value}
            return f"{model.name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    return None


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")


def saved_settings(root: Any) -> dict[str, Any]:
    """Scalar settings the checkpoint saved (Lightning hyper_parameters, an
    argparse Namespace under 'args'...), flattened with dots."""
    out: dict[str, Any] = {}
    if not isinstance(root, dict):
        return out
    for key in SETTINGS:
        if key in root:
            _flatten(root[key], "", out, 3)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any], depth: int) -> None:
    items: Any = None
    if isinstance(value, dict):
        items = value
    elif hasattr(value, "dictitems") and getattr(value, "dictitems", None):
        items = value.dictitems
    elif isinstance(getattr(value, "state", None), dict):
        items = value.state
    if items is None or depth == 0:
        return
    for k, v in items.items():
        if not isinstance(k, str):
            continue
        if isinstance(v, (int, float, str, bool)):
            out.setdefault(prefix + k, v)
        else:
            _flatten(v, f"{prefix}{k}.", out, depth - 1)


# -- the one command ----------------------------------------------------------

def _plan_command(result: Diagnosis, opts: FixOptions) -> None:
    """Turn the options the findings asked for into one checked command."""
    if opts == FixOptions():
        return
    from ckptool.write.preview import preview
    from ckptool.write.rewrite import default_output

    ckpt = result.checkpoint
    output = default_output(ckpt.path)
    stem, ext = os.path.splitext(output)
    n = 2
    while os.path.lexists(output):  # one new file: never one fix would refuse to replace
        output, n = f"{stem}{n}{ext}", n + 1
    try:
        # fix's own dry run, planned from the checkpoint already read rather
        # than from a second read of the file (tests/test_preview.py holds
        # the two to the same plan)
        preview(ckpt, opts)
    except CkptoolError as exc:
        result.fix_refused = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        # a finding never offers a command that fix would refuse
        result.findings = [replace(f, fix=None) if f.fix and f.fix.startswith("ckptool fix")
                           else f for f in result.findings]
        return
    result.fix_output = os.path.basename(output)
    result.fix_options = opts
    result.fix_command = fix_command_line(ckpt.path, opts, output)


def fix_command_line(path: str, opts: FixOptions, output: str) -> str:
    """The ``ckptool fix`` command that writes ``opts``' fix of ``path`` to
    ``output``, run from ``path``'s folder."""
    return " ".join(["ckptool", "fix", shell_name(path), *command_flags(opts),
                     "-o", shell_name(output)])


def command_flags(opts: FixOptions) -> list[str]:
    """``ckptool fix`` flags for ``opts`` (the ones diagnose sets)."""
    flags = []
    if opts.extract is not None:
        flags.append("--extract")
    if opts.strip_module:
        flags.append("--strip-module")
    flags += [f"--strip-prefix {shlex.quote(p)}" for p in opts.strip_prefixes]
    if opts.add_prefix:
        flags.append(f"--add-prefix {shlex.quote(opts.add_prefix)}")
    if opts.to:
        flags.append(f"--to {opts.to}")
    flags += [f"--map {a}={b}" for a, b in opts.maps]
    return flags


def describe_machine(machine: Machine) -> str:
    if machine.source == "assumed":
        n = machine.device_count
        return f"a machine with {n} visible CUDA GPU{'s' if n != 1 else ''}"
    if not machine.device_count:
        return "this machine (no usable CUDA GPU)"
    n = machine.device_count
    return f"this machine ({n} visible CUDA GPU{'s' if n != 1 else ''})"


def describe_target(machine: Machine) -> str:
    """The machine a diagnosis was made for, with what was noticed about it."""
    target = describe_machine(machine)
    if machine.note and machine.source != "assumed":
        target += f"; {machine.note}"
    return target


def describe_landing(machine: Machine, tag: TagLoad) -> str:
    """Where plain ``torch.load`` puts a saved device's tensors (a GPU with its
    physical number and free memory), or "-" (a tag whose load fails has its
    error instead: callers say so)."""
    if tag.lands and tag.lands.startswith("cuda:"):
        gpu = machine.gpus[int(tag.lands[5:])]
        extra = f" (physical GPU {tag.physical})" if tag.physical is not None else ""
        free = f" · {human_bytes(gpu.free_bytes)} free" if gpu.free_bytes is not None else ""
        return f"{tag.lands}{extra}{free}"
    return tag.lands or "-"


def describe_keys(d: Diagnosis) -> str | None:
    """The key comparison with the model in one line, or None without a model."""
    if d.keys is None or d.model is None:
        return None
    k = d.keys
    line = f"{d.model.source}: {k.expected} expected · {k.before} match as saved"
    if not k.rewrite.empty:
        line += f" · {len(k.matched) + len(k.mismatched)} after the rewrite"
    return line + (f" · {len(k.missing)} missing · {len(k.unexpected)} unexpected · "
                   f"{len(k.mismatched)} shape")


def shell_name(path: str) -> str:
    """``path``'s file name as a shell word that no command takes for an option."""
    name = os.path.basename(path)
    return shlex.quote(f"./{name}" if name.startswith("-") else name)


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]
