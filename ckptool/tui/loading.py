"""Reading a checkpoint into the browser: the read on a worker thread, its
tensors shown in batches as they arrive, then the diagnosis.

While the pickle is read, tensors arrive in batches
(``open_checkpoint(on_tensors=)``) and are listed as they come; when the
read ends, the full ``Checkpoint`` replaces them and a second worker
diagnoses it (``ckptool.check.diagnosis``). ``LoadingApp`` is the base of
the browser's app, which draws what this keeps.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

from textual import work
from textual.app import App
from textual.widgets import Static

from ckptool.check.diagnosis import Diagnosis
from ckptool.check.gpus.machine import Machine
from ckptool.check.modelspec import ModelKeys
from ckptool.errors import CkptoolError, InputError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.tui import panes
from ckptool.tui.findings import findings
from ckptool.tui.index import Index
from ckptool.tui.view import ViewState

ModelLoader = Callable[[Checkpoint], ModelKeys | None]


class LoadingApp(App[int]):
    """Reads ``path`` once mounted; ``return_code`` is 0, or the exit code of
    the error that stopped the read (kept in ``error``)."""

    def __init__(self, path: str, *, machine: Machine | None = None,
                 model: ModelLoader | None = None) -> None:
        super().__init__()
        self.path = path
        self.machine = machine  # None: probe this machine (nvidia-smi), on a worker
        self.model_loader = model
        self.ckpt: Checkpoint | None = None
        self.index = Index()
        self.diagnosis: Diagnosis | None = None
        self.findings_error: str | None = None
        self.error: CkptoolError | None = None
        self.view = ViewState()
        self._partial: list[list[TensorInfo]] = []  # batches from the reading thread
        self._taken = 0
        self._opened_defaults = False
        self.loaded = threading.Event()  # set once the full read is shown

    # drawn by the app
    def _refresh_rows(self, keep: str | None = None) -> None:
        raise NotImplementedError

    def _status(self) -> None:
        raise NotImplementedError

    def _show_detail(self) -> None:
        raise NotImplementedError

    def start_loading(self) -> None:
        """Start the read (once the screen it fills is mounted)."""
        self._drain_timer = self.set_interval(0.1, self._drain)
        self._load()

    @work(thread=True, exclusive=True, group="load")
    def _load(self) -> None:
        from ckptool.read.reader import open_checkpoint

        try:
            ckpt = open_checkpoint(self.path, on_tensors=self._partial.append)
        except CkptoolError as exc:
            self.call_from_thread(self._failed, exc)
            return
        except OSError as exc:  # the system refused a read midway
            self.call_from_thread(self._failed, InputError(
                f"{self.path}: {exc.strerror or exc}", "check the file and try again"))
            return
        # the batches were a preview; when they hold exactly the final keys
        # (the usual case) the tree built from them stays, else it is rebuilt;
        # so it is when the file holds an optimizer's state, known only now:
        # its moments are counted apart, not as parameters
        from ckptool.read.optim import holder

        sent = [t.key for batch in self._partial for t in batch]
        same = sent == [t.key for t in ckpt.tensors]
        optimizer = holder(ckpt)
        index = None if same and optimizer is None else Index(ckpt.tensors, optimizer)
        self.call_from_thread(self._loaded, ckpt, index)
        # made before they are asked for: the one slow sort (natural order of
        # names), and what a filter keystroke in the tree needs
        ready = self.index
        ready.sorted_tensors("name")
        ready.sorted_tensors("file")  # the keys a filter tests
        ready.layout("file")
        ready.lookup("")
        # they live as long as the app, as the checkpoint does (``_loaded``):
        # out of the collector's way too. Its full passes visit every
        # reference of every container they see, and these hold 100,000s
        # (a pass cost 40-80 ms, in the middle of a keystroke)
        gc.freeze()

    def _drain(self) -> None:
        """Show the batches the reader has passed on so far."""
        if self.ckpt is not None:
            return
        batches = self._partial[self._taken:]
        if not batches:
            return
        self._taken += len(batches)
        for batch in batches:
            self.index.extend(batch)
        first = not self._opened_defaults
        self._open_defaults()
        self.query_one("#summary", Static).update(
            panes.summary_loading(self.path, len(self.index)))
        self._refresh_rows()
        if first:  # the screen is full: later batches can come in bigger steps,
            # which leaves the reading thread more of the interpreter
            self._drain_timer.stop()
            self._drain_timer = self.set_interval(0.5, self._drain)

    def _open_defaults(self) -> None:
        if not self._opened_defaults and len(self.index):
            self._opened_defaults = True
            self.view.expanded = self.index.default_expanded(max(20, self.size.height - 8))

    def _loaded(self, ckpt: Checkpoint, index: Index | None) -> None:
        self._drain()
        self._drain_timer.stop()
        self.ckpt = ckpt
        if index is not None:
            self.index = index
        self._open_defaults()
        self.query_one("#summary", Static).update(panes.summary(ckpt))
        self._refresh_rows()
        self._show_detail()  # the same row may now say more (the whole file is read)
        self.loaded.set()
        # the index and checkpoint live as long as the app: keep the cyclic
        # collector from walking their million objects again and again (a
        # full collection mid-keystroke cost 300+ ms on 100,000 tensors)
        gc.freeze()
        self._diagnose(ckpt)

    def _failed(self, exc: CkptoolError) -> None:
        self.error = exc
        self.exit(exc.exit_code, return_code=exc.exit_code)

    @work(thread=True, exclusive=True, group="diagnose")
    def _diagnose(self, ckpt: Checkpoint) -> None:
        from ckptool.check.diagnosis import diagnose
        from ckptool.check.gpus.machine import probe

        try:
            machine = self.machine or probe()
            model = self.model_loader(ckpt) if self.model_loader else None
            result = diagnose(ckpt, machine, model)
        except CkptoolError as exc:
            hint = f"\nhint: {exc.hint}" if exc.hint else ""
            self.call_from_thread(self._diagnosed, None, f"{exc.message}{hint}")
            return
        except OSError as exc:  # the file went away since it was read
            self.call_from_thread(self._diagnosed, None,
                                  f"cannot diagnose: {exc.strerror or exc}")
            return
        self.call_from_thread(self._diagnosed, result, None)

    def _diagnosed(self, result: Diagnosis | None, error: str | None) -> None:
        self.diagnosis, self.findings_error = result, error
        self.query_one("#findings", Static).update(findings(result, error))
        box = self.query_one("#findings-box")
        box.border_title = (f"findings ({len(result.findings)})" if result is not None
                            else "findings")
        self._status()
        self._show_detail()

