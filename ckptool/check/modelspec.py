"""The keys a model expects: built from ``--model`` without allocating weights,
or read from a ``--reference`` checkpoint.

``--model package.module:Class`` or ``--model path/to/file.py:Class`` names
the user's own code (never anything from the checkpoint). It is constructed
on the ``meta`` device, so a 70B definition costs no memory, and its
``state_dict()`` gives exactly what ``load_state_dict(strict=True)`` wants:
parameters, persistent buffers (BatchNorm statistics, ``num_batches_tracked``)
and not the non-persistent ones. Tied parameters appear under every name
they are tied under; ``tied`` records which names share one tensor.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from ckptool.check.loadnames import LoadNames
from ckptool.check.loadnames.live import transformers_names
from ckptool.errors import CkptoolError, UsageError


@dataclass
class ModelKeys:
    """What a model (or a reference checkpoint) has under each state-dict key."""

    source: str  # "model mypkg.nets:ResNet" or "reference other.pth"
    shapes: dict[str, tuple[int, ...] | None]  # key -> shape (None: extra state), in order
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> keys sharing its tensor
    arguments: dict[str, Any] = field(default_factory=dict)  # constructor arguments as called
    name: str = ""  # the class (or factory) name
    given: dict[str, Any] = field(default_factory=dict)  # the arguments --model-arg gave
    # how the model's library renames a checkpoint's keys as it loads them
    # (transformers 5's conversion mapping); None: it loads them as named
    load_names: LoadNames | None = None
    # the class that ties its shared names again as it loads (transformers'
    # from_pretrained calls the model's tie_weights()); None: only its
    # constructor ties them, and a strict load_state_dict wants every name
    ties_on_load: str | None = None


class ModelError(CkptoolError):
    """``--model`` could not be imported, found or constructed."""

    exit_code = UsageError.exit_code


def parse_arguments(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``--model-arg name=value`` pairs: values are JSON where they parse, else strings."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--model-arg needs the form name=value, got {item!r}",
                             "for example --model-arg hidden=12 --model-arg act=relu")
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text
    return out


def find_class(spec: str) -> Any:
    """The callable named by ``module:Attr`` or ``path/file.py:Attr``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"--model needs the form module:Class or file.py:Class, got {spec!r}",
                         "for example --model mypkg.nets:ResNet or --model nets.py:ResNet")
    is_path = target.endswith(".py") or "/" in target or os.sep in target
    module = _import_file(target) if is_path else _import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_")
                            and inspect.isclass(getattr(module, n)))[:8]
            raise ModelError(f"{target} has no attribute {attr!r}",
                             f"classes defined there: {', '.join(public) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"{spec} is not a class or function", "name an nn.Module class")
    return obj


def _import_module(name: str) -> Any:
    # like `python -m`: the current directory is importable
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as exc:  # the user's module failed to import: say how
        raise ModelError(f"importing {name} failed: {type(exc).__name__}: {exc}",
                         "check the module path and that its dependencies are installed; "
                         "a file can be named as path/to/file.py:Class") from exc


def _import_file(path: str) -> Any:
    if os.path.isdir(path):
        raise ModelError(f"{path} is a directory", "give --model path/to/file.py:Class")
    if not os.path.isfile(path):
        raise ModelError(f"no such model file: {path}", "give --model path/to/file.py:Class")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:  # so the file can import its siblings
        sys.path.insert(0, folder)
    name = "ckptool_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"cannot import {path}", "name a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # the user's file failed to run: say how
        del sys.modules[name]
        raise ModelError(f"importing {path} failed: {type(exc).__name__}: {exc}",
                         "run the file with python to see the full error; code that parses "
                         "arguments or trains belongs under if __name__ == '__main__'") from exc
    return module


def build_model(spec: str, arguments: dict[str, Any],
                saved: dict[str, Any] | None = None) -> ModelKeys:
    """Construct ``spec(**arguments)`` on the meta device and list its keys.
    ``saved``: settings the checkpoint kept, offered in the hint on failure."""
    import torch

    factory = find_class(spec)
    called = _bound_arguments(factory, arguments)
    try:
        with torch.device("meta"):
            model = factory(**arguments)
    except (Exception, SystemExit) as exc:  # the user's constructor failed: no traceback
        raise ModelError(f"constructing {spec} failed: {type(exc).__name__}: {exc}",
                         _constructor_hint(factory, saved)) from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"{spec} returned a {type(model).__name__}, not an nn.Module",
                         "name an nn.Module class or a function that returns one")
    keys = module_keys(model, f"model {spec}")
    keys.arguments, keys.name = called, getattr(factory, "__name__", spec)
    keys.given = dict(arguments)
    return keys


def module_keys(model: Any, source: str | None = None) -> ModelKeys:
    """The keys of a constructed ``nn.Module``: shapes, ties, extra state."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"model is a {type(model).__name__}, not an nn.Module",
                         "pass the nn.Module whose load_state_dict will take the result")
    shapes: dict[str, tuple[int, ...] | None] = {}
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):  # get_extra_state(): strict loading wants it
            shapes[key] = None
            continue
        shapes[key] = tuple(value.shape)
        groups.setdefault(id(value), []).append(key)
    name = type(model).__name__
    return ModelKeys(source or f"model {name}", shapes, _ties(groups.values()), name=name,
                     load_names=transformers_names(model),
                     ties_on_load=name if callable(getattr(model, "tie_weights", None)) else None)


def _ties(groups: Any) -> dict[str, tuple[str, ...]]:
    """Each key of a group of names sharing one tensor, with the others."""
    return {k: tuple(o for o in group if o != k) for group in groups if len(group) > 1
            for k in group}


def _bound_arguments(factory: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """Every constructor argument as the call will see it, defaults included."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return dict(arguments)
    try:
        bound = signature.bind_partial(**arguments)
    except TypeError as exc:
        raise ModelError(f"--model-arg does not fit {factory.__name__}{signature}: {exc}",
                         _constructor_hint(factory)) from exc
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items()
            if signature.parameters[k].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                    inspect.Parameter.VAR_KEYWORD)}


def _constructor_hint(factory: Any, saved: dict[str, Any] | None = None) -> str:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return "pass constructor arguments with --model-arg name=value"
    required = [p.name for p in signature.parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    need = f"; it takes {', '.join(required)}" if required else ""
    known = {k.split(".")[-1]: v for k, v in (saved or {}).items()}
    found = [f"--model-arg {n}={json.dumps(known[n])}" for n in required if n in known]
    if found:
        need += f"; the checkpoint saved {' '.join(found)}"
    return f"pass constructor arguments with --model-arg name=value{need}"


def reference_keys(path: str) -> ModelKeys:
    """The main state dict of another checkpoint, as a model would expect it."""
    from ckptool.read.reader import open_checkpoint

    ref = open_checkpoint(path)
    if ref.main_state_dict is None:
        raise UsageError(f"{path}: no state dict found to compare against",
                         "give a checkpoint that holds a model's weights")
    # the names a model would expect: without the reference's own wrapper
    # prefix (module., _orig_mod., model.), as `ckptool diff` compares them
    prefix = ref.main_state_dict.prefix
    bare = (lambda name: name.removeprefix(prefix)) if prefix else (lambda name: name)
    stored = ref.state_dict()
    # names an HF index records as tied to a stored tensor are the model's too
    aliases = {a: k for a, k in ref.aliases.items()
               if k in stored and a not in stored and not ref.main_state_dict.path}
    tensors = {bare(name): t for name, t in stored.items()}
    tensors.update({bare(a): stored[k] for a, k in aliases.items()})
    shapes = {bare(name): tensors[bare(name)].shape if bare(name) in tensors else None
              for name in (*ref.main_state_dict.keys, *aliases)}
    groups: dict[tuple[str | None, int, tuple[int, ...]], list[str]] = {}
    for name, t in tensors.items():
        if t.storage is not None:
            groups.setdefault((t.storage, t.storage_offset, t.shape), []).append(name)
    label = f"reference {path}" + (f" (without its {prefix!r} prefix)" if prefix else "")
    return ModelKeys(label, shapes, _ties(groups.values()))


# entries where training scripts keep their settings: constructor values
SETTINGS = ("hyper_parameters", "hparams", "args", "config", "cfg", "opt", "params")


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
