"""What each error ``explain_patterns`` recognises means, in the user's
terms, and what to do about it: ``Finding``s with diagnose's codes where
they mean the same thing (``device-unavailable``, ``key-prefix``...) and
explain's own for what happens after loading (``invalid-device-id``,
``dataparallel-primary-device``, ``device-mismatch``, ``cuda-oom``: those
are in ``explain_gpu``). An error recognised whose details the text does
not give (a message cut short) still gets a finding that says so.

Fixes name the checkpoint as ``name``: the file the user gave, or ``CKPT``
when they gave none. Pure text: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptool.check.explain import gpu
from ckptool.check.explain import patterns as p
from ckptool.check.explain.patterns import Error, Facts
from ckptool.check.findings import ERROR, Finding, some_keys, why_missing
from ckptool.check.findings import explain as explain_hint
from ckptool.check.loadcheck import TagLoad
from ckptool.check.reconcile import Rewrite, explain_shapes, reconcile
from ckptool.describe import plural
from ckptool.read.pickle import policy
from ckptool.read.prefixes import describe_wrapper, wrapper_prefix
from ckptool.read.reader import PREFERRED_NAMES
from ckptool.write.fix.flags import flags as command_flags
from ckptool.write.fix.plan import FixOptions

PLACEHOLDER = "CKPT"  # the checkpoint in a fix, when none was given
# what a refused global is, by ckptool's safety policy
_LABELS = {policy.DATA: "plain data, safe to allow", policy.TORCH: "part of torch",
           policy.CUSTOM: "a class from your code, imported to load it"}
# wrappers whose wrapped model is an attribute: class -> attribute
_WRAPPED = {"DataParallel": "module", "DistributedDataParallel": "module",
            "OptimizedModule": "_orig_mod"}


def findings_for(error: Error, name: str, device_count: int | None = None,
                 saved: Saved | None = None) -> list[Finding]:
    """What ``error`` means; ``device_count``: the GPUs the user says the
    process sees (``--device-count``), where the text does not say; ``saved``:
    where the checkpoint at hand saved its tensors (``saved_where``)."""
    if error.kind == p.DEVICE and saved is not None:
        return _device(error.facts, name, device_count, saved)
    return _EXPLAIN[error.kind](error.facts, name, device_count) or [_unread(error)]


@dataclass(frozen=True)
class Saved:
    """Where a checkpoint saved its tensors, against the device an error names."""

    said: str  # "the file saved 15 tensors on cuda:2"
    names_it: bool  # the error's device is among them
    recorded: bool = True  # False: a format that records no device (safetensors, DCP)

    def clause(self, device: str) -> str:
        if not self.recorded:
            return f"{self.said}: it cannot have raised this, another file saved on {device} did"
        return self.said if self.names_it else f"{self.said}, none on {device}"


def saved_where(tags: Sequence[TagLoad], device: str, it: str = "the file") -> Saved:
    """What ``it`` saved on which device (diagnose's tags), and whether
    ``device`` (an error's: ``cuda:3``, or ``cuda`` for any CUDA device) is
    one of them."""
    recorded = [t for t in tags if t.location != "unrecorded" and t.tensors]
    if not recorded:
        return Saved(f"{it} records no device for its tensors (it loads where it is asked)",
                     False, recorded=False)
    kind = device.partition(":")[0]
    names_it = any(t.location == device or (":" not in device
                                            and t.location.partition(":")[0] == kind)
                   for t in recorded)
    parts = [f"{plural(t.tensors, 'tensor')} on {t.location}" for t in recorded]
    return Saved(f"{it} saved {', '.join(parts)}", names_it)


def _unread(error: Error) -> Finding:
    """An error recognised whose text does not say enough to explain it."""
    if error.kind == p.KEYS:
        model = error.facts.get("model_class", "the model")
        return Finding(
            "state-dict-mismatch", ERROR,
            f"load_state_dict refused the state dict for {model}, but the text does not show "
            "which keys are missing, unexpected or of another shape (the message was cut "
            "short, or its lines were lost): paste the whole message, from 'Error(s) in "
            "loading state_dict' to its last line, or give --checkpoint and --model to "
            "compare the keys", None,
            "print(model.load_state_dict(sd, strict=False))  # lists the missing and "
            "unexpected keys")
    return Finding(error.kind, ERROR,
                   f"{error.line}: the text does not say enough to explain it; paste the whole "
                   "message, with the traceback above it")


def key_prefix(facts: Facts) -> dict[str, object] | None:
    """The prefix shared by the unexpected keys, as the rewrite that turns
    them into the missing ones (``strip``, ``add``, how many ``keys`` it
    turns), or, with no missing keys to match, the wrapper prefix every
    unexpected key has; None when there is none."""
    missing, unexpected = facts.get("missing", []), facts.get("unexpected", [])
    rewrite, fits = prefix_fit(missing, unexpected)
    if fits:
        return {"strip": rewrite.strip, "add": rewrite.add, "keys": len(fits)}
    shared = wrapper_prefix(unexpected) if unexpected and not missing else ""
    return {"strip": shared, "add": "", "keys": len(unexpected)} if shared else None


def _device(f: Facts, name: str, device_count: int | None,
            file: Saved | None = None) -> list[Finding]:
    device, backend = f["device"], f["backend"]
    count = f.get("device_count") if device_count is None else device_count
    saved = ("torch.load puts every storage back on the device it was saved on, and "
             + (file.clause(device) if file else f"the file saved some on {device}"))
    if file is not None and file.recorded and not file.names_it:
        saved += (f" (the error names {device}: it probably came from another file, or this "
                  "one was rewritten since)")
    if backend == "cuda" and count:
        gpus = ", ".join(f"cuda:{i}" for i in range(count))
        return [Finding(
            p.DEVICE, ERROR,
            f"{saved}; the process that loaded it sees {plural(count, 'CUDA GPU')} ({gpus}). "
            f"A saved cuda:N is the GPU's index in the process that saved it: "
            "CUDA_VISIBLE_DEVICES numbers the GPUs it shows from cuda:0, so the saving "
            f"process's {device} need not be any GPU here{gpu.renumbered(f)}",
            f"ckptool fix {name} --map {device}=cuda:0" if ":" in device
            else f"ckptool fix {name} --to cuda:0",
            f"torch.load(path, map_location={{{device!r}: 'cuda:0'}})" if ":" in device
            else "torch.load(path, map_location='cuda:0')")]
    why = {"cuda": "torch there cannot use CUDA (a CPU-only build of torch, no GPU or driver, "
                   "or CUDA_VISIBLE_DEVICES showing none)",
           "mps": "mps is Apple's GPU, which torch has only on macOS"}.get(
        backend, f"torch there has no {backend} device")
    shown = gpu.renumbered(f) if backend == "cuda" else ""
    return [Finding(p.DEVICE, ERROR, f"{saved}; {why}{shown}",
                    f"ckptool fix {name} --to cpu", "torch.load(path, map_location='cpu')")]


def _keys(f: Facts, name: str, device_count: int | None) -> list[Finding]:
    missing, unexpected = f.get("missing", []), f.get("unexpected", [])
    model = f.get("model_class", "the model")
    out = _wrapped(missing, unexpected, name)
    if out:
        return out
    rewrite, fits = prefix_fit(missing, unexpected)
    if fits:
        out.append(_prefix(rewrite.strip, rewrite.add, len(fits), len(unexpected), model, name))
        renamed = {rewrite.apply(k) for k in fits}
        missing = [k for k in missing if k not in renamed]
        unexpected = [k for k in unexpected if k not in fits]
    if missing:
        out.append(Finding(
            "missing-keys", ERROR,
            f"{plural(len(missing), 'key')} that {model} expects "
            f"{'is' if len(missing) == 1 else 'are'} not in the checkpoint: "
            f"{some_keys(missing)}{why_missing(missing)}",
            None, "model.load_state_dict(sd, strict=False)  # leaves them as initialised",
            tuple(missing)))
    if unexpected:
        out.append(Finding(
            "unexpected-keys", ERROR,
            f"{plural(len(unexpected), 'key')} in the checkpoint "
            f"{'is' if len(unexpected) == 1 else 'are'} not in {model}: {some_keys(unexpected)}",
            None, "model.load_state_dict(sd, strict=False)  # ignores them",
            tuple(unexpected)))
    return out + _shapes(f.get("mismatched", []))


def prefix_fit(missing: list[str], unexpected: list[str]) -> tuple[Rewrite, list[str]]:
    """The prefix rewrite that turns unexpected keys into missing ones, and
    the unexpected keys it turns into keys the model has (none: no rewrite)."""
    report = reconcile(dict.fromkeys(unexpected), dict.fromkeys(missing))
    rewrite, matched = report.rewrite, set(report.matched)
    if rewrite.empty or not matched:
        return rewrite, []
    # BatchNorm fills in a num_batches_tracked that a state dict without
    # version metadata lacks, so torch does not call it missing
    layers = {k.rpartition(".")[0] for k in matched}
    return rewrite, [k for k in unexpected if rewrite.apply(k) in matched or (
        rewrite.apply(k).endswith(".num_batches_tracked")
        and rewrite.apply(k).rpartition(".")[0] in layers)]


def _prefix(strip: str, add: str, matched: int, of: int, model: str, name: str) -> Finding:
    if strip:
        cause = (f"the checkpoint's keys have {strip!r} in front ({describe_wrapper(strip)}), "
                 f"which {model}'s keys lack")
        if add:
            cause += f", and {model} expects {add!r} in front instead"
    else:
        cause = (f"{model} expects its keys with {add!r} in front ({describe_wrapper(add)}), "
                 "which the checkpoint's keys lack (the model was wrapped before loading)")
    change = " and ".join([*([f"without {strip!r}"] if strip else []),
                           *([f"with {add!r}"] if add else [])])
    found = (f"the {plural(of, 'unexpected key')}" if matched == of
             else f"{matched} of the {plural(of, 'unexpected key')}")
    found += f" {'is' if matched == 1 else 'are'} what {model} expects"
    key = f"k.removeprefix({strip!r})" if strip else "k"
    attribute = _WRAPPED.get(model.rsplit(".", 1)[-1])
    snippet = (f"model.{attribute}.load_state_dict(sd)  # the wrapped model takes them as saved"
               if not strip and attribute and add == attribute + "." else
               f"model.load_state_dict({{{f'{add!r} + ' if add else ''}{key}: v "
               "for k, v in sd.items()})")
    flags = command_flags(FixOptions(strip_prefixes=(strip,) if strip else (),
                                     add_prefix=add or None))
    return Finding("key-prefix", ERROR, f"{cause}: {change}, {found}",
                   f"ckptool fix {name} {' '.join(flags)}", snippet)


def _wrapped(missing: list[str], unexpected: list[str], name: str) -> list[Finding]:
    """The whole training checkpoint given to load_state_dict: its top-level
    entries (epoch, optimizer, state_dict) are the unexpected keys."""
    entries = [n for n in PREFERRED_NAMES if n in unexpected]
    if not (missing and entries) or any("." in k for k in unexpected):
        return []
    return [Finding(
        "wrapped-state-dict", ERROR,
        f"the dict given to load_state_dict is a whole checkpoint ({some_keys(unexpected)}), "
        f"not a state dict: the weights are its {entries[0]!r} entry",
        f"ckptool fix {name} --extract",
        f"model.load_state_dict(torch.load(path)[{entries[0]!r}])")]


def _shapes(mismatched: list[Facts]) -> list[Finding]:
    if not mismatched:
        return []
    pairs = [(m["key"], tuple(m["checkpoint"]), tuple(m["model"])) for m in mismatched]
    hints = explain_shapes(pairs, {}, {})
    shown = "; ".join(f"{k}: checkpoint {list(a)} vs model {list(b)}" for k, a, b in pairs[:3])
    more = f" (and {len(pairs) - 3} more)" if len(pairs) > 3 else ""
    keys = [k for k, _, _ in pairs]
    return [Finding(
        "shape-mismatch", ERROR,
        f"{plural(len(pairs), 'key')} differ{'s' if len(pairs) == 1 else ''} in shape: "
        f"{shown}{more}" + "".join(f"; {explain_hint(h, len(hints) == 1)}".replace(" the file ",
                                                                          " the checkpoint ")
                                   for h in hints[:2])
        + ": build the model as the checkpoint's was built (with --checkpoint and --model, "
        "explain names the constructor argument), or leave those keys out to train them anew",
        None, f"model.load_state_dict({{k: v for k, v in sd.items() if k not in {tuple(keys)!r}}}, "
              "strict=False)", tuple(keys))]


def _weights(f: Facts, name: str, device_count: int | None) -> list[Finding]:
    if f.get("torchscript"):
        return [Finding(
            "torchscript", ERROR,
            "the file is a TorchScript archive (torch.jit.save), which torch.load refuses "
            "with weights_only=True and load_state_dict cannot take",
            f"ckptool convert {name} weights.pth",
            "torch.jit.load(path, map_location='cpu').state_dict()")]
    names = f.get("globals", [])
    verdicts = {g: _verdict(g, g in f.get("blocked", [])) for g in names}
    unsafe = [g for g, v in verdicts.items() if v.category == policy.UNSAFE]
    out = []
    extract = f"ckptool fix {name} --extract"
    if unsafe:
        out.append(Finding(
            "unsafe-globals", ERROR,
            f"the file names {', '.join(unsafe)}, which can run code "
            f"({'; '.join(verdicts[g].reason for g in unsafe)}): weights_only=True refused it. "
            "Never load this file with weights_only=False unless you wrote it; "
            f"`ckptool inspect {name}` shows what it would run, and `ckptool fix --extract` "
            "keeps the weights alone when they are clean", extract))
    refused = [g for g in names if g not in unsafe]
    if refused or not names:
        data = all(verdicts[g].category == policy.DATA for g in refused)
        labelled = ", ".join(f"{g} ({_LABELS[verdicts[g].category]})" for g in refused)
        what = (f"refused {labelled}, which the file names" if refused
                else "refused a global the file names")
        out.append(Finding(
            "weights-only", ERROR,
            "torch.load with weights_only=True (the default since torch 2.6) rebuilds only "
            f"tensors and plain containers, and {what}. `ckptool inspect {name}` shows every "
            "global in the file and whether it is safe. Ways out: `ckptool fix --extract` "
            "writes the weights alone, which plain torch.load takes; ckptool.load(path) loads "
            "the whole file without running anything from it; "
            "torch.serialization.add_safe_globals([...]) admits classes you trust",
            extract,
            f"torch.serialization.add_safe_globals([{', '.join(refused)}])  # only for classes "
            "you trust" if refused and data else
            "ckptool.load(path)  # the whole file, nothing from it run"))
    return out


def _verdict(dotted: str, blocked: bool) -> policy.Verdict:
    module, _, attribute = dotted.rpartition(".")
    if blocked:
        return policy.Verdict(policy.UNSAFE, f"member of {module}, which torch blocks")
    return policy.classify(module or "builtins", attribute)


_EXPLAIN: dict[str, Callable[[Facts, str, int | None], list[Finding]]] = {
    p.DEVICE: _device, p.KEYS: _keys, p.WEIGHTS: _weights, p.INVALID_ID: gpu.invalid_id,
    p.PRIMARY: gpu.primary, p.MISMATCH: gpu.mismatch, p.OOM: gpu.oom,
}
