"""The callables ckptool models: what each real one does with its arguments.

A pickle's globals are only dangerous where something calls them. CPython's
unpickler calls what REDUCE, INST and OBJ name; a modelled callee may then
call one of its own arguments (numpy's random-state helpers call their
bit-generator argument; ``_rebuild_from_type_v2`` calls its first;
``copyreg._reconstructor`` runs its base class's constructor), make an
object of one (``cls.__new__``), or read a mapping whose ``__missing__``
calls a factory (``Counter(ChainMap(defaultdict(f), ...))`` calls ``f``).

``MODELS`` is the whole table. Each entry says, for each argument position:

- ``STORE``: kept as a value; the callee never calls it;
- ``CREATE``: a class it makes an instance of (``cls.__new__``);
- ``CALL``: a callable it calls (with the arguments ``calls_with`` says);
- ``READ``: a mapping it reads key by key (a ChainMap's defaultdicts'
  factories are called for the keys they lack).

A callable value (a global, a ``functools.partial``, a factory held by a
``defaultdict``) at any position the model does not name, or given to a
callee the table does not hold, may be called with arguments ckptool
cannot know: it is judged as called. ``any_args`` marks the callees that
are harmless whatever they are given (plain data constructors).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptool.read.values import StandIn

# tensor ops that compute on their arguments and touch nothing else (aten's,
# as TorchScript spells them: torch.X or ops.aten.X)
PURE_OPS = frozenset([
    "abs", "absolute", "acos", "add", "add_", "addmm", "all", "allclose", "amax", "amin", "any",
    "arange", "argmax", "argmin", "asin", "atan", "atan2", "baddbmm", "bitwise_and",
    "bitwise_not", "bitwise_or", "bmm", "broadcast_tensors", "cat", "ceil", "chunk", "clamp",
    "clamp_", "clamp_max", "clamp_min", "clone", "contiguous", "copy_", "cos", "cosh",
    "cumprod", "cumsum", "detach", "detach_", "device", "diag", "dim", "div", "div_", "dropout",
    "dtype", "einsum", "empty", "empty_like", "eq", "equal", "erf", "exp", "expand",
    "expand_as", "eye", "fill_", "flatten", "flip", "floor", "floor_divide", "fmod", "format",
    "full", "full_like", "gather", "ge", "gelu", "gt", "hardtanh", "index", "index_put_",
    "index_select", "is_floating_point", "is_nonzero", "isnan", "item", "layer_norm", "le",
    "len", "linear", "linspace", "log", "log_softmax", "logical_and", "logical_not",
    "logical_or", "lt", "masked_fill", "masked_fill_", "matmul", "max", "maximum", "mean",
    "min", "minimum", "mm", "mul", "mul_", "narrow", "ne", "neg", "nonzero", "norm", "numel",
    "ones", "ones_like", "permute", "pow", "prod", "rand", "rand_like", "randn", "randn_like",
    "relu", "relu_", "remainder", "repeat", "reshape", "round", "rsqrt", "scalar_tensor",
    "select", "sigmoid", "sign", "sin", "size", "slice", "softmax", "sort", "split", "sqrt",
    "squeeze", "stack", "std", "sub", "sub_", "sum", "t", "tanh", "tensor", "tensor_split",
    "to", "topk", "transpose", "tril", "triu", "unbind", "unsqueeze", "var", "view", "view_as",
    "where", "zero_", "zeros", "zeros_like", "quantize_per_tensor", "quantize_per_channel",
    "dequantize", "_empty_affine_quantized", "_empty_per_channel_affine_quantized", "q_scale",
    "q_zero_point", "q_per_channel_scales", "q_per_channel_zero_points", "q_per_channel_axis",
    "int_repr", "qscheme", "__and__", "__or__", "__not__", "__is__", "__isnot__",
    "__contains__", "__getitem__", "__setitem__", "__derive_index", "__range_length",
    "__interpolate", "_set_item", "append", "extend", "insert", "pop", "keys", "values",
    "items", "get", "setdefault", "update", "clear", "copy", "list", "dict", "str", "int",
    "float", "bool", "warn",
])

STORE, CREATE, CALL, READ = "store", "create", "call", "read"
REST = -1  # the position that stands for every position not listed


@dataclass(frozen=True)
class Model:
    what: str  # what the real callee does, in a line
    positions: dict[int, str] = field(default_factory=dict)  # REST for the others
    any_args: bool = False  # harmless however it is called (a data constructor)
    max_args: int | None = None  # more arguments than this is a use the model does not cover
    # CALL positions: which argument positions the call passes on (None: unknown)
    calls_with: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    # CALL positions called with the items of another argument (func(*args))
    spreads: dict[int, int] = field(default_factory=dict)

    def role(self, position: int) -> str | None:
        return self.positions.get(position, self.positions.get(REST))

    # whether it only stores what it is given (most models: a quick path)
    stores_all: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stores_all", self.positions == {REST: STORE})


def _stores(what: str) -> Model:
    return Model(what, {REST: STORE}, any_args=True)


def _reads_first(what: str) -> Model:
    return Model(what, {0: READ, REST: STORE}, any_args=True)


_NUMPY_CORES = ("numpy.core", "numpy._core")
_REBUILD_STORES = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                   "_rebuild_qtensor", "_rebuild_parameter", "_rebuild_parameter_with_state",
                   "_rebuild_meta_tensor_no_storage", "_rebuild_device_tensor_from_numpy",
                   "_rebuild_xla_tensor", "_rebuild_mtia_tensor", "_rebuild_sparse_tensor",
                   "_rebuild_nested_tensor")

MODELS: dict[str, Model] = {
    # plain data: they iterate or store what they are given
    **{f"builtins.{n}": _stores(f"builds a {n} from data") for n in (
        "list", "tuple", "set", "frozenset", "slice", "complex", "bytes", "bytearray",
        "int", "float", "str", "bool", "object", "range")},
    "builtins.dict": _reads_first("builds a dict, reading a mapping key by key"),
    "collections.OrderedDict": _reads_first("builds an OrderedDict, reading a mapping"),
    "collections.Counter": _reads_first("builds a Counter, reading a mapping key by key"),
    "collections.defaultdict": Model(
        "builds a dict that calls its factory for a missing key; reads its mapping",
        {0: STORE, 1: READ, REST: STORE}, any_args=True),
    "collections.ChainMap": _stores("stores mappings; reading it reads each in turn"),
    "collections.deque": _stores("builds a deque from an iterable"),
    "collections.OrderedDict.__new__": _stores("builds an OrderedDict"),
    "functools.partial": _stores("stores a callable and its arguments; calling the "
                                 "partial calls the callable"),
    "argparse.Namespace": _stores("stores attributes"),
    "builtins.type": Model("type(x): the type of x (three arguments would make a class)",
                           {0: STORE}, any_args=True, max_args=1),
    "logging.getLogger": _stores("the logger of that name (made if new)"),
    **{name: _stores("a tuple of values by field name") for name in (
        "os.stat_result", "posix.stat_result", "time.struct_time")},
    **{f"{mod}.{n}": _stores("builds a callable object; calling it is judged as a call")
       for mod in ("operator", "_operator") for n in ("itemgetter", "attrgetter",
                                                     "methodcaller")},
    **{f"{mod}.getitem": Model("obj[key]: its own __getitem__ (a defaultdict's factory runs "
                               "for a missing key)", {0: READ, 1: STORE})
       for mod in ("operator", "_operator")},
    "torch.amp.grad_scaler._refresh_per_optimizer_state": _stores(
        "a fresh dict of GradScaler's per-optimizer state"),
    "torch.cuda.amp.grad_scaler._refresh_per_optimizer_state": _stores(
        "a fresh dict of GradScaler's per-optimizer state"),
    "array.array": _stores("an array of numbers from its typecode and items"),
    # a quantization config: a namedtuple of observer factories, stored
    **{f"torch.ao.quantization.qconfig.{n}": _stores("a namedtuple of observer factories")
       for n in ("QConfig", "QConfigDynamic")},
    # Python 3.13 takes a mapping as its positional argument, read key by key
    "types.SimpleNamespace": _reads_first("stores attributes (from a mapping it reads)"),
    "copyreg._reconstructor": Model(
        "object.__new__(cls), or base.__new__(cls, state) and base.__init__(obj, state)",
        {0: CREATE, 1: CALL, 2: READ}, calls_with={1: None}),
    "copyreg.__newobj__": Model("cls.__new__(cls, *args)", {0: CREATE, REST: STORE}),
    "copyreg.__newobj_ex__": Model("cls.__new__(cls, *args, **kwargs)",
                                   {0: CREATE, 1: STORE, 2: READ}),
    "_codecs.encode": _stores("encodes a string to bytes"),
    "codecs.encode": _stores("encodes a string to bytes"),
    "re._compile": _stores("compiles a regular expression"),
    "re.compile": _stores("compiles a regular expression"),
    "array._array_reconstructor": Model("array.array from its typecode and bytes",
                                        {0: CREATE, REST: STORE}),
    "zoneinfo.ZoneInfo._unpickle": _stores("a time zone by its key, from the system's "
                                           "time-zone database"),
    # numpy
    **{f"{core}.multiarray._reconstruct": Model("ndarray.__new__(subtype, shape, dtype)",
                                                {0: CREATE, REST: STORE})
       for core in _NUMPY_CORES},
    **{f"{core}.{name}": _stores(what) for core in _NUMPY_CORES for name, what in (
        ("multiarray.scalar", "a numpy scalar from its bytes"),
        ("numeric._frombuffer", "an array from its bytes"),
        ("_internal._convert_to_stringdtype_kwargs", "a StringDType from its options"))},
    "numpy.ma.core._mareconstruct": Model("a masked array of a subtype",
                                          {0: CREATE, 1: CREATE, REST: STORE}),
    "numpy.random._pickle.__randomstate_ctor": Model(
        "calls its second argument (a bit-generator constructor) with its first",
        {0: STORE, 1: CALL}, calls_with={1: (0,)}),
    "numpy.random._pickle.__generator_ctor": Model(
        "calls its second argument (a bit-generator constructor) with its first",
        {0: STORE, 1: CALL}, calls_with={1: (0,)}),
    "numpy.random._pickle.__bit_generator_ctor": Model(
        "calls its argument when it is a class; else looks the name up", {0: CALL},
        calls_with={0: ()}),
    "numpy.random.__RandomState_ctor": _stores("a RandomState"),
    # torch
    "torch.device": _stores("a device from its name"),
    "torch.Size": _stores("a shape from its sizes"),
    "torch.serialization._get_layout": _stores("a layout by its name"),
    "torch.storage._load_from_bytes": Model(
        "torch.load(weights_only=False) of the bytes it is given: read and judged as a "
        "file of their own", {0: STORE}),
    **{f"torch._utils.{name}": Model("rebuilds a tensor from a storage and sizes",
                                     {REST: STORE}) for name in _REBUILD_STORES},
    "torch._utils._rebuild_wrapper_subclass": Model(
        "Tensor._make_wrapper_subclass(cls, ...)", {0: CREATE, REST: STORE}),
    "torch._tensor._rebuild_from_type_v2": Model(
        "func(*args), then as_subclass(new_type) and its __setstate__(state)",
        {0: CALL, 1: CREATE, 2: STORE, 3: STORE}, spreads={0: 2}),
    "torch._tensor._rebuild_from_type": Model(
        "func(*args), then as_subclass(new_type)",
        {0: CALL, 1: CREATE, 2: STORE, 3: STORE}, spreads={0: 2}),
    "torch.nested._internal.nested_tensor._rebuild_njt": _stores(
        "a jagged nested tensor from its parts"),
    # TorchScript's pickler tags lists with these: each returns its argument
    **{f"torch.jit._pickle.{n}": _stores("returns its argument") for n in (
        "build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
        "restore_type_tag")},
    **{f"datetime.{n}": _stores(f"a {n} from its fields") for n in (
        "datetime", "date", "time", "timedelta", "timezone", "tzinfo")},
}

# numpy.random's Cython unpicklers: __pyx_unpickle_X(cls, checksum, state) is
# cls.__new__(cls) and its __setstate_cython__(state)
_STRUCTSEQ = _stores("a torch result (a tuple of tensors by field name)")
_PYX = Model("cls.__new__(cls), then its state", {0: CREATE, REST: STORE})


# classes whose objects are callable and call what is on them: a module's
# __call__ runs its forward (an instance attribute wins) and its hooks; an
# observer factory calls its ``p``
CALLABLE_CLASSES = ("torch.nn.modules.", "torch.ao.nn.", "torch.nn.parallel.",
                    "torch.distributed.algorithms._checkpoint.",
                    "torch.ao.quantization.observer._PartialWrapper")

# classes whose __new__ acts on its arguments (NEWOBJ, copyreg.__newobj__
# give it the file's): never made that way by what ckptool lets through
NEW_ACTS = {"numpy.memmap": "memmap.__new__ opens, or creates, the file its arguments name"}


def model_of(dotted: str) -> Model | None:
    found = MODELS.get(dotted)
    if found is None and dotted.startswith("numpy.random.") and \
            dotted.rpartition(".")[2].startswith("__pyx_unpickle_"):
        return _PYX
    if found is None and dotted.startswith("torch.return_types."):
        return _STRUCTSEQ
    return found


# the values a call's arguments (or a BUILD's state) hold are looked through,
# bounded; a walk that reaches its bounds yields TRUNCATED, and the caller
# fails closed (what lies past the bounds could be anything)
MAX_DEPTH = 32
MAX_ITEMS = 1_000_000
TRUNCATED = object()


def walk_values(value: Any, into_objects: bool = False) -> Iterator[Any]:
    """``value`` and what plain containers in it hold (and, ``into_objects``,
    what the stand-ins in it were built from: arguments, state, items)."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    seen: set[int] = set()
    count = 0
    while todo:
        if count >= MAX_ITEMS:
            yield TRUNCATED
            return
        obj, depth = todo.pop()
        count += 1
        yield obj
        if id(obj) in seen:
            continue
        if isinstance(obj, (tuple, list, set, frozenset, dict)) or (
                into_objects and isinstance(obj, StandIn)):
            if depth >= MAX_DEPTH:
                yield TRUNCATED
                return
            seen.add(id(obj))
            todo.extend((item, depth + 1) for item in _parts(obj))


def _parts(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [item for pair in obj.items() for item in pair]
    if isinstance(obj, StandIn):
        return [*obj.args, *obj.kwargs.values(), obj.state, *obj.items,
                *obj.dictitems, *obj.dictitems.values()]
    return list(obj)


# pure functions: calling one, with any arguments, computes on them and
# touches nothing else (a stored activation, an init function, a math
# function may be called by what loads it without harm). Only a name defined
# in one of these modules, one identifier deep: what they import (torch,
# importlib, handle_torch_function) is reached by a longer chain, which is
# judged as any other
PURE_FAMILIES = ("torch.nn.functional.", "torch._C._nn.", "torch.nn.init.", "math.")
PURE_IN = ("torch._C._VariableFunctionsClass.", "torch.", "torch._C._TensorBase.",
           "torch.Tensor.")
_NOT_PURE = frozenset({"handle_torch_function", "has_torch_function",
                       "has_torch_function_unary", "has_torch_function_variadic",
                       "boolean_dispatch", "torch", "math", "warnings", "importlib", "np",
                       "typing", "dataclasses"})


def pure(dotted: str) -> bool:
    """Whether ``dotted`` names a pure function (one defined in a
    ``PURE_FAMILIES`` module, or one of TorchScript's pure tensor ops under
    torch)."""
    head, _, name = dotted.rpartition(".")
    if not name.isidentifier() or name.startswith("_") or name in _NOT_PURE:
        return False
    return f"{head}." in PURE_FAMILIES or (f"{head}." in PURE_IN and name in PURE_OPS)
