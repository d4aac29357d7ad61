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
from collections.abc import Callable
from typing import Any

from ckptool.read import constructors, values
from ckptool.read.pickle import calls, policy
from ckptool.read.pickle.reach import Calls, factories_in, made_by
from ckptool.read.values import StandIn, brief

# what CPython's unpickler looks up on an instance, and what the callees it
# calls look up there: dict() and MutableMapping.update call ``keys()`` on
# anything that has it; an optimizer's __setstate__ calls setdefault and get
# on the dicts its state holds
LOOKED_UP = frozenset({"__setstate__", "append", "extend", "add"})
MAPPING_METHODS = frozenset({"keys", "items", "values", "get", "setdefault", "update", "pop"})
READS_STATE = ("torch.optim.",)  # classes whose __setstate__ calls methods of its state
MISSING = object()
# calls whose result takes a state's items as attributes (torch._utils._set_obj_state)
STATE_SETTERS = {"torch._utils._rebuild_parameter_with_state": 3,
                 "torch._tensor._rebuild_from_type_v2": 3,
                 "torch._tensor._rebuild_from_type": 3}


class Lookups(Calls):
    """The instance lookups of BUILD, APPEND(S) and ADDITEMS, and the opcodes."""

    _injected: dict[int, tuple[Any, dict[str, Any]]]
    stack: list[Any]
    pop_mark: Callable[[], list[Any]]

    def inject(self, inst: Any, state: Any) -> None:
        """The names CPython looks up that a BUILD of ``state`` sets on ``inst``."""
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if not isinstance(part, dict):
                continue
            for key in (LOOKED_UP | MAPPING_METHODS).intersection(
                    k for k in part if isinstance(k, str)):
                held = self._injected.setdefault(id(inst), (inst, {}))
                held[1][key] = part[key]

    def injected(self, inst: Any, name: str) -> Any:
        held = self._injected.get(id(inst))
        if held is None or held[0] is not inst:
            return MISSING
        return held[1].get(name, MISSING)

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE, and what a tensor rebuild's state puts on the tensor."""
        result = super().call(func, args)
        at = STATE_SETTERS.get(self.global_name(func) or "")
        if at is not None and len(args) > at:
            self.inject(result, args[at])
        return result

    def read_mapping(self, arg: Any, reader: str) -> None:
        """A mapping read by ``dict.update``: its ``keys`` is looked up on the
        instance and called, and a ChainMap's factories run."""
        super().read_mapping(arg, reader)
        keys = self.injected(arg, "keys")
        if keys is not MISSING:
            self.reach(keys, (), f"{reader} reads {brief(arg)} through the keys an earlier "
                       "BUILD put on it")

    def unmodelled_arg(self, arg: Any, callee: str) -> None:
        """What a callee ckptool does not model may call: the callables in
        ``arg``, and the methods an earlier BUILD put on the objects in it
        (``LambdaLR(optimizer)`` calls ``group.setdefault``)."""
        super().unmodelled_arg(arg, callee)
        self._injected_methods(arg, f"given to {callee}, which may call")

    def _state_methods(self, cls: str, state: Any) -> None:
        """A class whose __setstate__ calls methods of the objects in its
        state (an optimizer's ``group.setdefault``): what BUILD put there runs."""
        if cls.startswith(READS_STATE):
            self._injected_methods(state, f"{cls}.__setstate__ may call")

    def _injected_methods(self, value: Any, how: str) -> None:
        for obj in calls.walk_values(value):
            held = self._injected.get(id(obj))
            if held is None or held[0] is not obj:
                continue
            for name in sorted(held[1]):
                self.reach(held[1][name], None, f"{how} {name} of {brief(obj)}, which an "
                           "earlier BUILD put on it")

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
        append = self.injected(target, "append")
        if append is MISSING:
            return False
        for item in items:
            self.reach(append, (item,), f"APPENDS on {brief(target)} calls the append an "
                       "earlier BUILD put on it")
        return True

    def add_calls(self, target: Any, items: list[Any]) -> bool:
        """ADDITEMS: whether an injected ``add`` takes the items."""
        if isinstance(target, (set, frozenset)):
            return False
        add = self.injected(target, "add")
        if add is MISSING:
            return False
        for item in items:
            self.reach(add, (item,), f"ADDITEMS on {brief(target)} calls the add an earlier "
                       "BUILD put on it")
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
            for factory in factories_in(state):
                self.reach(factory, None, f"the factory of a mapping in the state BUILD gives "
                           f"{made_by(inst)}, whose __setstate__ may read it")
            self._state_methods(made_by(inst), state)
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
        target = self.stack[-1]
        if isinstance(target, set):
            target.update(items)
        elif not self.add_calls(target, items):
            for item in items:
                target.add(item)


_BASE_BUILD = pickle._Unpickler.dispatch[pickle.BUILD[0]]
