"""A TorchScript archive's code: what ``torch.jit.load`` runs while it loads.

A TorchScript archive carries its program as source (``code/__torch__/*.py``,
a subset of Python), compiled by ``torch.jit.load`` (and by ``torch.load``,
which hands TorchScript archives to it). Loading calls the ``__setstate__``
of every module and script class that defines one, with the state the
pickle holds: code outside any pickle, which no name table sees.

``judge`` parses each code record with ``ast`` (parsing runs nothing), finds
every ``__setstate__``, follows what it calls through the archive's own
methods and functions (``self.m()``, ``__torch__.f()``, a function held in a
local name), and judges every other call against small lists of what is
pure: tensor ops (``torch.add``, ``ops.aten.copy_``), the interpreter's
``ops.prim`` primitives, quantized packers, TorchScript's builtins and
tensor, list and dict methods. Anything else (``torch.from_file``,
``torch.ops.<library>.*``, ``torch.classes``, a method ckptool does not
know) is a finding: which method calls which op. A record that does not
parse is a finding too: unknown fails closed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from ckptool.read.pickle.calls import PURE_OPS

MAX_CODE = 16 << 20  # one code record; larger is refused as unknown
MAX_NODES = 2_000_000  # what one archive's code may hold, all records together

# ops of other namespaces that only pack or unpack quantized weights
PURE_NAMESPACED = frozenset(
    f"quantized.{kind}_{what}" for kind in (
        "linear", "linear_fp16", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
        "conv_transpose2d", "conv_transpose3d", "embedding_bag")
    for what in ("prepack", "unpack")) | frozenset({
        "quantized.linear_unpack_fp16", "quantized.linear_prepack_fp16"})
# TorchScript's builtins and the interpreter's own forms
PURE_BUILTINS = frozenset([
    "len", "int", "float", "bool", "str", "range", "isinstance", "annotate", "unchecked_cast",
    "uninitialized", "hasattr", "getattr", "print", "min", "max", "abs", "round", "list",
    "dict", "tuple", "enumerate", "zip", "sorted", "divmod", "ord", "chr",
])


@dataclass(frozen=True)
class Finding:
    method: str  # __torch__.Evil.__setstate__
    op: str  # torch.from_file
    record: str  # the code record the call is in

    @property
    def reason(self) -> str:
        return (f"called by {self.method} ({self.record}), which torch.jit.load and "
                "torch.load run while they load the archive: not a pure tensor op "
                "ckptool knows (files, processes, the network and torch.ops libraries "
                "are outside that list)")


@dataclass
class _Def:
    qualname: str  # __torch__.a.b.Class.method or __torch__.a.b.func
    node: ast.FunctionDef
    record: str


class _Program:
    """Every class method and function of the archive's code, by name."""

    def __init__(self) -> None:
        self.by_qualname: dict[str, _Def] = {}
        self.methods: dict[str, list[_Def]] = {}  # by bare method name
        self.setstates: list[_Def] = []
        self.unreadable: list[Finding] = []

    def add(self, record: str, module: str, source: bytes) -> None:
        if len(source) > MAX_CODE:
            self.unreadable.append(Finding(module, "<a code record too large to read>", record))
            return
        try:
            tree = ast.parse(source.decode("utf-8"), record)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError):
            self.unreadable.append(Finding(module, "<code ckptool cannot parse>", record))
            return
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        d = _Def(f"{module}.{node.name}.{item.name}", item, record)
                        self.by_qualname[d.qualname] = d
                        self.methods.setdefault(item.name, []).append(d)
                        if item.name == "__setstate__":
                            self.setstates.append(d)
            elif isinstance(node, ast.FunctionDef):
                d = _Def(f"{module}.{node.name}", node, record)
                self.by_qualname[d.qualname] = d
                self.methods.setdefault(node.name, []).append(d)


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _aliases(fn: ast.FunctionDef) -> dict[str, str | None]:
    """Every local name of ``fn`` (its parameters, and every name any
    statement binds: chained, annotated, augmented, loop and ``with``
    targets): the dotted callable it is bound to (``_0 = __torch__.f``,
    ``a = b = torch.from_file``), or None where it is bound to anything
    else. A call through a local name is judged by what the name holds,
    never as the builtin or method it shadows."""
    found: dict[str, str | None] = {}
    arguments = fn.args
    for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                *([arguments.vararg] if arguments.vararg else []),
                *([arguments.kwarg] if arguments.kwarg else [])]:
        found[arg.arg] = None
    for node in ast.walk(fn):
        value: ast.expr | None = None
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            targets, value = [node.target], node.value
        dotted = _dotted(value) if isinstance(value, ast.Attribute) else None
        if dotted is not None and dotted.split(".", 1)[0] not in ("torch", "ops", "__torch__"):
            dotted = None
        for target in targets:
            if isinstance(target, ast.Name):
                # bound twice to different things: unknown
                known = found.get(target.id, dotted)
                found[target.id] = dotted if known == dotted else None
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) \
                and node.id not in found:
            found[node.id] = None  # a loop, with or augmented target, a tuple's part
    return found


def _judge_call(prog: _Program, call: ast.Call, aliases: dict[str, str | None]) -> tuple[
        str | None, list[_Def]]:
    """(an op that is not pure, or None; the archive's definitions it runs)."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in aliases:  # a local name: judged by what it was bound to
            bound = aliases[func.id]
            return (f"<a call through the local name {func.id}>", []) if bound is None \
                else _judge_dotted(prog, bound)
        name = func.id
        if "." not in name:
            if name in PURE_BUILTINS or name in PURE_OPS:
                return None, []
            return (name, []) if name not in prog.methods else (None, prog.methods[name])
        return _judge_dotted(prog, name)
    dotted = _dotted(func)
    root = dotted.split(".", 1)[0] if dotted is not None else None
    if dotted is not None and root in ("torch", "ops", "__torch__") and root not in aliases:
        return _judge_dotted(prog, dotted)
    if dotted is not None and root is not None and aliases.get(root) is not None:
        # a local bound to a torch path (m = torch.ops.mylib; m.append(x))
        return _judge_dotted(prog, f"{aliases[root]}{dotted[len(root):]}")
    if isinstance(func, ast.Attribute):  # a method of a value: self.m(), x.copy_()
        if func.attr in prog.methods:
            return None, prog.methods[func.attr]
        base = func.value
        simple = (isinstance(base, ast.Name) and base.id in aliases) or isinstance(
            base, (ast.Subscript, ast.Call)) or (dotted is not None and root == "self")
        if func.attr in PURE_OPS and simple:
            return None, []
        return f"<value>.{func.attr}", []
    return "<a call ckptool cannot name>", []


def _judge_dotted(prog: _Program, name: str) -> tuple[str | None, list[_Def]]:
    head, _, rest = name.partition(".")
    if head == "__torch__":
        found = prog.by_qualname.get(name) or prog.by_qualname.get(f"{name}.__init__")
        return (None, [found]) if found is not None else (None, [])
    if head == "torch":
        if rest.startswith("ops."):
            head, rest = "ops", rest[4:]
        elif "." not in rest and rest in PURE_OPS:
            return None, []
        else:
            return name, []
    # ops.<namespace>.<op>
    namespace, _, op = rest.partition(".")
    if namespace == "prim" or (namespace == "aten" and op in PURE_OPS):
        return None, []
    if f"{namespace}.{op}" in PURE_NAMESPACED:
        return None, []
    return f"torch.ops.{rest}", []


def judge(records: dict[str, bytes]) -> Iterator[Finding]:
    """What the ``__setstate__`` methods of an archive's code call that is
    not pure: ``records`` maps each code record's name (``x/code/__torch__/
    a/b.py``) to its bytes."""
    prog = _Program()
    for record, source in sorted(records.items()):
        tail = record.split("/code/", 1)[-1]
        module = tail.removesuffix(".py").replace("/", ".")
        prog.add(record, module, source)
    yield from prog.unreadable
    # operators and builtins call dunder methods (len(x) is x.__len__(), a + b
    # is a.__add__(b)) without a call naming them: each is taken as reached
    implicit = [d for name, defs in prog.methods.items() if name.startswith("__")
                and name.endswith("__") and name not in ("__getstate__", "__setstate__")
                for d in defs]
    nodes = 0
    for root in prog.setstates:
        todo = [root, *implicit]
        done, reported = {id(d.node) for d in todo}, set()
        while todo:
            current = todo.pop()
            aliases = _aliases(current.node)
            for node in ast.walk(current.node):
                nodes += 1
                if nodes > MAX_NODES:
                    yield Finding(root.qualname, "<more code than ckptool reads>", root.record)
                    return
                if not isinstance(node, ast.Call):
                    continue
                bad, runs = _judge_call(prog, node, aliases)
                if bad is not None and bad not in reported:
                    reported.add(bad)
                    yield Finding(current.qualname if current is root else
                                  f"{root.qualname} (through {current.qualname})", bad,
                                  current.record)
                for d in runs:
                    if id(d.node) not in done:
                        done.add(id(d.node))
                        todo.append(d)
