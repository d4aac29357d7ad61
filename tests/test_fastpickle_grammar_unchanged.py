"""The fast path's grammar (``fastpickle.grammar``, a safety boundary:
``docs/safety.md``) matches exactly what it matched as first written, though
it is now built to compile faster: the builder as it was is kept here, and
both run over the pickles of every fixture and sample, of ``torch.save``
outputs of varied state dicts and of the safety corpus, and over thousands
of random mutations of them, with the same match end asserted each time.
"""

from __future__ import annotations

import io
import random
import re
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.read import fastpickle
from tests.test_malicious import PAYLOADS, benign_object, in_zip, legacy
from tests.test_safety_corpus import CONTAINERS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# -- the grammar as first written (ckptool 2026-12, before it was made to compile fast)

def _counted(width: int, longest: int) -> bytes:
    pad = b"\x00" * (width - 1)
    return b"(?:" + b"|".join(
        re.escape(bytes([n]) + pad) + (b"[\x00-\xff]{%d}" % n if n else b"")
        for n in range(longest)) + b")"


def _below(bits: int) -> bytes:
    full, rest = divmod(bits, 8)
    top = b"[\x00-" + re.escape(bytes([(1 << rest) - 1])) + b"]" if rest else b""
    zeros = b"\x00" * (4 - full - (1 if rest else 0))
    return b"[\x00-\xff]" * full + top + re.escape(zeros)


@cache
def first_grammar(memo_bits: int) -> re.Pattern[bytes]:
    b = b"[\x00-\xff]"
    put = b"(?:q" + b + b"|r" + _below(memo_bits) + b")?"
    get = b"(?:h" + b + b"|j" + b + b"{4})"
    integer = b"(?:K" + b + b"|M" + b + b"{2}|J" + b + b"{4}|\x8a" + _counted(1, 10) + b")"
    number = b"(?:" + integer + put + b"|G" + b + b"{8}" + put + b"|[\x88\x89N])"
    numbers = (b"(?:" + number + b"(?:\x85" + put + b"|" + number + b"(?:\x86" + put + b"|"
               + number + b"\x87" + put + b")?)?)")
    flat = (b"(?:\\)|" + number + b"\x85|" + number * 2 + b"\x86|" + number * 3 + b"\x87"
            b"|\\(" + number + b"*t)" + put)
    string = b"X" + _counted(4, 256) + put
    short = b"X" + _counted(4, 64) + put
    glob = b"c[^\n]*\n[^\n]*\n" + put
    callee = b"(?:" + get + b"|" + glob + b")"
    text = b"(?:" + get + b"|" + short + b")"
    storage_id = (b"\\(" + text + b"(?:" + get + b"|" + glob + b")" + text + text + integer
                  + b"t" + put + b"Q")
    hooks = callee + b"\\)R" + put
    tensor = (callee + b"\\(" + storage_id + integer + flat + flat + b"[\x88\x89]" + hooks
              + b"t" + put + b"R" + put)
    parameter = callee + tensor + b"[\x88\x89]" + hooks + b"\x87" + put + b"R" + put
    single = b"[(\\]}ldaesu01RQb]|\x80" + b + b"|\x95" + b + b"{8}"
    tokens = (parameter, tensor, b"\\(" + number + b"*t" + put, b"\\)" + put, numbers,
              string, put[:-1], get, glob, single)
    return re.compile(b"(?:" + b"|".join(tokens) + b")*+")


# -- the pickles

def _pickles(blob: bytes) -> Iterator[bytes]:
    """``blob``, and each member of it if it is a zip."""
    yield blob
    if blob[:2] == b"PK":
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                for name in z.namelist():
                    if name.endswith(".pkl") or "/" not in name:
                        yield z.read(name)
        except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
            pass


def _saved(obj: Any, tmp: Path, **save: Any) -> bytes:
    path = tmp / "x.pt"
    torch.save(obj, path, **save)
    return path.read_bytes()


def _state_dicts() -> list[Any]:
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    many = OrderedDict((f"layer.{i}.weight", torch.zeros(2, i % 5 + 1)) for i in range(400))
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    return [
        lin.state_dict(),
        {"model": lin.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "lr": 1e-3,
         "name": "run-1", "flags": (True, False, None), "big": 2 ** 70, "neg": -5},
        {"params": list(lin.parameters()), "p": torch.nn.Parameter(torch.ones(3))},
        {"view": base[1:, 2:], "t": base.t(), "same": base, "scalar": torch.tensor(2.5),
         "empty": torch.empty(0, 3), "half": base.half(), "long": torch.arange(5)},
        many,
        {"nested": {"a": [1, 2.5, "x" * 70, "y" * 300], "b": (1, 2, 3, 4)}},
    ]


def _corpus(tmp: Path) -> list[bytes]:
    blobs: list[bytes] = []
    for folder in (ROOT / "tests" / "fixtures", ROOT / "samples"):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.stat().st_size <= 4 << 20:
                blobs += _pickles(path.read_bytes())
    for obj in _state_dicts():
        for save in ({}, {"pickle_protocol": 4}, {"_use_new_zipfile_serialization": False}):
            blobs += _pickles(_saved(obj, tmp, **save))
    templates = {"zip": tmp / "t.pt", "legacy": tmp / "t_legacy.pt"}
    torch.save({"w": torch.ones(2)}, templates["zip"])
    torch.save({"w": torch.ones(2)}, templates["legacy"], _use_new_zipfile_serialization=False)
    blobs += [benign_object(), legacy(benign_object())]
    for name, payload in sorted(PAYLOADS.items()):
        body = payload.build(tmp / f"canary_{name}")
        blobs.append(body)
        for contain in CONTAINERS.values():
            blobs += _pickles(contain(body, templates))
        blobs += _pickles(in_zip(body, templates["zip"]))
    return blobs


def _starts(blob: bytes) -> list[int]:
    """Where a pickle may start: 0 and each PROTO opcode."""
    return sorted({0, *(m.start() for m in re.finditer(b"\x80[\x02-\x05]", blob))})


def _same(data: bytes, start: int, bits: int) -> None:
    old = first_grammar(bits).match(data, start)
    new = fastpickle.grammar(bits).match(data, start)
    assert old is not None and new is not None
    assert new.end() == old.end(), (bits, start, data[start:start + 80])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    return _corpus(tmp_path_factory.mktemp("grammar"))


def test_the_corpus_is_what_it_claims(corpus: list[bytes]) -> None:
    """Torch pickles with tensors and parameters are among them, read to
    their STOP by the grammar (so the mutations start from accepted text)."""
    accepted = [d for d in corpus if fastpickle.scan(d, 0) is not None]
    assert len(accepted) > 50
    assert any(b"_rebuild_parameter" in d for d in accepted)
    assert any(b"_rebuild_tensor_v2" in d for d in accepted)


def test_every_corpus_pickle_matches_as_before(corpus: list[bytes]) -> None:
    for blob in corpus:
        for start in _starts(blob):
            bits = fastpickle.memo_bits(len(blob) - start)
            _same(blob, start, bits)
            _same(blob, start, fastpickle.MIN_MEMO_BITS)


INTERESTING = (b"()]}ldaesu01RQbqrhjKMJ\x8aGXc\n\x85\x86\x87\x88\x89Nt.\x80\x95"
               + bytes(range(0, 70)) + b"\xff\xfe\x7f")


LENGTHS = (0, 1, 2, 8, 9, 10, 11, 62, 63, 64, 65, 254, 255, 256, 257)


def _resized(rng: random.Random, data: bytes) -> bytes:
    """A BINUNICODE string or a LONG1 integer given another length, its
    prefix kept true: lengths at the grammar's limits (``counted``)."""
    found = [(m.start(), 4) for m in re.finditer(b"X(?=[\x00-\xff]\x00\x00\x00)", data)]
    found += [(m.start(), 1) for m in re.finditer(b"\x8a", data)]
    if not found:
        return data
    at, width = rng.choice(found)
    old = int.from_bytes(data[at + 1:at + 1 + width], "little")
    new = rng.choice(LENGTHS if width == 4 else LENGTHS[:7])
    body = (data[at + 1 + width:at + 1 + width + old] * (new + 1))[:new].ljust(new, b"a")
    return (data[:at + 1] + new.to_bytes(width, "little") + body
            + data[at + 1 + width + old:])


TUPLE = re.compile(b"(?:\\)|(?:K.|M..|J....)+[\x85\x86\x87]|\\((?:K.)*t)(?:q.)?", re.DOTALL)


def _tuple_changed(rng: random.Random, data: bytes) -> bytes:
    """A small tuple (a tensor's size, stride or the like) taken out, written
    twice, or given another of TUPLE1-3."""
    found = list(TUPLE.finditer(data))
    if not found:
        return data
    m = rng.choice(found)
    words = m.group()
    ends = [i for i, c in enumerate(words) if c in b"\x85\x86\x87"]
    if ends and rng.randrange(2):
        at = m.start() + ends[-1]
        return data[:at] + rng.choice((b"\x85", b"\x86", b"\x87")) + data[at + 1:]
    return data[:m.start()] + words * rng.choice((0, 2)) + data[m.end():]


def _mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    at = rng.randrange(len(data))
    kind = rng.randrange(10)
    if kind >= 8:
        return _tuple_changed(rng, data)
    if kind >= 6:
        return _resized(rng, data)
    if kind == 0:  # one byte replaced by an opcode or a small length
        return data[:at] + bytes([rng.choice(INTERESTING)]) + data[at + 1:]
    if kind == 1:  # any byte
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
    if kind == 2:  # inserted
        return data[:at] + bytes([rng.choice(INTERESTING)]) + data[at:]
    if kind == 3:  # deleted span
        return data[:at] + data[at + rng.randint(1, rng.choice((4, 16))):]
    if kind == 4:  # a span repeated
        span = data[at:at + rng.randint(1, 40)]
        return data[:at] + span + data[at:]
    other = rng.choice(others)  # a span of another pickle spliced in
    o = rng.randrange(len(other))
    return data[:at] + other[o:o + rng.randint(1, 60)] + data[at:]


def test_mutated_pickles_match_as_before(corpus: list[bytes]) -> None:
    rng = random.Random(20261207)
    seeds = [d for d in corpus if fastpickle.scan(d, 0) is not None and len(d) < 200_000]
    small = [d for d in seeds if len(d) < 20_000]
    tried = 0
    for round_ in range(8000):
        data = rng.choice(small if round_ % 4 else seeds)
        for _ in range(rng.randint(1, 3)):
            data = _mutate(rng, data, seeds) if data else data
        if not data:
            continue
        bits = rng.choice((fastpickle.MIN_MEMO_BITS, 17, 20, 24, 32,
                           fastpickle.memo_bits(len(data))))
        _same(data, 0, bits)
        tried += 1
    assert tried > 7000


@pytest.mark.parametrize("bits", range(fastpickle.MIN_MEMO_BITS, 33))
def test_memo_indices_at_each_limit_match_as_before(bits: int, tmp_path: Path) -> None:
    """LONG_BINPUT around ``2**bits`` (the memo bound, point 3) wherever a put may stand."""
    torch_pickle = _pickles(_saved({"w": torch.nn.Parameter(torch.ones(2)), "n": (1, 2.0)},
                                   tmp_path))
    data = next(d for d in torch_pickle if b"_rebuild_parameter" in d and d[:1] == b"\x80")
    puts = [m.start() for m in re.finditer(b"q.", data, re.DOTALL)]
    for index in (0, (1 << bits) - 1, 1 << bits, (1 << bits) + 1, 0xFFFFFFFF):
        if index >= 1 << 32:
            continue
        long_put = b"r" + index.to_bytes(4, "little")
        for at in puts:
            _same(data[:at] + long_put + data[at + 2:], 0, bits)
