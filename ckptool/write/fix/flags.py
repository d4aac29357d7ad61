"""The ``ckptool fix`` flags that ask for a ``FixOptions``: the one way a
fix is written back as a command line (diagnose's printed command, the
journal's record of an in-place fix)."""

from __future__ import annotations

from ckptool.describe import shell_quote
from ckptool.write.fix.plan import DTYPE_NAMES, FixOptions

# the short flag of each dtype (bfloat16 -> bf16): the first name DTYPE_NAMES gives it
_DTYPE_FLAGS = {full: short for short, full in reversed(DTYPE_NAMES.items())}


def flags(opts: FixOptions) -> list[str]:
    """``opts`` as ``ckptool fix`` flags, each value quoted for a shell."""
    words = ["--extract"] if opts.extract is not None else []
    words += ["--strip-module"] if opts.strip_module else []
    words += [f"--strip-prefix {shell_quote(p)}" for p in opts.strip_prefixes]
    if opts.add_prefix:
        words.append(f"--add-prefix {shell_quote(opts.add_prefix)}")
    words += [f"--rename {shell_quote(f'{a}={b}')}" for a, b in opts.renames]
    words += [f"--drop {shell_quote(d)}" for d in opts.drop]
    if opts.dtype:
        words.append(f"--dtype {_DTYPE_FLAGS.get(opts.dtype, opts.dtype)}")
    words += [f"--to {opts.to}"] if opts.to else []
    words += [f"--map {a}={b}" for a, b in opts.maps]
    words += ["--salvage"] if opts.salvage else []
    return words
