"""Which globals a pickle may name, and what naming them means.

Every ``GLOBAL``/``STACK_GLOBAL`` in a checkpoint is put in one category:

- ``torch``: tensor and storage reconstruction (``torch._utils._rebuild_*``,
  storage classes, dtypes, devices, ``torch.nn`` module classes). Read by
  ckptool's own rebuild functions.
- ``data``: known, inert data types (``collections.OrderedDict``,
  ``argparse.Namespace``, numpy arrays, pathlib, omegaconf...).
- ``unsafe``: a callable that can run code, touch files, processes or the
  network, or reach such a thing (``os.system``, ``builtins.eval``,
  ``builtins.getattr``, ``functools.partial``, ``runpy``...). ``torch.load``
  with ``weights_only=False`` would call it.
- ``custom``: anything else (user classes such as ``mypkg.nets.ResNet``).
  Loading it with torch imports that module; ckptool only shows its state.

Nothing here imports or calls anything: it is a table lookup on names.
"""

from __future__ import annotations

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
    "dbm", "sqlite3", "gc", "inspect", "ast", "dis", "builtins.__dict__",
    "_posixsubprocess", "_winapi", "msvcrt", "winreg", "resource", "syslog",
    "sysconfig", "site", "zipfile", "tarfile", "lzma", "bz2", "gzip",
    "mmap", "fcntl", "termios", "pwd", "grp", "atexit", "weakref", "_weakref",
    "operator", "functools", "itertools", "contextlib", "logging",
    "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.ctypeslib",
    "numpy.lib.npyio", "numpy.lib.format", "torch.hub", "torch.jit",
    "torch.package", "torch.serialization", "torch.utils.cpp_extension",
    "torch.utils.data", "torch.distributed", "torch.multiprocessing",
    "torch._dynamo", "torch._inductor", "torch.fx", "torch._C",
    "torch.ops", "torch._ops", "torch.library", "torch.cuda", "torch.backends",
    "torch.compiler", "torch._export", "torch.export",
)

# builtins that merely build data; every other builtin is unsafe
_SAFE_BUILTINS = frozenset({
    "set", "frozenset", "slice", "complex", "bytearray", "bytes", "range",
    "list", "dict", "tuple", "object", "bool", "float", "str", "int",
    "Ellipsis", "NotImplemented",
})

# specific unsafe names outside the modules above
_UNSAFE_NAMES = frozenset({
    "torch.load", "torch.save", "torch.compile", "torch.from_file",
    "torch.storage._load_from_bytes_unsafe",
    "numpy.load", "numpy.loadtxt", "numpy.genfromtxt", "numpy.fromfile",
    "numpy.save", "numpy.savez", "numpy.savetxt", "numpy.memmap",
    "numpy.tofile", "copyreg.add_extension", "copyreg.pickle",
    "copyreg.constructor", "codecs.open", "_codecs.lookup", "codecs.lookup",
})

# these name data types (kept inert); anything else goes to "custom"
_DATA_MODULES = (
    "collections", "argparse", "pathlib", "datetime", "decimal", "fractions",
    "uuid", "enum", "numbers", "re", "copyreg", "_codecs", "codecs",
    "numpy", "omegaconf", "typing", "dataclasses", "__builtin__", "builtins",
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
    "torch.storage.", "torch.serialization._get_layout", "torch.amp.",
    "torch.cuda.amp.grad_scaler.GradScaler", "torch.ao.quantization.",
)


@dataclass(frozen=True)
class Verdict:
    category: str
    reason: str = ""


def _under(dotted: str, module: str) -> bool:
    return dotted == module or dotted.startswith(module + ".")


def classify(module: str, name: str) -> Verdict:
    """Put the global ``module.name`` into one category, with a reason."""
    dotted = f"{module}.{name}"
    parts = name.split(".")
    if any(p.startswith("__") and p.endswith("__") for p in parts) or name.startswith("__"):
        return Verdict(UNSAFE, "reaches a dunder attribute")
    if len(parts) > 1 and not all(p[:1].isupper() for p in parts):
        # protocol 4 names may be attribute chains: Outer.Inner is a nested
        # class, anything.lower_name is a method or function reached by getattr
        return Verdict(UNSAFE, "attribute chain to a function")
    if dotted in _UNSAFE_NAMES:
        return Verdict(UNSAFE, "reads, writes or loads files")
    if module == "builtins":
        if name in _SAFE_BUILTINS:
            return Verdict(DATA)
        return Verdict(UNSAFE, "builtin that can run code or reach the system")
    for mod in _UNSAFE_MODULES:
        if _under(module, mod):
            return Verdict(UNSAFE, f"member of {mod}")
    if module == "torch" or any(dotted.startswith(p) for p in _TORCH_DATA_PREFIXES):
        return Verdict(TORCH)
    if dotted in _DATA_NAMES or any(_under(module, m) for m in _DATA_MODULES):
        return Verdict(DATA)
    return Verdict(CUSTOM, "needs its module imported to load with torch")
