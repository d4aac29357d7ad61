"""The Textual browser (``ckptool browse``): a view over the core that owns
no parsing. It reads a checkpoint with ``ckptool.read`` on a worker thread,
diagnoses it with ``ckptool.check`` and writes fixes with ``ckptool.write``.

``index``, ``rows`` and ``view`` are its view model (the rows of the tensor
list, filters, sorts: no Textual); ``app`` and the modules beside it render
them. Importing this package imports no Textual; ``make_app`` does.
May import every layer below it; never ``ckptool.cli``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptool.tui.app import BrowseApp


def make_app(path: str | os.PathLike[str], **kwargs: Any) -> BrowseApp:
    from ckptool.tui.app import make_app as make

    return make(path, **kwargs)
