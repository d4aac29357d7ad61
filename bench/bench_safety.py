"""What the safety model costs a read, as ratios against torch.load.

Run with the project's interpreter from the repository root::

    .venv/bin/python bench/bench_safety.py [--layers N] [--runs N]

A whole pickled model (``N`` ``TransformerEncoderLayer``s, an optimizer
beside it: what the pure-Python unpickler reads, every REDUCE and BUILD
modelled by ``ckptool/read/pickle``) and its state dict (the fast path) are
written under a temporary folder; each is read in this process, alternately,
by ``torch.load(weights_only=False)`` (the C unpickler building real tensors:
the baseline) and by ``ckptool.open``. Printed: the fastest time of each and
their ratio.

Target: ``ckptool.open`` of the whole model at most 3.5x ``torch.load`` of
it (the pure-Python unpickler, every call modelled, and the model's
bookkeeping, against C that builds real tensors); of the state dict (the C
unpickler's fast path) at most 1.5x. Exit 0 when both hold, 1 otherwise.
ckptool runs as installed (``make`` reinstalls it when the source changes).
A benchmark, not a unit test: no absolute time is asserted.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import ckptool

TARGETS = {"whole model": 3.5, "state dict": 1.5}


def fastest(fn: Callable[[], object], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        gc.collect()  # the other side's garbage (a whole model's cycles) is not ours to pay
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptool-bench-safety-"))
    model = nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 128) for _ in range(args.layers)])
    files = {"whole model": work / "whole.pt", "state dict": work / "sd.pt"}
    torch.save({"model": model, "optimizer": torch.optim.Adam(model.parameters()).state_dict()},
               files["whole model"])
    torch.save(model.state_dict(), files["state dict"])
    ok = True
    for name, path in files.items():
        base = fastest(lambda p=path: torch.load(p, weights_only=False), args.runs)
        ours = fastest(lambda p=path: ckptool.open(p), args.runs)
        ratio = ours / base
        passed = ratio <= TARGETS[name]
        ok &= passed
        print(f"{name:12} torch.load {base * 1000:7.1f} ms   ckptool.open {ours * 1000:7.1f} ms"
              f"   ratio {ratio:4.2f} (target <= {TARGETS[name]})  {'ok' if passed else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
