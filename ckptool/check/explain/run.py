"""``ckptool explain``: an error message from a log, what it means, what to
do, and with the checkpoint at hand, the one command that fixes it.

``explain(text)`` finds the errors the text states (``explain_scan``),
keeps the last one (a log ends with the error that stopped the run) and
says what it means (``explain_findings``), from the text alone.
``with_checkpoint`` then runs ``diagnose`` on the checkpoint for the
machine the error implies (``device_count() is 2``: two GPUs; ``is_available()
is False``: none; an out-of-memory GPU with its free memory), against the
model the error describes where no ``--model`` is given (the checkpoint's
keys, less the unexpected ones, plus the missing ones, in the model's
shapes), and takes its checked fix command. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ckptool.check import notes
from ckptool.check.diagnosis import Diagnosis, diagnose
from ckptool.check.explain import patterns as p
from ckptool.check.explain.findings import (
    PLACEHOLDER,
    findings_for,
    key_prefix,
    prefix_fit,
    saved_where,
)
from ckptool.check.explain.patterns import Error
from ckptool.check.explain.scan import find_errors
from ckptool.check.findings import Finding
from ckptool.check.gpus import machine as gpus
from ckptool.check.gpus.machine import Machine
from ckptool.check.modelspec import ModelKeys
from ckptool.describe import shell_word
from ckptool.errors import EXIT_FINDINGS, EXIT_OK
from ckptool.model import Checkpoint

# codes of problems in the file itself, and the diagnose codes that find each
FILE_CODES = {"device-unavailable": ("device-unavailable",), "key-prefix": ("key-prefix",),
              "wrapped-state-dict": ("wrapped-state-dict",),
              "weights-only": ("weights-only", "pickled-module"),
              "unsafe-globals": ("unsafe-globals",), "torchscript": ("torchscript",)}


@dataclass
class Explanation:
    errors: list[Error]  # every error found in the text, in order; the last is explained
    findings: list[Finding]  # what the last one means
    device_count: int | None = None  # the GPUs the user says there are (--device-count)
    diagnosis: Diagnosis | None = None  # of the checkpoint, where one was given
    also: list[Finding] = field(default_factory=list)  # what diagnose found besides
    notes: list[str] = field(default_factory=list)  # where the checkpoint and error disagree
    against: str | None = None  # what diagnose compared the keys with

    @property
    def error(self) -> Error | None:
        return self.errors[-1] if self.errors else None

    @property
    def input(self) -> dict[str, Any]:
        """What the text gave: the error's kind and line, its facts, and for
        a load_state_dict error the key prefix its unexpected keys share."""
        if self.error is None:
            return {"errors_found": 0}
        facts = dict(self.error.facts)
        if self.error.kind == p.KEYS:
            prefix = key_prefix(facts)
            if prefix is not None:
                facts["prefix"] = prefix
        return {"kind": self.error.kind, "error": self.error.line, **facts,
                "errors_found": len(self.errors)}

    @property
    def fix_command(self) -> str | None:
        return self.diagnosis.fix_command if self.diagnosis else None

    @property
    def remaining(self) -> list[str]:
        """Codes of the findings that ``fix_command`` does not repair."""
        codes = [f.code for f in self.findings + self.also]
        if self.diagnosis is None or self.fix_command is None:
            return codes
        fixed = {f.code for f in self.diagnosis.findings} - set(self.diagnosis.remaining)
        return [c for c in codes if c not in fixed]

    @property
    def exit_code(self) -> int:
        """1 when an error was recognised (explained or not), 0 when none was."""
        return EXIT_FINDINGS if self.error is not None else EXIT_OK


def explain(text: str, device_count: int | None = None) -> Explanation:
    """The last error in ``text``, explained from the text alone."""
    errors = find_errors(text)
    if not errors:
        return Explanation([], [], device_count)
    return Explanation(errors, findings_for(errors[-1], PLACEHOLDER, device_count),
                       device_count)


def with_checkpoint(exp: Explanation, ckpt: Checkpoint, model: ModelKeys | None = None,
                    machine: Machine | None = None) -> Explanation:
    """``exp`` with ``ckpt`` diagnosed for the machine the error implies
    (``machine`` overrides it) and against ``model``, or the model the error
    describes; fixes name the file and come from the diagnosis."""
    error = exp.error
    if error is None:
        return exp
    if model is None:
        model = model_from_error(error, ckpt)
    d = diagnose(ckpt, machine or target(exp), model)
    exp.diagnosis, exp.against = d, model.source if model else None
    if d.keys is not None:  # a wrapper the folder's framework saves (and loads back)
        said = notes.loaded_back(ckpt.framework, d.keys.rewrite.strip, d.keys.rewrite.add)
        exp.notes += [said] if said is not None else []
    found = {f.code: f for f in d.findings}
    own, used = [], set()
    saved = None
    if error.kind == p.DEVICE:  # what the file saved, not what the error guesses it did
        saved = saved_where(d.tags, error.facts["device"],
                            "the checkpoint" if ckpt.is_multifile else "the file")
        if not saved.recorded:
            exp.notes.append(f"the error names {error.facts['device']}, and {ckpt.path} "
                             "records no device (its tensors load where they are asked): "
                             "the error came from another file")
        elif not saved.names_it and p.DEVICE in found:
            exp.notes.append(f"the error names {error.facts['device']}, and {ckpt.path} "
                             f"saved nothing there ({saved.said}): the error probably came "
                             "from another file")
    for f in findings_for(error, shell_word(ckpt.path), exp.device_count, saved):
        theirs = next((found[c] for c in FILE_CODES.get(f.code, (f.code,)) if c in found), None)
        if theirs is not None:
            used.add(theirs.code)
            # diagnose knows the file: its command, or none where it has none
            ours = None if (f.fix or "").startswith("ckptool ") else f.fix
            f = replace(f, fix=theirs.fix or ours, snippet=theirs.snippet or f.snippet)
        elif f.code in FILE_CODES:  # not this file's problem: no command for it
            if saved is None or saved.recorded:  # (else said above, more precisely)
                exp.notes.append(f"the error says {f.code}, which {ckpt.path} does not show: the "
                                 "error may come from another file or another machine")
            f = replace(f, fix=None if (f.fix or "").startswith("ckptool ") else f.fix)
        if d.fix_refused and (f.fix or "").startswith("ckptool fix"):
            f = replace(f, fix=None)  # never a command that fix would refuse
        own.append(f)
    exp.findings = own
    exp.also = [f for f in d.findings if f.code not in used | {o.code for o in own}]
    return exp


def target(exp: Explanation) -> Machine:
    """The machine the error happened on, as far as the text and the user say."""
    error = exp.error
    facts = error.facts if error else {}
    kind = error.kind if error else None
    if exp.device_count is not None:
        machine = gpus.assumed(exp.device_count)
    elif kind == p.DEVICE and facts["backend"] == "cuda" and "device_count" in facts:
        machine = gpus.assumed(facts["device_count"])
    elif kind == p.OOM and "gpu" in facts:
        machine = gpus.assumed(facts["gpu"] + 1)
    else:
        machine = gpus.probe()
    if kind == p.OOM and facts.get("gpu", len(machine.gpus)) < len(machine.gpus):
        gpu = machine.gpus[facts["gpu"]]
        known = replace(gpu, total_bytes=facts.get("total_bytes", gpu.total_bytes),
                        free_bytes=facts.get("free_bytes", gpu.free_bytes))
        machine = replace(machine, gpus=tuple(known if g is gpu else g for g in machine.gpus))
    if kind == p.DEVICE and facts["backend"] == "mps" and machine.platform == "darwin":
        machine = replace(machine, platform="linux")  # where mps is missing: not a Mac's torch
    return machine


def model_from_error(error: Error, ckpt: Checkpoint) -> ModelKeys | None:
    """The keys of the model a load_state_dict error describes, where they
    fit this checkpoint: its keys but the unexpected ones, plus the missing
    ones, with the model's shapes for the mismatched ones."""
    sd = ckpt.main_state_dict
    facts = error.facts
    if error.kind != p.KEYS or sd is None or ckpt.is_multifile:
        return None
    unexpected, missing = set(facts.get("unexpected", [])), facts.get("missing", [])
    shapes = {m["key"]: tuple(m["model"]) for m in facts.get("mismatched", [])}
    names = set(sd.keys)
    if not (unexpected or missing or shapes) or not (unexpected | set(shapes)) <= names \
            or names & set(missing):
        return None
    tensors = ckpt.state_dict()

    def shape(name: str) -> tuple[int, ...] | None:
        return tensors[name].shape if name in tensors else None

    expected = {n: shapes.get(n, shape(n)) for n in sd.keys if n not in unexpected}
    expected.update(dict.fromkeys(missing))
    rewrite, fits = prefix_fit(missing, facts.get("unexpected", []))
    # what the model has but torch did not call missing (BatchNorm's counter)
    expected.update({rewrite.apply(k): shape(k) for k in fits if rewrite.apply(k) not in expected})
    model = facts.get("model_class", "its model")
    return ModelKeys(f"the model in the error ({model})", expected, name=model)
