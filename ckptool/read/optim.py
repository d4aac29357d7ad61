"""``torch.optim`` state dicts, recognised wherever they sit, so that one
parameter's moments are never taken for a model's weights.

``optimizer.state_dict()`` is ``{"state": {0: {"step": t, "exp_avg": t,
"exp_avg_sq": t}, 1: ...}, "param_groups": [{"lr": ..., "params": [0, 1]}]}``.
transformers' Trainer saves one as ``optimizer.pt``, accelerate as
``optimizer.bin``; Lightning keeps a list of them under ``optimizer_states``;
training scripts put one beside the model (``{"model": ..., "optimizer":
...}``). Each per-parameter entry is a dict of tensors, which is what a
state dict looks like: ``find`` names them so that the reader ranks them
out, and ``describe`` says what the optimizer holds.

Pure: it looks at the inert object tree only, a few levels down
(``holder`` then says which of a checkpoint's tensors are under them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptool.keys import join_key, key_of

if TYPE_CHECKING:
    from ckptool.model import Checkpoint, TensorInfo

MAX_DEPTH = 3  # {"optimizer_states": [{"state": ...}]} is two levels down
MAX_VISITED = 10_000  # containers looked into: a file of a million dicts costs no more


@dataclass(frozen=True)
class OptimizerState:
    """One ``torch.optim`` state dict in a checkpoint."""

    path: str  # its key ("" when it is the whole file)
    parameters: int  # parameters with state
    param_groups: int
    state_names: tuple[str, ...]  # per-parameter names: exp_avg, exp_avg_sq, step...
    kind: str | None  # "Adam/AdamW", "SGD with momentum"... as the names suggest
    # saved flat (flatten_optimizer_state_dict): hyperparameters per parameter,
    # param_groups then counts the parameters that have them
    flat: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerState:
        """The state ``as_dict`` made (``Checkpoint.metadata["optimizer_states"]``)."""
        return cls(data["path"], data["parameters"], data["param_groups"],
                   tuple(data["state_names"]), data["kind"], bool(data.get("flat")))

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "parameters": self.parameters,
                "param_groups": self.param_groups, "state_names": list(self.state_names),
                "kind": self.kind, "flat": self.flat}

    @property
    def state_path(self) -> str:
        """The key of its per-parameter ``state`` dict."""
        return join_key(self.path, "state")


def is_optimizer_state(obj: Any) -> bool:
    """``{"state": {...}, "param_groups": [{"params": [...]}, ...]}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("state"), dict):
        return False
    groups = obj.get("param_groups")
    return isinstance(groups, list) and bool(groups) and all(
        isinstance(g, dict) and "params" in g for g in groups)


def find(root: Any) -> list[OptimizerState]:
    """Every optimizer state dict within ``MAX_DEPTH`` levels of ``root``."""
    return [describe(path, obj) for path, obj in _containers(root) if is_optimizer_state(obj)]


def describe(path: str, state: dict[str, Any]) -> OptimizerState:
    per_param = state["state"]
    names: dict[str, None] = {}
    for entry in list(per_param.values())[:1000]:
        if isinstance(entry, dict):
            names.update(dict.fromkeys(k for k in entry if isinstance(k, str)))
    settings = {k for g in state["param_groups"][:100] for k in g if isinstance(k, str)}
    return OptimizerState(path, len(per_param), len(state["param_groups"]), tuple(names),
                          _kind(set(names), settings))


# torch.optim's per-parameter state names (torch 2.13; tests step each
# optimizer once): the names that only one optimizer keeps, checked first
KINDS: tuple[tuple[frozenset[str], str], ...] = tuple((frozenset(names), kind) for names, kind in (
    (("old_dirs", "old_stps", "func_evals"), "LBFGS"),
    (("exp_avg", "exp_avg_sq", "mu_product"), "NAdam"),
    (("exp_avg", "exp_inf"), "Adamax"),
    (("square_avg", "acc_delta"), "Adadelta"),
    (("square_avg",), "RMSprop"),  # with momentum_buffer, grad_avg (momentum, centered)
    (("sum",), "Adagrad"),
    (("eta", "mu", "ax"), "ASGD"),
    (("prev", "step_size"), "Rprop"),
    (("row_var", "col_var"), "Adafactor"),
    (("variance",), "Adafactor"),  # of a 1-d parameter
))


def _kind(names: AbstractSet[str], settings: AbstractSet[str] = frozenset()) -> str | None:
    """The optimizer a state's per-parameter ``names`` (and its param
    groups' ``settings``, where known) say it is: torch.optim's, by the
    names each keeps. Adam's and AdamW's states are alike (torch >= 2.8 keeps
    ``decoupled_weight_decay`` in both); RAdam's groups have no ``amsgrad``,
    SparseAdam's no ``weight_decay``; Muon keeps SGD's ``momentum_buffer``
    (its groups: ``ns_coefficients``); SGD without momentum keeps nothing."""
    for needed, kind in KINDS:
        if needed <= names:
            return kind
    if {"exp_avg", "exp_avg_sq"} <= names:
        if "amsgrad" not in settings and "decoupled_weight_decay" in settings:
            return "RAdam"
        if settings and "weight_decay" not in settings and "betas" in settings:
            return "SparseAdam"
        return "Adam/AdamW"
    if "momentum_buffer" in names:
        return "Muon" if "ns_coefficients" in settings else "SGD with momentum"
    if not names and "dampening" in settings:
        return "SGD"
    return None


def _containers(root: Any) -> Iterator[tuple[str, Any]]:
    """(key, container) breadth first, ``MAX_DEPTH`` levels down at most."""
    level: list[tuple[str, Any]] = [("", root)]
    visited = 0
    for _ in range(MAX_DEPTH + 1):
        below: list[tuple[str, Any]] = []
        for path, obj in level:
            visited += 1
            if visited > MAX_VISITED:
                return
            yield path, obj
            if isinstance(obj, dict) and not is_optimizer_state(obj):
                below += [(join_key(path, k), v) for k, v in obj.items()
                          if isinstance(k, str) and isinstance(v, (dict, list, tuple))]
            elif isinstance(obj, (list, tuple)):
                below += [(join_key(path, str(i)), v) for i, v in enumerate(obj)
                          if isinstance(v, (dict, list, tuple))]
        level = below


def find_flat(paths: Iterable[tuple[str | int, ...]]) -> list[OptimizerState]:
    """The optimizer state dicts of a checkpoint saved flat, from each name's
    path in the nested dict it was saved from (DCP's planner paths:
    ``("optim", "state", "fc.weight", "exp_avg")``), within ``MAX_DEPTH``
    levels as ``find`` finds them in a tree: a ``state`` of per-parameter
    dicts beside ``param_groups`` that list ``params``. The tree is never
    built: a path is only looked at, whatever it claims."""
    paths = list(paths)
    groups: dict[tuple[str | int, ...], set[int]] = {}
    params: dict[tuple[str | int, ...], set[str | int]] = {}
    names: dict[tuple[str | int, ...], dict[str, None]] = {}
    settings: dict[tuple[str | int, ...], set[str]] = {}
    for path in paths:
        for depth in range(min(MAX_DEPTH + 1, len(path) - 2)):
            step, head, below, name = path[depth], path[:depth], path[depth + 1], path[depth + 2]
            if step == "param_groups" and len(path) == depth + 3 and \
                    isinstance(below, int) and isinstance(name, str):
                settings.setdefault(head, set()).add(name)
                if name == "params":
                    groups.setdefault(head, set()).add(below)
            elif step == "state":
                params.setdefault(head, set()).add(below)
                if isinstance(name, str):
                    names.setdefault(head, {})[name] = None
    found = sorted((h for h in params if h in groups), key=len)
    # as ``find``: nothing inside an optimizer's state is another one
    found = [h for h in found if not any(h[:len(o)] == o for o in found if len(o) < len(h))]
    return [OptimizerState(key_of([str(step) for step in head]), len(params[head]),
                           len(groups[head]), tuple(names.get(head, ())),
                           _kind(set(names.get(head, ())), settings.get(head, set())))
            for head in found] + _find_flattened(paths, found)


def _find_flattened(paths: Iterable[tuple[str | int, ...]],
                    nested: list[tuple[str | int, ...]]) -> list[OptimizerState]:
    """Optimizer states saved flat (``StateDictOptions(flatten_optimizer_state_dict
    =True)``, torchtitan's default): one key per value under the entry,
    ``state.fc.weight.exp_avg`` beside ``param_groups.fc.weight.lr``."""
    state: dict[tuple[str | int, ...], set[str]] = {}
    groups: dict[tuple[str | int, ...], set[str]] = {}
    names: dict[tuple[str | int, ...], dict[str, None]] = {}
    settings: dict[tuple[str | int, ...], set[str]] = {}
    for path in paths:
        last = path[-1] if path else None
        if not isinstance(last, str) or len(path) > MAX_DEPTH + 1:
            continue
        kind, _, rest = last.partition(".")
        param, _, name = rest.rpartition(".")
        if not param or kind not in ("state", "param_groups"):
            continue
        head = path[:-1]
        if kind == "state":
            state.setdefault(head, set()).add(param)
            names.setdefault(head, {})[name] = None
        else:
            groups.setdefault(head, set()).add(param)
            settings.setdefault(head, set()).add(name)
    return [OptimizerState(key_of([str(step) for step in head]), len(state[head]),
                           len(groups[head]), tuple(names[head]),
                           _kind(set(names[head]), settings[head]),
                           flat=True)
            for head in sorted(state, key=len) if head in groups and head not in nested]


def holder(ckpt: Checkpoint) -> Callable[[TensorInfo], bool] | None:
    """Whether a tensor of ``ckpt`` is optimizer state: under the key of one
    of its ``metadata["optimizer_states"]`` (for DCP, by its planner path:
    ``optim.state.fc.weight.exp_avg`` is under ``optim``). None when the
    checkpoint holds no optimizer state."""
    paths = [s["path"] for s in ckpt.metadata.get("optimizer_states") or ()]
    if not paths:
        return None
    if "" in paths:  # the whole file is one
        return lambda t: True
    exact, heads = set(paths), tuple(f"{p}/" for p in paths)
    tree = ckpt.tree_paths

    def holds(t: TensorInfo) -> bool:
        key = t.key
        steps = tree.get(key) if tree else None
        if steps is not None:
            key = key_of([str(step) for step in steps])
        return key in exact or key.startswith(heads)

    return holds


def summary(s: OptimizerState) -> str:
    """``Adam/AdamW: exp_avg, exp_avg_sq, step for 9 parameters, 1 param group``."""
    what = f"{s.kind}: " if s.kind else ""
    names = ", ".join(s.state_names) or "no per-parameter state"
    groups = ("saved flat (hyperparameters per parameter)" if s.flat else
              f"{s.param_groups} param group{'s' if s.param_groups != 1 else ''}")
    return (f"{what}{names} for {s.parameters} parameter{'s' if s.parameters != 1 else ''}, "
            f"{groups}")


def wording(states: list[OptimizerState]) -> str:
    """``a torch.optim optimizer state (Adam/AdamW: ...)``, for errors."""
    s = states[0]
    where = f" under '{s.path}'" if s.path else ""
    more = f" (and {len(states) - 1} more)" if len(states) > 1 else ""
    return f"a torch.optim optimizer state{where} ({summary(s)}){more}"
