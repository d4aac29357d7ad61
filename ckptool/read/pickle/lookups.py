"""Attributes CPython's unpickler looks up on the instance, as it looks them up.

BUILD calls ``getattr(inst, "__setstate__")``; APPEND and APPENDS on
anything but an exact list call ``getattr(obj, "extend")`` (else
``append``); ADDITEMS on anything but a set calls ``getattr(obj, "add")``.
An instance attribute shadows a method of its class, so a first BUILD
whose state puts a callable under one of those names in the instance's
``__dict__`` (a state dict, or the slot half of ``(dict, slots)``; every
class without its own ``__setstate__``, and ``nn.Module``'s, which updates
``__dict__``) makes the next BUILD, APPENDS or ADDITEMS call it.

ckptool's stand-ins keep their own methods at class level, so this mixin
keeps what BUILD put on each instance by name (``inject``) and looks it up
first (``injected``), as CPython would. What it finds is a call the file
makes (``reach``); what it does not find leaves the stand-in's own
behaviour, which calls nothing from the file.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any, cast

from ckptool.read import constructors, values
from ckptool.read.pickle import calls, policy
from ckptool.read.pickle.reach import PARTIAL, Calls, factories_in, made_by
from ckptool.read.tensors import TensorRecord
from ckptool.read.values import StandIn, brief

# an optimizer's __setstate__ calls setdefault and get on the dicts its state holds
MAPPING_METHODS = frozenset({"keys", "items", "values", "get", "setdefault", "update", "pop"})
READS_STATE = ("torch.optim.",)
# the methods torch's own __setstate__ methods call on self (looked up on the
# instance, which the state they are given has just filled): every one in
# torch 2.13 that calls any
SETSTATE_CALLS_SELF = {
    "torch.optim.": ("_patch_step_function",),
    "torch.ao.nn.quantized.": ("set_weight_bias",),
    "torch.ao.pruning.": ("_convert_mask", "_load_container_from_state"),
    "torch.nn.parallel.distributed.DistributedDataParallel": (
        "_build_debug_param_to_name_mapping", "_build_params_for_reducer", "_ddp_init_helper"),
    "torch.Tensor": ("set_",), "torch._tensor.Tensor": ("set_",),
    "torch.nn.parameter.Parameter": ("set_",),
}
MISSING = object()
# calls whose result takes a state's items as attributes (torch._utils._set_obj_state),
# and the methods torch then calls on that result, with which arguments
STATE_SETTERS = {"torch._utils._rebuild_parameter_with_state": 3,
                 "torch._tensor._rebuild_from_type_v2": 3,
                 "torch._tensor._rebuild_from_type": 3}
FROM_TYPE = ("torch._tensor._rebuild_from_type_v2", "torch._tensor._rebuild_from_type")
DEEP_TOUCH = frozenset({"builtins.str"})
_HOLDERS = (StandIn, tuple, list, set, frozenset, dict)
_SEQUENCES = (StandIn, tuple, list, set, frozenset)
HASHING = frozenset({"builtins.set", "builtins.frozenset", "builtins.dict",
                     "collections.OrderedDict", "collections.Counter", "collections.defaultdict"})


class Lookups(Calls):
    """The instance lookups of BUILD, APPEND(S) and ADDITEMS, and the opcodes.

    Every attribute a BUILD state (or a tensor rebuild's state) puts on an
    object is kept (``inject``): CPython's unpickler looks four names up
    there, and the code the unpickler calls may look up any other
    (``uuid.UUID(hex)`` calls ``hex.replace``; ``dict(x)`` calls
    ``x.keys()``), so an object that carries a callable is itself a way to
    call it, wherever a callee may use it."""

    _injected: dict[int, tuple[Any, list[dict[Any, Any]]]]
    _tensors_carry = False  # whether any tensor record carries attributes
    stack: list[Any]
    pop_mark: Callable[[], list[Any]]

    def inject(self, inst: Any, state: Any) -> None:
        """The attributes a BUILD of ``state`` sets on ``inst``."""
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        dicts = [part for part in parts if isinstance(part, dict) and part]
        if dicts:
            held = self._injected.get(id(inst))
            if held is None or held[0] is not inst:
                held = self._injected[id(inst)] = (inst, [])
            held[1].extend(dicts)
            if isinstance(inst, TensorRecord):
                self._tensors_carry = True

    def attributes(self, inst: Any) -> dict[str, Any]:
        """What BUILD put on ``inst``, the latest BUILD winning."""
        held = self._injected.get(id(inst))
        if held is None or held[0] is not inst:
            return {}
        out: dict[str, Any] = {}
        for part in held[1]:
            out.update((k, v) for k, v in part.items() if isinstance(k, str))
        return out

    def attribute_of(self, obj: Any, name: Any) -> Any:
        found = self.injected(obj, name) if isinstance(name, str) else MISSING
        return None if found is MISSING else found

    def injected(self, inst: Any, name: str) -> Any:
        return self.attributes(inst).get(name, MISSING) if self._injected else MISSING

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE, and what a tensor rebuild's state puts on the tensor."""
        result = super().call(func, args)
        name = self.called_name or ""
        if self._tensors_carry:
            # tensors that carry attributes, given to any call: torch's own
            # Python code calls methods of the tensors it is given
            # (Parameter(data) calls data.detach())
            for value in calls.walk_values(args):
                if isinstance(value, TensorRecord):
                    self._injected_methods(value, f"{name} may call")
        if name in HASHING:  # each item (a pair's key) is hashed: its class's __hash__ runs
            for arg in args:
                for item in arg if isinstance(arg, (list, tuple)) else ():
                    pair = isinstance(item, (tuple, list)) and len(item) == 2 and name not in (
                        "builtins.set", "builtins.frozenset")
                    self.touch_hashed(item[0] if pair else item, f"hashed by {name}")
        if name in DEEP_TOUCH:  # str() of a container is repr() of all it holds
            for arg in args:
                self._touch_inside(arg, f"given to {name}", into_dicts=True, deep=True)
        if name in FROM_TYPE and len(args) > 2 and isinstance(args[2], tuple):
            # ret = func(*args) (ckptool's rebuild hands ret back as it is);
            # then ret.as_subclass(new_type) and ret.__setstate__(state), looked
            # up on ret, which func's own state may have set
            inner = STATE_SETTERS.get(self.global_name(args[0]) or "")
            if inner is not None and len(args[2]) > inner:
                self.inject(result, args[2][inner])
            for method, with_ in (("as_subclass", args[1:2]), ("__setstate__", args[3:4])):
                found = self.injected(result, method)
                if found is not MISSING:
                    self.reach(found, tuple(with_), f"{name} calls {method} of what its "
                               "function made, which its state put there")
        at = STATE_SETTERS.get(name)
        if at is not None and len(args) > at:
            self.inject(result, args[at])
        if isinstance(func, StandIn) and made_by(func) == PARTIAL:
            # partial(cls, **kwds)(): what cls makes carries the keywords (a
            # Namespace's attributes), as a BUILD would have put them; the
            # keywords are partial.__new__'s, or its BUILD state's
            state = func.state
            kwds = state[2] if isinstance(state, tuple) and len(state) > 2 else None
            self.inject(result, func.kwargs)
            self.inject(result, kwds)
        return result

    def read_mapping(self, arg: Any, reader: str) -> None:
        """A mapping read by ``dict.update``: its ``keys`` (or any method) is
        looked up on the instance and called, and a ChainMap's factories run."""
        super().read_mapping(arg, reader)
        if self.attributes(arg):
            self._own_methods(arg, f"{reader} reads {brief(arg)}, and may call")

    def touch(self, obj: Any, how: str, deep: bool = False) -> None:
        """The class's code runs on ``obj``: it may call what BUILD put on it,
        and on the objects it holds as attributes (directly, or in lists and
        tuples: a Sequential's ``_modules``); ``deep`` (``str()``, which
        recurses through everything) follows them all, dicts included."""
        if not (isinstance(obj, StandIn) and self._injected):
            return
        how = f"{how}, whose class's code may call"
        todo: list[tuple[Any, int]] = [(obj, 0)]
        seen: set[int] = set()
        while todo:
            current, depth = todo.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            if len(seen) > calls.MAX_ITEMS:
                self.reach(calls.TRUNCATED, None, how)
                return
            attributes = self.attributes(current)
            self._own_methods(current, how)
            if depth >= 1 and not deep:
                continue
            for value in attributes.values():
                held = [value] + (list(value) if isinstance(value, (list, tuple)) else []) + (
                    list(value.values()) if deep and isinstance(value, dict) else [])
                todo.extend((v, depth + 1) for v in held if isinstance(v, StandIn))

    def touch_hashed(self, key: Any, how: str) -> None:
        """A key hashed: a tuple's (or frozenset's) hash is its items'."""
        if self._injected:
            self._touch_inside(key, how, into_dicts=False)

    def _touch_inside(self, value: Any, how: str, into_dicts: bool, deep: bool = False) -> None:
        """Touch the objects in ``value`` and in the lists, tuples and sets
        (and, ``into_dicts``, dicts) that hold them."""
        if not self._injected or not isinstance(value, _HOLDERS):  # (a number, a string)
            return
        if isinstance(value, StandIn):
            self.touch(value, how, deep)
            return
        kinds: tuple[type, ...] = (tuple, list, set, frozenset, dict) if into_dicts else (
            tuple, list, set, frozenset)
        todo: list[tuple[Any, int]] = [(value, 0)]
        seen: set[int] = set()
        count = 0
        while todo:
            obj, depth = todo.pop()
            items: list[Any]
            count += 1
            if count > calls.MAX_ITEMS or depth > calls.MAX_DEPTH:
                self.reach(calls.TRUNCATED, None, how)
                return
            if isinstance(obj, StandIn):
                self.touch(obj, how, deep)
            elif isinstance(obj, kinds) and id(obj) not in seen:
                seen.add(id(obj))
                if isinstance(obj, dict):
                    items = [i for pair in obj.items() for i in pair]
                else:
                    items = list(cast("Iterable[Any]", obj))
                todo.extend((item, depth + 1) for item in items)

    def unmodelled_arg(self, arg: Any, callee: str) -> None:
        """What a callee ckptool does not model may call: the callables in
        ``arg``, and the methods an earlier BUILD put on the objects in it
        (``LambdaLR(optimizer)`` calls ``group.setdefault``)."""
        super().unmodelled_arg(arg, callee)
        self._injected_methods(arg, f"given to {callee}, which may call")

    def _given_state(self, cls: str, state: Any) -> None:
        """What a class's own ``__setstate__`` (or its ``__dict__.update``)
        may call in the state BUILD gives it: the state read as a mapping
        (``keys()`` of an object, a ChainMap's factories), the factories of
        the mappings in it (an optimizer's reads its param groups' keys), the
        methods it calls on the objects in it (an optimizer's
        ``group.setdefault``), and the state's own entries, which become the
        instance's attributes, that torch's ``__setstate__`` calls as its
        methods (``Optimizer`` calls ``self._patch_step_function()``)."""
        how = f"the state BUILD gives {cls}, whose __setstate__ may read it"
        # a state that is an object, or a tuple of objects (a class's own
        # __setstate__ indexes, iterates or reads it): its class's code runs
        for part in state if isinstance(state, tuple) else (state,):
            self.touch(part, f"the state BUILD gives {cls}")
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            self.read_mapping(part, f"{cls}.__setstate__")
        if self.made_factories:  # (a full model's every state walked costs: only if any)
            for factory in factories_in(state):
                self.reach(factory, None, f"the factory of a mapping in {how}")
        if cls.startswith(READS_STATE):
            self._injected_methods(state, f"{cls}.__setstate__ may call", MAPPING_METHODS)
        verdict = self.seen.verdicts.get(cls)
        if verdict is not None and verdict.category == policy.TORCH:
            # torch's __setstate__ and __setattr__ index, iterate and test
            # membership in the containers the state sets (RNN's
            # _all_weights[0][0], Module's `name in self._parameters`)
            for part in parts:
                for value in part.values() if isinstance(part, dict) else ():
                    if isinstance(value, _SEQUENCES):  # (a dict's items are not touched)
                        self._touch_inside(value, f"set on {cls} by BUILD", into_dicts=False)
        self_calls = next((names for prefix, names in SETSTATE_CALLS_SELF.items()
                           if cls.startswith(prefix)), ())
        for part in parts:
            for key, value in part.items() if isinstance(part, dict) else ():
                if key in self_calls and self.runs_when_called(value):
                    self.reach(value, None, f"{cls}.__setstate__ calls self.{key}(), which "
                               "the state BUILD gives it sets")

    def _injected_methods(self, value: Any, how: str,
                          names: frozenset[str] | None = None) -> None:
        if not self._injected:
            return
        for obj in calls.walk_values(value, into_objects=True):
            if obj is calls.TRUNCATED:
                self.reach(obj, None, how)
            else:
                self._own_methods(obj, how, names)

    def _own_methods(self, obj: Any, how: str, names: frozenset[str] | None = None) -> None:
        for name, found in sorted(self.attributes(obj).items()):
            # a callable the file names, or a partial of one: an attribute
            # that is an object (a dtype's time zone) is data to whoever reads it
            if (names is None or name in names) and self.runs_when_called(found):
                self.reach(found, None, f"{how} {name} of {brief(obj)}, which an earlier "
                           "BUILD put on it")

    def build_calls(self, inst: Any, state: Any) -> bool:
        """BUILD: whether an injected ``__setstate__`` takes the state (then
        CPython calls it and sets nothing)."""
        setstate = self.injected(inst, "__setstate__")
        if setstate is MISSING:
            return False
        self.reach(setstate, (state,), f"BUILD on {brief(inst)} calls the __setstate__ an "
                   "earlier BUILD put on it")
        return True

    def append_calls(self, target: Any, items: list[Any]) -> bool:
        """APPEND(S) on ``target``: whether injected ``extend``/``append`` take the items."""
        if type(target) is list:
            return False
        extend = self.injected(target, "extend")
        if extend is not MISSING:
            self.reach(extend, (items,), f"APPENDS on {brief(target)} calls the extend an "
                       "earlier BUILD put on it")
            return True
        return self._each(target, "append", items, "APPENDS")

    def add_calls(self, target: Any, items: list[Any]) -> bool:
        """ADDITEMS: whether an injected ``add`` takes the items."""
        return not isinstance(target, (set, frozenset)) and self._each(
            target, "add", items, "ADDITEMS")

    def _each(self, target: Any, method: str, items: list[Any], opcode: str) -> bool:
        """Whether ``method`` was put on ``target``; if so it takes each item."""
        found = self.injected(target, method)
        if found is MISSING:
            return False
        for item in items:
            self.reach(found, (item,), f"{opcode} on {brief(target)} calls the {method} an "
                       "earlier BUILD put on it")
        return True

    # -- the opcodes (the unpickler's dispatch table names them) ----------

    def _load_build(self) -> None:
        state = self.stack[-1]
        inst = self.stack[-2]
        if self.build_calls(inst, state):  # an injected __setstate__ takes it
            self.stack.pop()
            return
        if not isinstance(inst, constructors.BUILDABLE):
            raise pickle.UnpicklingError(
                f"pickle sets state on {values.brief(inst)}, which it did not create")
        if isinstance(inst, StandIn):
            self._use(made_by(inst), policy.BUILT, "its __setstate__ or __dict__ takes the "
                      "file's state")
            # a class's own __setstate__ may read the state's mappings (an
            # optimizer's reads its param groups): their factories may run
            self._given_state(made_by(inst), state)
        self.inject(inst, state)
        _BASE_BUILD(self)  # type: ignore[arg-type]

    def _load_append(self) -> None:
        self._extend(self.stack[-2], [self.stack.pop()])

    def _load_appends(self) -> None:
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target: Any, items: list[Any]) -> None:
        """APPEND(S), as C's ``do_append``: an exact list takes the items;
        else ``extend``, then ``append``, looked up on the instance first."""
        if self.append_calls(target, items):
            return
        self.touch(target, "APPENDS on it")
        if isinstance(target, list):
            target.extend(items)
            return
        extend = getattr(target, "extend", None)
        if extend is not None:
            extend(items)
        else:
            for item in items:
                target.append(item)

    def _load_additems(self) -> None:
        items = self.pop_mark()
        for item in items:
            values.check_key(item)
            self.touch_hashed(item, "hashed as a set item")
        target = self.stack[-1]
        self.touch(target, "ADDITEMS on it")
        if isinstance(target, set):
            target.update(items)
        elif not self.add_calls(target, items):
            for item in items:
                target.add(item)


_BASE_BUILD = pickle._Unpickler.dispatch[pickle.BUILD[0]]
