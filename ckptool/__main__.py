"""``python -m ckptool``."""

from ckptool.cli import entry

entry()
