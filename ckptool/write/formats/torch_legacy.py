"""The layout of a rewritten legacy torch file (``torch.save`` before 1.6).

The magic number, protocol version and ``sys_info`` pickles are copied as
they are; then the new pickle, the storage keys sorted as strings (as torch
writes them), and for each storage its element count (int64) and its bytes,
copied, or cast by ``--dtype``.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

from ckptool import dtypes
from ckptool.errors import UnsupportedCheckpointError
from ckptool.read.tensor_data import TensorData
from ckptool.write import repickle
from ckptool.write.fix.plan import Plan, new_pid
from ckptool.write.layout import Data, Layout, Made, Segment, checked_cast, input_segment
from ckptool.write.verify import Placed


def lay_out(plan: Plan, fd: int, header_end: int, reader: TensorData) -> tuple[Layout, Placed]:
    """The output of ``plan``, from the input file ``fd`` whose header
    pickles end at ``header_end``; and where each storage's bytes land."""
    used = plan.storages
    if any((r.pid or (None,) * 6)[5] is not None for r in used.values()):
        raise UnsupportedCheckpointError("storage views of torch < 0.4 files cannot be rewritten",
                                         "load and re-save the file with an older torch")
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    keys = sorted(used)  # torch writes the storage keys sorted, as strings
    layout = Layout([input_segment(fd, 0, 0, header_end, "the header pickles")])
    pos = header_end
    for data, name in ((pickled, "the pickle"),
                       (repickle.dumps(keys, lambda ref: ()), "the storage keys")):
        layout.add(Data(pos, data, name))
        pos += len(data)
    placed: Placed = {}
    for key in keys:
        ref = used[key]
        layout.add(Data(pos, struct.pack("<q", ref.numel), f"storage {key}'s size"))
        pos += 8
        segment: Segment
        if key in plan.casts:
            src, dst = plan.casts[key]
            segment = Made(pos, ref.numel * dtypes.itemsize(dst), f"storage {key}",
                           functools.partial(checked_cast, reader, key, src, dst))
        else:
            segment = input_segment(reader.source(), pos, reader.storage_offset(key),
                                    ref.nbytes, f"storage {key}")
        layout.add(segment)
        placed[key] = (pos, segment.size)
        pos += segment.size
    return layout, placed
