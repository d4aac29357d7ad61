"""Shared wording: sizes, counts and shapes as every view prints them.

``human_bytes(2_700)`` -> ``2.7 kB``, ``human_count(1_234_567)`` -> ``1.2M``,
``shape_text((3, 4))`` -> ``3x4``, ``plural(1, "tensor")`` -> ``1 tensor``.
Pure functions of numbers, so the core, the CLI and the browser say the
same thing the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ckptool.model import Framework, StateDictInfo, TensorInfo


def shape_text(shape: Iterable[int]) -> str:
    """``(3, 4)`` -> ``3x4``; ``()`` -> ``scalar``."""
    return "x".join(str(s) for s in shape) or "scalar"


def tensor_shape(t: TensorInfo) -> str:
    """A tensor's shape as the views print it: ``3x4``, and for a sparse
    tensor its dense shape with its layout and stored values,
    ``1000x1000 coo, 12 nnz``."""
    if not t.parts:
        return shape_text(t.shape)
    kind = t.layout.removeprefix("sparse_")
    nnz = f", {t.nnz} nnz" if t.nnz is not None else ""
    return f"{shape_text(t.shape)} {kind}{nnz}"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def human_count(n: int) -> str:
    """``1234567`` -> ``1.2M``: parameter counts."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def parameters_text(sd: StateDictInfo, short: bool = False) -> str:
    """``472 (+12 in buffers)``, short ``472 params +12 buffers``: what
    ``model.parameters()`` would count, buffers apart (``ckptool.read.params``
    says how they are told)."""
    params, buffers = human_count(sd.num_parameters), human_count(sd.num_buffers)
    if short:
        return f"{params} params" + (f" +{buffers} buffers" if sd.num_buffers else "")
    return params + (f" (+{buffers} in buffers)" if sd.num_buffers else "")


def beside(path: str, ext: str) -> str:
    """A file name beside the checkpoint directory ``path``: ``run/ckpt`` ->
    ``run/ckpt.pt``, Lightning's ``x.ckpt/`` -> ``x.pt``; from the absolute
    path where ``path`` is ``.`` (never a hidden file inside it); in the
    current directory for a URL (``s3://b/run/ckpt`` -> ``ckpt.pt``)."""
    if "://" in path:
        path = path.rstrip("/").rsplit("/", 1)[-1]
    base = os.path.normpath(path)
    if os.path.basename(base) in (".", "..", ""):
        base = os.path.abspath(base)
    return (base[:-len(".ckpt")] if base.endswith(".ckpt") else base) + ext


def shell_word(path: str) -> str:
    """``path`` as a shell word that no command takes for an option, for the
    commands and hints ckptool prints (the one quoting of a path they use)."""
    return shell_quote(f"./{path}" if path.startswith("-") else path)


def shell_quote(text: str) -> str:
    """``text`` as one shell word that pastes back as the same bytes:
    ``shlex.quote`` for printable text; otherwise bash's ``$'...'`` with
    ``\\xHH`` escapes for each byte of what is not printable (a file name
    that is not UTF-8 arrives as ``\\udcff``-style surrogates: each is the
    byte it stands for; control codes are escaped, never sent raw to the
    terminal)."""
    import shlex

    if text.isprintable():
        return shlex.quote(text)
    out = []
    for c in text:
        if c in "\\'":
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.extend(f"\\x{b:02x}" for b in _raw_bytes(c))
    return "$'" + "".join(out) + "'"


def _raw_bytes(c: str) -> bytes:
    """The bytes a character of a name stands for: a surrogate that
    ``os.fsdecode`` made of an undecodable byte is that byte."""
    try:
        return c.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate from elsewhere than a file name
        return c.encode("utf-8", "surrogatepass")


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``0 tensors``, ``1,024 tensors``; ``many``
    for irregular nouns (``1 entry``, ``2 entries``)."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


def shown(text: str) -> str:
    """``text`` as a terminal shows it faithfully: every character that is not
    printable (control codes such as ESC, which a terminal would obey;
    bidirectional overrides and zero-width characters, which hide what a name
    is; line breaks) written as its escape, ``\\x1b``, ``\\u202e``, ``\\n``.
    A key, file name or global name from a file is data, never instructions
    to the terminal. Ordinary text comes back as it is (one C-level check)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a name that is not UTF-8 (os.fsdecode)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, f"\\x{code:02x}")
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def framework_line(fw: Framework) -> str:
    """``a transformers Trainer checkpoint (checkpoint-2/) · LlamaForCausalLM
    (llama) · tied input and output embeddings``."""
    said = [fw.description]
    if fw.model_class or fw.model_type:
        kind = f" ({fw.model_type})" if fw.model_class and fw.model_type else ""
        said.append(f"{fw.model_class or fw.model_type}{kind}")
    if fw.tie_word_embeddings:
        said.append("tied input and output embeddings")
    return " · ".join(said)


def own_prefix_text(fw: Framework) -> str:
    """Why a prefix is no wrapper: ``'model.' is LlamaForCausalLM's own
    naming, config.json``."""
    whose = "PEFT's" if fw.kind == "peft" else f"{fw.model_class or fw.model_type}'s"
    return f"'{fw.own_prefix}' is {whose} own naming, {fw.evidence}"
