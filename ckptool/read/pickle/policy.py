"""The verdict on each global a pickle names, from what loading does with it.

``names.classify`` puts each global in a category by its name; ``judge``
decides once the read has recorded its uses (``seen.use``, from
``reach`` and ``lookups``). The categories:

- ``torch``, ``data``: tensor reconstruction and known, inert data, and any
  global that loading only stores as a value;
- ``unsafe``: a call that can run code, touch files, processes or the
  network; or one ckptool does not model (its reason starts ``unknown:``),
  which fails closed;
- ``custom``: classes from outside the known worlds (the standard library,
  torch, numpy): loading imports their module and runs their code; ckptool
  only shows their state. A function is judged by its use wherever it lives.

The uses: ``CALLED`` by REDUCE, INST, OBJ or a modelled callee with known
arguments (not recorded for modelled callees, which are judged by what
they do with their arguments); ``REACHED``, called by the real code with
arguments ckptool cannot know; ``CALLED_INSTANCE``, an object made from it
called; ``CREATED`` by ``cls.__new__``; ``BUILT``, its state set;
``MISUSED``, used in a way its model does not cover; ``FLAGGED``, a part
ckptool cannot read, named as a global. ``judge``:

- only referenced, never called: data, whatever its name (``math.sqrt``,
  ``torch.nn.init.xavier_uniform_`` in hyper-parameters), but for modules
  whose import runs something (``antigravity``, any ``__main__``);
- called: a modelled callable is judged by its model; a function it does
  not model is ``unsafe``; a known world's class the name tables do not
  list as data is ``unsafe`` (unknown); a custom class is ``custom``;
- reached with unknown arguments: ``unsafe`` unless a plain data
  constructor (``calls.Model.any_args``);
- made or given state: a known data class, ``custom``, or ``unsafe``
  (unknown) for a known world's class the tables do not list.

Nothing here imports or calls anything the file names: it is a table
lookup on names and uses.
"""

from __future__ import annotations

from ckptool import dtypes
from ckptool.read.pickle import calls
from ckptool.read.pickle.names import (
    CUSTOM,
    DATA,
    PANDAS_REASON,
    TORCH,
    TORCH_VALUES,
    UNSAFE,
    Verdict,
    classify,
    is_class_name,
    numpy_data,
    under,
)

__all__ = ["CUSTOM", "DATA", "TORCH", "UNSAFE", "Verdict", "classify", "judge"]

# what loading does with a global (recorded by ckptool.read.pickle)
CALLED = "called"  # REDUCE, INST, OBJ, or a modelled callee, with known arguments
REACHED = "reached"  # called by the real code with arguments ckptool cannot know
CALLED_INSTANCE = "called-instance"  # an object made from it is called
CREATED = "created"  # NEWOBJ, copyreg reconstruction: cls.__new__(cls)
BUILT = "built"  # BUILD on an object made from it: its __setstate__
MISUSED = "misused"  # called in a way ckptool's model of it does not cover
FLAGGED = "unread"  # a part ckptool cannot read: unsafe whatever else (fail closed)
USES = (CALLED, REACHED, CALLED_INSTANCE, CREATED, BUILT, MISUSED, FLAGGED)
GETATTR = "builtins.getattr"

# modules whose import runs something (a browser, a program's main)
_IMPORT_RUNS = ("antigravity", "this", "__hello__", "__phello__", "idlelib", "turtledemo",
                "test")


def function_like(name: str) -> bool:
    """Whether a global's name reads as a function's (``run``, ``_helper``),
    not a class's (``Namespace``, ``_Private``)."""
    return not is_class_name(name.rsplit(".", 1)[-1])


def import_runs_code(dotted: str) -> bool:
    """Whether importing the module that holds ``dotted`` runs something."""
    parts = dotted.split(".")
    return "__main__" in parts[:-1] or parts[0] in _IMPORT_RUNS


def known_callable(dotted: str) -> bool:
    """A lowercase global whose call ckptool models (``calls.MODELS``), or a
    torch value (a dtype, a layout)."""
    if calls.model_of(dotted) is not None:
        return True
    module, _, name = dotted.rpartition(".")
    if under(module, "numpy"):
        return numpy_data(module, name)  # array, dtype and scalar constructors
    return module == "torch" and (name in TORCH_VALUES or name in dtypes.ITEMSIZE)


def judge(dotted: str, verdict: Verdict, uses: frozenset[str] | set[str],
          why: dict[str, str] | None = None) -> Verdict:
    """The verdict on a global once the pickle has been read: its name's
    (``classify``), decided by what loading does with it."""
    why = why or {}
    if FLAGGED in uses:
        return verdict
    if MISUSED in uses:
        how = why.get(MISUSED, "called in a way ckptool does not model")
        return Verdict(UNSAFE, f"unknown: {how}")
    if CALLED_INSTANCE in uses:
        return Verdict(UNSAFE, f"calls an object made from {dotted} at load time; "
                       f"ckptool cannot tell what that does ({why.get(CALLED_INSTANCE, '')})")
    if dotted == GETATTR and uses <= {CALLED}:
        return Verdict(DATA, "looks up an attribute of a global the file names (getattr(G, "
                       "'name')), judged as the global G.name")
    model = calls.model_of(dotted)
    if model is not None and uses:  # called, made or built as its model says
        if REACHED in uses and not model.any_args:
            return Verdict(UNSAFE, f"unknown: {why.get(REACHED)}; ckptool cannot tell what "
                           f"{dotted} does with arguments it does not know")
        return Verdict(verdict.category if verdict.category in (TORCH, DATA) else DATA,
                       f"{model.what} (modelled)")
    if CALLED in uses or REACHED in uses:
        how = why.get(CALLED) or why.get(REACHED) or "called at load time"
        if calls.pure(dotted):
            return Verdict(TORCH if dotted.startswith("torch") else DATA, "a pure function: "
                           f"called ({how}), it computes on its arguments and touches nothing "
                           "else")
        if verdict.category == UNSAFE:
            return Verdict(UNSAFE, f"{verdict.reason}; {how}")
        if verdict.reason == PANDAS_REASON:
            return verdict
        if function_like(dotted) and not known_callable(dotted):
            return Verdict(UNSAFE, f"calls {dotted} at load time ({how}); ckptool cannot "
                           "tell what it does")
        if verdict.category == CUSTOM:
            return Verdict(CUSTOM, "a class torch imports and calls at load time: its "
                           "constructor runs with the file's arguments")
        return verdict
    if uses & {CREATED, BUILT}:
        if verdict.category == UNSAFE:
            return Verdict(UNSAFE, f"unknown: {verdict.reason}; an object of it is made at load "
                           f"time ({why.get(CREATED) or why.get(BUILT) or 'made'})")
        if verdict.category == CUSTOM:
            return Verdict(CUSTOM, "a class torch imports at load time: its code runs "
                           "(__new__, __setstate__)")
        return verdict
    if import_runs_code(dotted):
        return Verdict(UNSAFE, "importing its module runs code")
    if verdict.category == CUSTOM:
        return Verdict(CUSTOM, "referenced only: torch imports its module to load the file")
    if verdict.category == UNSAFE:
        return Verdict(DATA, "referenced only: stored as a value; loading never calls it")
    return verdict
