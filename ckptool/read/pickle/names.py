"""Which world each global a pickle names belongs to, by its name alone.

``classify`` puts ``module.name`` in a category before anything is known
of its use (``ckptool.read.pickle.policy.judge`` then decides by use):

- ``torch``: tensor and storage reconstruction, dtypes, devices,
  ``torch.nn`` module classes, optimizers, DCP metadata dataclasses;
- ``data``: known, inert data types (``collections.OrderedDict``,
  ``argparse.Namespace``, numpy arrays, pathlib, omegaconf...);
- ``unsafe``: members of the modules that run code or reach the system
  (``os``, ``subprocess``, ``builtins.eval``, ``torch.hub``...), and every
  other name of a known world (the standard library, torch, numpy) that
  the tables do not list as data: what
  ckptool does not know there may act when called or made;
- ``custom``: anything else (``mypkg.nets.ResNet``): loading imports it.

Data modules are trusted for their classes only: their functions include
string evaluators and command runners (``typing.get_type_hints``,
``uuid._get_command_stdout``), so a lowercase name there is unsafe unless
``calls.MODELS`` models it. numpy is an allowlist too.
"""

from __future__ import annotations

import builtins
import re
import sys
from dataclasses import dataclass

TORCH = "torch"
DATA = "data"
UNSAFE = "unsafe"
CUSTOM = "custom"

# module prefixes whose every member is treated as able to run code or
# reach the operating system
_UNSAFE_MODULES = (
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "sys", "runpy",
    "pickle", "_pickle", "cPickle", "pickletools", "dill", "cloudpickle",
    "joblib", "marshal", "types", "importlib", "imp", "pkgutil", "zipimport",
    "code", "codeop", "pty", "tty", "socket", "ssl", "select", "selectors",
    "shutil", "ctypes", "_ctypes", "cffi", "webbrowser", "asyncio",
    "multiprocessing", "concurrent", "threading", "_thread", "signal",
    "platform", "pdb", "bdb", "timeit", "trace", "profile", "cProfile",
    "distutils", "setuptools", "pip", "venv", "ensurepip", "http", "urllib",
    "urllib3", "requests", "ftplib", "smtplib", "telnetlib", "xmlrpc",
    "io", "_io", "tempfile", "glob", "fileinput", "linecache", "shelve",
    "dbm", "sqlite3", "gc", "inspect", "ast", "dis",
    "_posixsubprocess", "_winapi", "msvcrt", "winreg", "resource", "syslog",
    "sysconfig", "site", "zipfile", "tarfile", "lzma", "bz2", "gzip",
    "mmap", "fcntl", "termios", "pwd", "grp", "atexit", "weakref", "_weakref",
    "operator", "_operator", "functools", "_functools", "itertools", "contextlib",
    "logging", "copy", "builtins",
    # stdlib corners that run commands, evaluate code or import by name
    "pydoc", "doctest", "unittest", "idlelib", "lib2to3", "tkinter", "_tkinter",
    "turtle", "turtledemo", "_pyrepl", "_osx_support", "_aix_support", "readline",
    "faulthandler", "_testcapi", "_testinternalcapi", "_testbuffer", "_interpreters",
    "_xxsubinterpreters", "interpreters", "_imp", "_frozen_importlib",
    "_frozen_importlib_external", "_sitebuiltins", "_socket", "_posixshmem",
    "_multiprocessing", "_sqlite3", "_ssl", "_signal", "cmd", "imaplib", "poplib",
    "nntplib", "socketserver", "wsgiref", "compileall", "py_compile", "zipapp",
    "_bootsubprocess", "commands", "httplib", "urllib2",
    # third-party loaders, evaluators and downloaders
    "yaml", "IPython", "jinja2", "keras", "tensorflow", "h5py", "fsspec",
    "huggingface_hub", "transformers.dynamic_module_utils", "pandas.io", "aiohttp",
    "httpx", "paramiko",
    # torch parts that load, compile, run or fetch code and files
    "torch.hub", "torch.jit", "torch.package", "torch.serialization",
    "torch.utils.cpp_extension", "torch.utils.data", "torch.multiprocessing",
    # torch.distributed is judged by use (DCP's .metadata is its dataclasses),
    # but for the parts that launch processes, call remote code or load files
    "torch.distributed.rpc", "torch.distributed.elastic", "torch.distributed.launcher",
    "torch.distributed.launch", "torch.distributed.run", "torch.distributed.rendezvous",
    "torch.distributed.distributed_c10d", "torch.distributed.autograd",
    "torch.distributed.debug", "torch.distributed.flight_recorder",
    "torch.distributed._serialization", "torch.distributed.argparse_util",
    "torch.distributed.logging_handlers", "torch.distributed.c10d_logger",
    "torch._dynamo", "torch._inductor", "torch.fx",
    "torch._C", "torch.ops", "torch._ops", "torch.library", "torch.cuda",
    "torch.backends", "torch.compiler", "torch._export", "torch.export",
    "torch.testing", "torch.utils.collect_env", "torch.utils.model_zoo",
    "torch.utils.benchmark", "torch.utils.tensorboard", "torch.onnx",
    "torch.profiler", "torch.classes", "torch._classes",
    "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.ctypeslib",
)

# the standard library's top-level modules (Python 3.10+; the stdlib's own list)
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"__builtin__", "copy_reg"}

# builtins that merely build data; every other builtin is unsafe
_SAFE_BUILTINS = frozenset({
    "set", "frozenset", "slice", "complex", "bytearray", "bytes", "range",
    "list", "dict", "tuple", "object", "bool", "float", "str", "int",
    "Ellipsis", "NotImplemented",
})

# builtin exceptions and warnings: their constructors store their arguments
_EXCEPTIONS = frozenset(n for n, v in vars(builtins).items()
                        if isinstance(v, type) and issubclass(v, BaseException))

# specific unsafe names outside the modules above
_UNSAFE_NAMES = frozenset({
    "torch.load", "torch.save", "torch.compile", "torch.from_file",
    "torch.storage._load_from_bytes_unsafe", "torch._utils._import_dotted_name",
    "argparse.FileType", "codecs.open", "codecs.EncodedFile", "pandas.read_pickle",
})

# top-level torch names that are modules: a BUILD on one rewrites it in
# the loading process, and the rest of them load or compile code
_TORCH_SUBMODULES = frozenset({
    "serialization", "jit", "hub", "nn", "optim", "utils", "_C", "ops", "cuda",
    "backends", "distributed", "multiprocessing", "fx", "onnx", "package",
    "library", "_dynamo", "_inductor", "compiler", "export", "testing",
    "profiler", "autograd", "functional", "random", "storage", "_utils",
    "_tensor", "classes", "_classes", "_ops", "overrides", "func", "sparse",
    "linalg", "fft", "special", "amp", "ao", "quantization", "mps", "xpu", "mtia",
})

# names checked before any rule below: lowercase or dunder, yet known to
# build plain data
_KNOWN: dict[str, str] = {
    "torch.serialization._get_layout": TORCH,
    "torch.cuda.amp.grad_scaler.GradScaler": TORCH,
    # a jagged nested tensor: its class, its rebuild function (read by
    # ckptool's own), and the dataclass of ints dynamo marks its sizes with
    # (torch.load(weights_only=True) allows the three)
    "torch.nested._internal.nested_tensor.NestedTensor": TORCH,
    "torch.nested._internal.nested_tensor._rebuild_njt": TORCH,
    "torch._dynamo.decorators._DimRange": TORCH,
    # TorchScript's pickler tags lists with these (each returns its argument)
    "torch.jit._pickle.build_intlist": TORCH, "torch.jit._pickle.build_tensorlist": TORCH,
    "torch.jit._pickle.build_doublelist": TORCH, "torch.jit._pickle.build_boollist": TORCH,
    "torch.jit._pickle.restore_type_tag": TORCH,
    "copyreg._reconstructor": DATA, "copyreg.__newobj__": DATA,
    "copyreg.__newobj_ex__": DATA,
    "_codecs.encode": DATA, "codecs.encode": DATA,
    "collections.defaultdict": DATA, "collections.deque": DATA,
    "re._compile": DATA, "re.compile": DATA,
    "datetime.datetime": DATA, "datetime.date": DATA, "datetime.time": DATA,
    "datetime.timedelta": DATA, "datetime.timezone": DATA, "datetime.tzinfo": DATA,
    "random.Random": DATA,  # Random() then setstate: a generator's state
    # Megatron-core's DCP records (dataclasses; since 0.16 empty classes kept
    # so that old checkpoints load): made and given state, nothing else
    "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata": DATA,
    "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan": DATA,
    # ... and what Megatron-core itself lets torch.load(weights_only=True) build
    # (megatron/core/safe_globals.py: SAFE_GLOBALS): the enums and dataclasses
    # of a run's args, made from their values or given their fields
    **{f"megatron.core.{name}": DATA for name in (
        "enums.ModelType", "transformer.enums.AttnBackend",
        "transformer.enums.CudaGraphModule", "transformer.enums.CudaGraphScope",
        "transformer.enums.InferenceCudaGraphScope", "optimizer.optimizer_config.OptimizerConfig",
        "rerun_state_machine.RerunDiagnostic", "rerun_state_machine.RerunMode",
        "rerun_state_machine.RerunState")},
    # what real code pickles from modules that also hold code: each listed as
    # the data it is (its constructor stores its arguments; calls.MODELS says so
    # for the lowercase ones)
    "types.SimpleNamespace": DATA, "array.array": DATA, "array._array_reconstructor": DATA,
    "zoneinfo.ZoneInfo": DATA, "zoneinfo.ZoneInfo._unpickle": DATA,
    "zoneinfo._zoneinfo.ZoneInfo": DATA, "zoneinfo._zoneinfo.ZoneInfo._unpickle": DATA,
    "numpy.memmap": DATA, "numpy._core._internal._convert_to_stringdtype_kwargs": DATA,
    "numpy.core._internal._convert_to_stringdtype_kwargs": DATA,
    "torch._C.Generator": TORCH, "torch.Generator": TORCH,
    # a hook's handle (lazy modules keep one): weak references to dicts
    "torch.utils.hooks.RemovableHandle": TORCH,
    **{f"torch.utils.data.dataset.{n}": TORCH for n in (
        "Dataset", "IterableDataset", "TensorDataset", "StackDataset", "ConcatDataset",
        "ChainDataset", "Subset")},
    **{f"torch.utils.data.sampler.{n}": TORCH for n in (
        "Sampler", "SequentialSampler", "RandomSampler", "SubsetRandomSampler",
        "WeightedRandomSampler", "BatchSampler")},
    "torch.utils.data.dataloader.DataLoader": TORCH,
    "torch.utils.data.distributed.DistributedSampler": TORCH,
    # data classes of the standard library that real code pickles: their
    # constructors and __setstate__ store what they are given
    **{f"ipaddress.{n}": DATA for n in (
        "IPv4Address", "IPv6Address", "IPv4Network", "IPv6Network", "IPv4Interface",
        "IPv6Interface")},
    **{f"urllib.parse.{n}": DATA for n in (
        "ParseResult", "SplitResult", "DefragResult", "ParseResultBytes", "SplitResultBytes",
        "DefragResultBytes")},
    "os.stat_result": DATA, "posix.stat_result": DATA, "time.struct_time": DATA,
    "string.Template": DATA,
    "_io.BytesIO": DATA, "_io.StringIO": DATA, "io.BytesIO": DATA, "io.StringIO": DATA,
    "http.HTTPStatus": DATA, "http.HTTPMethod": DATA, "inspect._ParameterKind": DATA,
    "signal.Signals": DATA, "socket.AddressFamily": DATA, "socket.SocketKind": DATA,
    "logging.getLogger": DATA, "builtins.type": DATA,
    "operator.itemgetter": DATA, "_operator.itemgetter": DATA,
    "operator.attrgetter": DATA, "_operator.attrgetter": DATA,
    "operator.methodcaller": DATA, "_operator.methodcaller": DATA,
    "operator.getitem": DATA, "_operator.getitem": DATA,
    "torch.amp.grad_scaler._refresh_per_optimizer_state": TORCH,
    "torch.cuda.amp.grad_scaler._refresh_per_optimizer_state": TORCH,
}

# these name data types (their classes are kept inert); functions in them
# are unsafe unless listed in _KNOWN
_DATA_MODULES = (
    "collections", "argparse", "pathlib", "datetime", "decimal", "fractions",
    "uuid", "enum", "numbers", "re", "copyreg", "_codecs", "codecs",
    "omegaconf", "dataclasses",
)
_DATA_NAMES = frozenset({
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.fabric.utilities.data.AttributeDict",
})

_TORCH_DATA_PREFIXES = (
    "torch._utils._rebuild_", "torch._tensor._rebuild_from_type",
    "torch.nn.modules.", "torch.nn.parameter.", "torch.optim.",
    "torch.storage.", "torch.amp.", "torch.ao.quantization.",
    # the dataclasses and enums of a torch.distributed.checkpoint .metadata
    "torch.distributed.checkpoint.metadata.", "torch.distributed.checkpoint.planner.",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.tensor.placement_types.", "torch.distributed._shard.metadata.",
    # a DTensor and its spec, as torch.save writes them (torch.load(weights_only=True)
    # allows them once torch.distributed.tensor is imported): data, mesh shapes, ranks
    "torch.distributed.tensor.DTensor", "torch.distributed.tensor._api.DTensor",
    "torch.distributed.tensor._dtensor_spec.", "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout.",
    # FSDP1's ShardedTensor, its shards and their metadata
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor",
    "torch.distributed._shard.sharded_tensor.shard.Shard",
    "torch.distributed.remote_device._remote_device", "torch.distributed._shard.sharding_spec.",
    # activation checkpointing's module wrapper and its enum
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.",
    # DataParallel and DDP wrappers of a module pickled whole
    "torch.nn.parallel.data_parallel.DataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    # what modules hold: activation functions (self.act = F.relu, never called
    # by loading: a call is judged by its use), the version string torch.__version__
    "torch.nn.functional.", "torch.torch_version.TorchVersion", "torch.nn.utils.",
    "torch.distributions.",
    "torch.distributed._shard.sharded_tensor.metadata.",
    # structseq results (torch.max(x, 1)): a tuple of tensors by field name;
    # quantized module classes (torch.ao.nn.quantized...): state, packed params
    "torch.return_types.", "torch.ao.nn.",
)

# numpy: array, scalar, dtype, masked-array and random-state reconstruction
_NUMPY_TYPES = frozenset({
    "ndarray", "dtype", "matrix", "recarray", "record", "generic", "number",
    "bool", "bool_", "byte", "bytes_", "cdouble", "character", "clongdouble",
    "complex128", "complex256", "complex64", "complexfloating", "csingle",
    "datetime64", "double", "flexible", "float128", "float16", "float32",
    "float64", "floating", "half", "inexact", "int16", "int32", "int64", "int8",
    "int_", "intc", "integer", "intp", "long", "longdouble", "longlong",
    "object_", "short", "signedinteger", "single", "str_", "timedelta64",
    "ubyte", "uint", "uint16", "uint32", "uint64", "uint8", "uintc", "uintp",
    "ulong", "ulonglong", "unsignedinteger", "ushort", "void",
    "float_", "complex_", "string_", "unicode_", "bool8", "object0",
})
# numpy modules whose classes are arrays or values (chararray, Polynomial)
_NUMPY_CLASS_MODULES = frozenset({"numpy.char", "numpy._core.defchararray",
                                  "numpy.core.defchararray", "numpy.polynomial"})
_NUMPY_NAMES = frozenset({
    f"{core}.{mod}.{name}"
    for core in ("numpy.core", "numpy._core")
    for mod, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                      ("numeric", "_frombuffer"), ("records", "recarray"),
                      ("records", "record"))
} | {
    "numpy.ma.MaskedArray", "numpy.ma.core.MaskedArray", "numpy.ma.core._mareconstruct",
    "numpy.ma.core.MaskedConstant", "numpy.ma.core.mvoid", "numpy.rec.recarray",
    "numpy.rec.record", "numpy.matrixlib.defmatrix.matrix",
    "numpy.char.chararray", "numpy._core.defchararray.chararray",
    "numpy.core.defchararray.chararray",
    "numpy.random._pickle.__randomstate_ctor", "numpy.random._pickle.__generator_ctor",
    "numpy.random._pickle.__bit_generator_ctor", "numpy.random.__RandomState_ctor",
})


@dataclass(frozen=True)
class Verdict:
    category: str
    reason: str = ""


def under(dotted: str, module: str) -> bool:
    return dotted == module or dotted.startswith(module + ".")


def is_class_name(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def numpy_data(module: str, name: str) -> bool:
    if f"{module}.{name}" in _NUMPY_NAMES:
        return True
    if module == "numpy":
        return name in _NUMPY_TYPES
    if module == "numpy.dtypes" or module in _NUMPY_CLASS_MODULES or module.startswith(
            "numpy.polynomial."):
        return is_class_name(name)
    # RandomState, Generator, MT19937, SeedSequence and Cython's unpicklers
    return module.startswith("numpy.random.") and "." not in name and (
        is_class_name(name) or name.startswith("__pyx_unpickle_"))


# pandas pickles its objects through its own reconstructors (``_new_Index``,
# ``_unpickle_block``, Cython's ``__pyx_unpickle_*``): pandas code run on the
# file's arguments, which ckptool does not model; judged as pandas' classes
# are, custom (docs/safety.md: pandas)
_PANDAS_RECONSTRUCTOR = re.compile(r"\w*(_new_|unpickle|_reconstruct)\w*")
PANDAS_REASON = ("pandas' own unpickling code: loading imports pandas and runs it on the "
                 "file's arguments; ckptool does not model pandas")


def pandas_reconstructor(module: str, name: str) -> bool:
    return under(module, "pandas") and not under(module, "pandas.io") and bool(
        _PANDAS_RECONSTRUCTOR.fullmatch(name))


def classify(module: str, name: str) -> Verdict:
    """Put the global ``module.name`` into one category, with a reason."""
    dotted = f"{module}.{name}"
    if pandas_reconstructor(module, name):
        return Verdict(CUSTOM, PANDAS_REASON)
    if dotted in _UNSAFE_NAMES:
        return Verdict(UNSAFE, "reads, writes or loads files")
    known = _KNOWN.get(dotted)
    if known is not None:
        return Verdict(known)
    if under(module, "numpy") and numpy_data(module, name):
        return Verdict(DATA)
    parts = name.split(".")
    if any(p.startswith("__") and p.endswith("__") for p in parts) or name.startswith("__"):
        return Verdict(UNSAFE, "reaches a dunder attribute")
    if len(parts) > 1 and not all(p[:1].isupper() for p in parts):
        # protocol 4 names may be attribute chains: Outer.Inner is a nested
        # class, anything.lower_name is a method or function reached by getattr
        return Verdict(UNSAFE, "attribute chain to a function")
    if module == "builtins":
        if name in _SAFE_BUILTINS or name in _EXCEPTIONS:
            return Verdict(DATA)
        return Verdict(UNSAFE, "builtin that can run code or reach the system")
    for mod in _UNSAFE_MODULES:
        if under(module, mod):
            return Verdict(UNSAFE, f"member of {mod}")
    if under(module, "numpy"):
        return Verdict(UNSAFE, "numpy function that is not a known array or scalar "
                       "constructor (some load files or import by name)")
    if module == "torch":
        if name in _TORCH_SUBMODULES:
            return Verdict(UNSAFE, "a torch submodule, which a pickle can rewrite")
        return Verdict(TORCH)
    if any(dotted.startswith(p) for p in _TORCH_DATA_PREFIXES):
        return Verdict(TORCH)
    if dotted in _DATA_NAMES:
        return Verdict(DATA)
    for mod in _DATA_MODULES:
        if under(module, mod):
            if is_class_name(name):
                return Verdict(DATA)
            return Verdict(UNSAFE, f"function in {mod} that is not a known data constructor "
                           "(some evaluate strings or run commands)")
    if under(module, "torch"):
        # torch is a known world too: what is not listed above may act
        return Verdict(UNSAFE, "a torch global ckptool does not know to be harmless to make "
                       "or call")
    if module.split(".", 1)[0] in _STDLIB:
        # the standard library is a known world: what ckptool does not list as
        # harmless may act when made (wave.Wave_write, mailbox.Maildir create files)
        return Verdict(UNSAFE, "a standard-library global ckptool does not know to be "
                       "harmless to make or call")
    return Verdict(CUSTOM, "needs its module imported to load with torch")


# top-level torch names that are values or classes, never code: dtypes,
# layouts, memory formats, quantization schemes (``dtypes`` keeps the dtypes)
TORCH_VALUES = frozenset({
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc",
    "_mkldnn", "contiguous_format", "channels_last", "channels_last_3d",
    "preserve_format", "per_tensor_affine", "per_channel_affine",
    "per_tensor_symmetric", "per_channel_symmetric", "per_channel_affine_float_qparams",
})
