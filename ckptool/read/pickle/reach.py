"""What CPython's unpickler, and the callees it calls, would call.

Mixed into ``ckptool.read.pickle.unpickler.SafeUnpickler``: ``call`` is REDUCE,
INST and OBJ (the callee named, then its model applied to its arguments),
``reach`` is a call the real code makes later (a partial's target, a
defaultdict's factory, an injected ``__setstate__``), and ``getattr`` is
``builtins.getattr`` on a global the file names, which names another global
(``getattr(ZoneInfo, "_unpickle")`` is ``zoneinfo.ZoneInfo._unpickle``).

Every call is recorded on the global it reaches (``seen.use``) with why and
where; ``policy.judge`` turns those records into verdicts. Nothing the file
names is imported or called here: stand-ins and ckptool's own safe
implementations only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptool.errors import CkptoolError
from ckptool.read import constructors
from ckptool.read.pickle import calls, policy
from ckptool.read.seen import GlobalsSeen
from ckptool.read.values import StandIn, brief

PARTIAL = "functools.partial"
CHAINMAP = "collections.ChainMap"
DEFAULTDICT = "collections.defaultdict"
LOAD_FROM_BYTES = "torch.storage._load_from_bytes"
FACTORY_HOLDERS = frozenset({DEFAULTDICT, CHAINMAP})
# callees that keep what they are given and use none of it
UNTOUCHED = frozenset({PARTIAL, "argparse.Namespace"})
MAX_REACH_DEPTH = 32  # partials of partials...: deeper is refused as unknown
TOO_MUCH = "ckptool.<more than ckptool follows>"  # the name a bounded walk fails closed as
# objects a modelled callee makes that call something when called themselves
CALLABLE_OBJECTS = frozenset({PARTIAL, CHAINMAP, *(
    f"{m}.{n}" for m in ("operator", "_operator")
    for n in ("itemgetter", "attrgetter", "methodcaller"))})


_RECONSTRUCTORS = ("copyreg._reconstructor", "copyreg.__newobj__", "copyreg.__newobj_ex__")


def made_by(obj: StandIn) -> str:
    """The global an inert object was made from: ``x()`` and ``x()()`` are
    results of calling ``x``; ``copyreg._reconstructor(cls, ...)``, as a
    rewrite's read keeps it, made a ``cls``."""
    name = type(obj).qualname.split("()", 1)[0]
    if name in _RECONSTRUCTORS and obj.args and type(obj.args[0]) is type and issubclass(
            obj.args[0], StandIn):
        return obj.args[0].qualname
    return name


def partial_parts(obj: StandIn) -> tuple[Any, tuple[Any, ...]]:
    """(target, bound arguments) of a ``functools.partial`` stand-in: its
    BUILD state ``(func, args, kwds, dict)`` wins over ``partial(func, *args)``.
    (Its keywords are looked through as any value is: ``callables_in``.)"""
    state = obj.state
    if isinstance(state, tuple) and state:
        bound = state[1] if len(state) > 1 and isinstance(state[1], tuple) else ()
        return state[0], bound
    return (obj.args[0] if obj.args else None), tuple(obj.args[1:])


def _factory(obj: Any) -> Any:
    if isinstance(obj, constructors.DefaultDict):
        return obj.factory
    if isinstance(obj, StandIn) and made_by(obj) == DEFAULTDICT and obj.args:
        return obj.args[0]
    return None


def _chain_maps(obj: StandIn) -> list[Any]:
    """A ChainMap's maps: its constructor's arguments, or BUILD's ``maps``."""
    maps = list(obj.args)
    state = obj.state_dict_view().get("maps")
    if isinstance(state, (list, tuple)):
        maps.extend(state)
    return maps


def factories_read(value: Any, depth: int = 0) -> Iterator[Any]:
    """The defaultdict factories that reading ``value`` key by key calls: a
    ChainMap looks each key up in each of its maps in turn, so a map that
    lacks it calls its ``__missing__``. ``calls.TRUNCATED`` where ChainMaps
    nest deeper than ckptool follows."""
    if not (isinstance(value, StandIn) and made_by(value) == CHAINMAP):
        return
    if depth > calls.MAX_DEPTH:
        yield calls.TRUNCATED
        return
    for m in _chain_maps(value):
        factory = _factory(m)
        if factory is not None:
            yield factory
        yield from factories_read(m, depth + 1)


def factories_in(value: Any) -> Iterator[Any]:
    """The factories a reader of ``value`` could call: each defaultdict's
    (a lookup of a missing key) and each ChainMap's maps' (any lookup)."""
    for v in calls.walk_values(value):
        if v is calls.TRUNCATED:
            yield v
            continue
        factory = _factory(v)
        if factory is not None:
            yield factory
        yield from factories_read(v)


class Calls:
    """The call model, for the unpickler to mix in."""

    seen: GlobalsSeen
    _resolved: dict[int, tuple[Any, str]]
    _split: dict[str, tuple[str, str]]
    _reach_depth: int = 0
    made_factories = False  # whether the read made a defaultdict or a ChainMap yet
    called_name: str | None = None  # the global the last call called

    def find_class(self, module: str, name: str) -> Any:  # the unpickler's
        raise NotImplementedError

    def _position(self) -> str:
        raise NotImplementedError

    def _load_from_bytes(self, data: Any) -> Any:
        raise NotImplementedError

    def global_name(self, value: Any) -> str | None:
        """The dotted name of a global the file named, if ``value`` is one."""
        if type(value) is type and issubclass(value, StandIn) and "()" not in value.qualname:
            return value.qualname
        found = self._resolved.get(id(value))
        return found[1] if found is not None and found[0] is value else None

    def _use(self, dotted: str, use: str, why: str = "") -> None:
        if dotted in FACTORY_HOLDERS:
            self.made_factories = True
        known = self.seen.why.get(dotted)
        if known is not None and use in known:  # said once, where it first happened
            self.seen.use(dotted, use)
        else:
            self.seen.use(dotted, use, why, self._position())

    def _called(self, name: str, how: str) -> None:
        """A call with known arguments: recorded, but for the callees the
        model holds, whose calls are judged by what they do with their
        arguments (recorded on those), not by being called."""
        if name in FACTORY_HOLDERS:
            self.made_factories = True
        if calls.model_of(name) is None:
            self._use(name, policy.CALLED, how)

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE (and INST, OBJ): ``func(*args)``, recorded and modelled."""
        if not isinstance(args, tuple):
            raise TypeError("the arguments of a call are not a tuple")
        name = self.called_name = self.global_name(func)
        if name == policy.GETATTR:
            return self.getattr(func, args)
        if name is not None:
            self._called(name, "called by the pickle")
            self.apply_model(name, args)
            if name not in UNTOUCHED:
                for arg in args:
                    if isinstance(arg, StandIn):  # (the only kind touch acts on)
                        self.touch(arg, f"given to {name}")
        elif isinstance(func, StandIn):
            self.reach(func, args, "called by the pickle")
        return func(*args)

    def touch(self, obj: Any, how: str) -> None:
        """Code of ``obj``'s class runs on it (its ``__repr__``, ``__iter__``,
        ``__hash__``, ``__setitem__``; a modelled callee's use of it): what
        that code may call on it is what a BUILD put there (lookups)."""

    def touch_hashed(self, key: Any, how: str) -> None:
        """``key`` is hashed (lookups)."""

    def getattr(self, func: Any, args: tuple[Any, ...]) -> Any:
        """``getattr(G, "name")`` on a global ``G``: the global ``G.name``
        (how protocols 0-2 name a nested class or a method). On an object made
        from a class ``C`` (how pickle writes a bound method, a module's hook):
        what BUILD put on it under that name, else ``C.name``, judged as that
        global is. On anything else the lookup is the object's own code:
        unknown."""
        target = args[0] if len(args) == 2 else None
        attr = args[1] if len(args) == 2 else None
        owner = self.global_name(target)
        if owner is None and isinstance(target, StandIn) and not policy.function_like(
                made_by(target)):  # an object of a class (a function's result is unknown)
            owner = made_by(target)
            found = self.attribute_of(target, attr)
            if found is not None:
                self._use(policy.GETATTR, policy.CALLED, "looks up an attribute of an object")
                return found
        if owner is None or owner not in self._split or not (
                isinstance(attr, str) and attr.isidentifier()):
            self._use(policy.GETATTR, policy.MISUSED,
                      f"getattr({brief(target)}, ...) on a value that is neither a global nor "
                      "an object of one: what the lookup runs and returns is its own code")
            return func(*args)
        self._use(policy.GETATTR, policy.CALLED, "looks up an attribute of a global")
        module, name = self._split[owner]
        found = self.find_class(module, f"{name}.{attr}")
        from ckptool.read.resolve import is_faithful

        if not is_faithful():
            return found
        # a rewrite's read keeps the call (to write it back as it is); what it
        # makes is that global, for whatever is done with it next
        kept = func(*args)
        self._resolved[id(kept)] = (kept, f"{module}.{name}.{attr}")
        return kept

    def attribute_of(self, obj: Any, name: Any) -> Any:
        """What an earlier BUILD put on ``obj`` under ``name``, or None."""
        return None

    def apply_model(self, name: str, args: tuple[Any, ...]) -> None:
        """What the real ``name`` does with ``args``: the calls it makes."""
        model = calls.model_of(name)
        if name == LOAD_FROM_BYTES:
            return  # the unpickler reads the bytes as the file torch.load would read
        if model is not None and model.stores_all:
            return
        if model is not None and model.max_args is not None and len(args) > model.max_args:
            self._use(name, policy.MISUSED, f"called with {len(args)} arguments, a use ckptool "
                      f"does not model ({model.what})")
        if name.endswith("operator.getitem") and args and _factory(args[0]) is not None:
            self.reach(_factory(args[0]), (), f"the factory of a defaultdict {name} reads "
                       "(its __missing__)")
        for pos, arg in enumerate(args):
            role = model.role(pos) if model is not None else None
            if role == calls.STORE:
                continue
            if role == calls.CREATE:
                created = self.global_name(arg)
                if created is not None:
                    new_args = args[pos + 1:] if name.startswith("copyreg.__newobj") else ()
                    self.new_with(created, new_args, None, name)
            elif role == calls.CALL:
                if name == "copyreg._reconstructor" and self.global_name(arg) == "builtins.object":
                    continue  # object.__new__(cls): nothing else runs
                self.reach(arg, self._call_args(model, pos, args), f"called by {name}")
            elif role == calls.READ:
                self.read_mapping(arg, name)
            else:
                self.unmodelled_arg(arg, name)

    def unmodelled_arg(self, arg: Any, callee: str) -> None:
        """``arg`` given to a callee ckptool does not model: what in it is
        callable may be called, with arguments ckptool cannot know."""
        for value in self.callables_in(arg):
            self.reach(value, None, f"passed to {callee}, which ckptool does not model "
                       "calling it")

    def new_with(self, cls: str, args: Any, kwargs: Any, how: str) -> None:
        """``cls.__new__(cls, *args, **kwargs)``: an object made; its
        ``__new__`` given the file's arguments, where it acts on them, misused."""
        self._use(cls, policy.CREATED, f"made by {how} (cls.__new__)")
        if (args or kwargs) and cls in calls.NEW_ACTS:
            self._use(cls, policy.MISUSED, f"{how} gives its __new__ the file's arguments: "
                      f"{calls.NEW_ACTS[cls]}")
        if kwargs:
            self.read_mapping(kwargs, f"{cls}.__new__(**kwargs)")
        for arg in args if isinstance(args, tuple) else ():
            self.touch(arg, f"given to {cls}.__new__ by {how}")

    def read_mapping(self, arg: Any, reader: str) -> None:
        """``reader`` reads ``arg`` key by key (``dict.update``): a ChainMap's
        defaultdicts' factories run for the keys they lack."""
        for factory in factories_read(arg):
            self.reach(factory, (), f"the factory of a defaultdict that {reader} reads "
                       "through a ChainMap (its __missing__)")

    @staticmethod
    def _call_args(model: calls.Model | None, pos: int,
                   args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if model is None:
            return None
        spread = model.spreads.get(pos)
        if spread is not None:  # func(*args[spread])
            items = args[spread] if spread < len(args) else None
            return items if isinstance(items, tuple) else None
        with_ = model.calls_with.get(pos)
        if with_ is None:
            return None
        return tuple(args[i] for i in with_ if i < len(args))

    def runs_when_called(self, value: Any) -> bool:
        """Whether calling ``value`` calls a global: a global callable, or a
        ``functools.partial``, or a ChainMap (whose reading calls factories)."""
        if self.global_name(value) is not None:
            return callable(value) or isinstance(value, type)
        return isinstance(value, StandIn) and (made_by(value) in CALLABLE_OBJECTS or made_by(
            value).startswith(calls.CALLABLE_CLASSES))

    def callables_in(self, value: Any) -> Iterator[Any]:
        """The values in ``value`` that a call could run: globals that are
        callables, ``functools.partial`` objects (and what they hold),
        ChainMaps, defaultdict factories; looked for in what the objects in
        ``value`` were built from too (a partial's keywords)."""
        for v in calls.walk_values(value, into_objects=True):
            if v is calls.TRUNCATED or self.runs_when_called(v):
                yield v
            elif _factory(v) is not None:
                yield _factory(v)

    def reach(self, value: Any, args: tuple[Any, ...] | None, how: str) -> None:
        """The real code calls ``value`` (``args``; None: arguments ckptool
        cannot know)."""
        if value is calls.TRUNCATED:  # a walk stopped at its bounds: fail closed
            self.seen.flag(TOO_MUCH, f"{how}: more values than ckptool follows (depth "
                           f"{calls.MAX_DEPTH}, {calls.MAX_ITEMS} items); what lies past "
                           "that could be called")
            return
        if self._reach_depth >= MAX_REACH_DEPTH:
            self._use(PARTIAL, policy.MISUSED, "calls nest too deeply to follow")
            return
        self._reach_depth += 1
        try:
            self._reach(value, args, how)
        finally:
            self._reach_depth -= 1

    def _reach(self, value: Any, args: tuple[Any, ...] | None, how: str) -> None:
        name = self.global_name(value)
        if name is not None:
            if not (callable(value) or isinstance(value, type)):
                return  # a dtype or a constant: calling it fails, runs nothing
            if args is None:
                self._use(name, policy.REACHED, how)
                return
            self._called(name, how)
            self.apply_model(name, args)
            if name == LOAD_FROM_BYTES:
                self._nested_load(args)
            return
        if isinstance(value, StandIn):
            made = made_by(value)
            if made == PARTIAL:
                target, bound = partial_parts(value)
                self.reach(target, None if args is None else bound + args,
                           f"{how}, through a functools.partial")
            elif made == CHAINMAP:
                # a ChainMap as a callable: not callable, but its factories are read
                for factory in factories_read(value):
                    self.reach(factory, (), f"{how}: the factory of a defaultdict in a ChainMap")
            else:
                self._use(made, policy.CALLED_INSTANCE, how)
        # anything else is a value ckptool made (a list, a dict, a tensor
        # record): not callable where torch loads it, so nothing runs

    def _nested_load(self, args: tuple[Any, ...]) -> None:
        """``torch.storage._load_from_bytes`` reached by a later call: the
        bytes are read as the torch file that ``torch.load`` would read."""
        try:
            self._load_from_bytes(*args)
        except (CkptoolError, TypeError) as exc:
            self._use(LOAD_FROM_BYTES, policy.MISUSED,
                      f"torch.load(weights_only=False) of bytes ckptool cannot read as a "
                      f"torch file ({exc}): whatever pickle they hold would run")
