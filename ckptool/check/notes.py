"""What ``diagnose`` says about names that the model or the framework makes
itself, where that is no problem (an ``INFO`` finding) or where it still is.

- ``tied``: names the model ties to another, not stored. A transformers
  model ties them again as it loads (``from_pretrained`` calls its
  ``tie_weights()``): a T5, BART, Whisper, OPT, Gemma, RoBERTa or tied Qwen2
  folder stores the tensor once, and nothing is missing. A model whose
  constructor alone ties them (``self.head.weight = self.embed.weight``)
  loads the file with ``strict=False`` only: a warning.
- ``saved_wrapper``: a wrapper's prefix that the framework which wrote the
  folder loads back as it is. accelerate's ``save_state`` of a
  ``torch.compile``'d model keeps ``_orig_mod.`` (accelerate 1.16), and
  ``Accelerator.load_state`` loads the file into the model compiled as when
  it was saved; stripped, ``load_state`` fails (``Missing key(s) ...
  _orig_mod.``). No fix is offered for the folder: a bare model takes the
  weights through ``ckptool.load_state_dict(path, model=model)``; ``explain``
  of an error loading it says the same (``loaded_back``).
"""

from __future__ import annotations

from ckptool.check.finding import INFO, WARNING, Finding
from ckptool.check.modelspec import ModelKeys
from ckptool.describe import plural
from ckptool.model import Framework

# (framework kind, wrapper) -> who saves the names so, and what loads them back
SAVED_WRAPPERS = {
    ("accelerate", "_orig_mod."): (
        "accelerate's save_state of a torch.compile'd model names them so, and "
        "Accelerator.load_state loads them as they are into the model compiled (before "
        "prepare) as when it was saved; stripped, load_state fails"),
}
# a bare model takes the weights renamed to fit it (ckptool.load_state_dict)
FITTED = "model.load_state_dict(ckptool.load_state_dict(path, model=model))"


def tied(where: str, missing: dict[str, str], model: ModelKeys) -> Finding:
    """The finding for ``missing`` names (name -> the twin ``where`` has)
    that ``model`` ties: said, or a warning where only its constructor ties."""
    pairs = ", ".join(f"{k} (tied to {v})" for k, v in list(missing.items())[:3])
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    if model.ties_on_load is not None:
        return Finding(
            "tied-keys", INFO,
            f"{plural(len(missing), 'name')} that {model.ties_on_load} ties to another "
            f"{'is' if len(missing) == 1 else 'are'} not stored, as its save_pretrained "
            f"writes them: {pairs}{more}; the model ties them again as it loads "
            "(from_pretrained calls tie_weights()): nothing is missing",
            None, f"{FITTED}  # a strict load_state_dict wants every tied name: this gives "
            "them", tuple(missing))
    return Finding(
        "tied-keys", WARNING,
        f"{plural(len(missing), 'missing key')} "
        f"{'is a tied weight' if len(missing) == 1 else 'are tied weights'} whose twin "
        f"{where} has: {pairs}{more}; strict loading still wants them",
        None, "model.load_state_dict(sd, strict=False)  # the tie fills them", tuple(missing))


def saved_wrapper(fw: Framework | None, wrapper: str) -> Finding | None:
    """The note for a ``wrapper`` prefix that ``fw``'s framework saved and
    loads back as it is; None where it is a wrapper to strip."""
    said = SAVED_WRAPPERS.get((fw.kind, wrapper)) if fw is not None else None
    if said is None:
        return None
    return Finding(
        "framework-prefix", INFO,
        f"every key starts with {wrapper!r} (torch.compile): {said}. Nothing to fix in the "
        "folder; a bare (not compiled) model takes the weights renamed to fit it",
        None, f"{FITTED}  # a bare model: the names fitted to it")


def loaded_back(fw: Framework | None, strip: str, add: str) -> str | None:
    """What ``explain`` says where its fix strips (``strip``) or adds
    (``add``) a wrapper that ``fw``'s framework saves and loads back."""
    if fw is None:
        return None
    if (fw.kind, strip) in SAVED_WRAPPERS:
        return (f"{fw.directory} is accelerate's save_state of a torch.compile'd model: "
                "Accelerator.load_state loads it as it is into the model compiled as when it "
                "was saved (torch.compile before accelerator.prepare); the command below "
                f"writes a copy without {strip!r} for a bare model, which load_state does not "
                "read")
    if (fw.kind, add) in SAVED_WRAPPERS:
        return (f"Accelerator.load_state of a torch.compile'd model wants the keys with {add!r}, "
                f"and reads the model from {fw.directory} by its name (model.safetensors): "
                "the command below writes a copy beside it; put the copy in its place")
    return None
