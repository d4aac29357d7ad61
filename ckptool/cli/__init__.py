"""The ``ckptool`` command line: the outermost layer, arguments in and output out.

One module per command (``inspect.py``, ``diagnose.py``...) holds its click
command and its ``--json`` report; its human output (rich) sits beside it in
``<command>_text.py``, imported only when text is printed, so JSON output
never pays for rich. ``main.py`` is the group and the one place where
errors become ``ckptool: error:`` lines and exit codes; ``common.py`` holds
what several commands share (options, progress bars, the JSON writer).
A new command is a new module listed in ``main.COMMANDS``.
"""

from ckptool.cli.main import cli, entry, main

__all__ = ["cli", "entry", "main"]
