"""The Textual browser (``ckptool browse``). Importing this package imports
no Textual; ``make_app`` does."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptool.tui.app import BrowseApp


def make_app(path: str | os.PathLike[str], **kwargs: Any) -> BrowseApp:
    from ckptool.tui.app import make_app as make

    return make(path, **kwargs)
