"""A seeded, structure-aware fuzzer for ckptool's readers and writers.

Mutants are made from the files in ``samples/`` and from a ZIP64 form of a
torch zip, by five mutators:

- ``bytes``: byte flips, truncation and insertion anywhere in a file;
- ``pickle``: opcodes of ``data.pkl`` replaced, dropped, doubled or given
  other arguments, inside an otherwise valid torch zip; ``legacy``: the
  same in one of a legacy file's five pickles;
- ``safetensors``: the JSON header's shapes, offsets, dtypes and keys changed;
- ``zipdir``: fields of the central directory and of the end records
  (offsets, sizes, counts) set to edge values;
- ``zip64``: the same for the ZIP64 end record and its locator.

Every mutant is read with ``ckptool.open``; some are also fixed and
converted. Each outcome must be success or a ``CkptoolError``, within a
time bound, leaving the input as it was and no stray file beside the
output. ``run(seed, count)`` returns the failures, each with what makes it
again (mutator, seed, index). The test suite runs a few hundred mutants;
``make fuzz`` runs many more:

    .venv/bin/python tests/fuzzing.py --seconds 300 [--seed N]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import pickle
import pickletools
import random
import resource
import shutil
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ckptool  # noqa: E402
from ckptool.errors import CkptoolError  # noqa: E402

SAMPLES = ROOT / "samples"
SLOW = 5.0  # seconds one mutant may take, all operations together
EDGES = (0, 1, 7, 8, 63, 64, 0xFFFF, 0xFFFFFFFF, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1)


@dataclass(frozen=True)
class Failure:
    mutator: str
    seed: int
    index: int
    operation: str
    error: str

    def __str__(self) -> str:
        return (f"{self.mutator} seed={self.seed} index={self.index} {self.operation}: "
                f"{self.error}")


# -- mutators: (rng, original bytes) -> mutant bytes ------------------------------

def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.6 and out:
            at = rng.randrange(len(out))
            out[at] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
        elif kind < 0.8 and out:
            del out[rng.randrange(len(out)):]
        else:
            at = rng.randrange(len(out) + 1)
            out[at:at] = rng.randbytes(rng.randint(1, 16))
    return bytes(out)


def _rezip(data: bytes, replace: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, replace.get(info.filename, src.read(info)))
    return out.getvalue()


def mutate_pickle(rng: random.Random, data: bytes) -> bytes:
    """An opcode of data.pkl changed, in a zip that is otherwise valid."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        pkl = z.read(name)
    return _rezip(data, {name: _mutate_opcodes(rng, pkl, 0, len(pkl))})


def mutate_frames(rng: random.Random, data: bytes) -> bytes:
    """data.pkl as protocol 4 with a FRAME of a random length: ending on an
    opcode boundary, inside an opcode's argument, or past the pickle."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        pkl = z.read(name)
    body = pkl[2:] if pkl[:1] == b"\x80" else pkl
    length = rng.choice([rng.randint(1, len(body)), len(body), len(body) + rng.randint(1, 64)])
    at = rng.randrange(len(body) + 1) if rng.random() < 0.3 else 0  # a frame not at the start
    framed = body[:at] + b"\x95" + struct.pack("<Q", length) + body[at:]
    return _rezip(data, {name: b"\x80\x04" + framed})


def mutate_names(rng: random.Random, data: bytes) -> bytes:
    """A record added whose name differs from another's only in case, or
    repeats it exactly, or a pickle record torch does not read."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        infos = src.infolist()
        for info in infos:
            dst.writestr(info.filename, src.read(info))
        victim = rng.choice(infos).filename
        twin = "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in victim)
        extra = victim.rsplit("/", 1)[0] + f"/x{rng.randrange(100)}.pkl"
        roll = rng.random()
        name = (twin if twin != victim and roll < 0.5 else victim if roll < 0.75
                else extra)
        dst.writestr(name, rng.choice([src.read(victim), pickle.dumps({"a": 1}, 2), b"\x80"]))
    return out.getvalue()


def mutate_legacy(rng: random.Random, data: bytes) -> bytes:
    """An opcode of one of a legacy file's five pickles changed."""
    stream, starts = io.BytesIO(data), []
    for _ in range(5):
        starts.append(stream.tell())
        for _ in pickletools.genops(stream):
            pass
    starts.append(stream.tell())
    which = rng.randrange(5)
    return _mutate_opcodes(rng, data, starts[which], starts[which + 1])


def _mutate_opcodes(rng: random.Random, data: bytes, begin: int, end: int) -> bytes:
    """``data`` with opcodes of the pickle at ``data[begin:end]`` changed."""
    pkl = data[begin:end]
    ops = [pos for _, _, pos in pickletools.genops(pkl)]
    bounds = list(zip(ops, [*ops[1:], len(pkl)], strict=True))
    out = bytearray(pkl)
    for _ in range(rng.randint(1, 3)):
        start, end = rng.choice(bounds)
        if start >= len(out):
            continue
        end = min(end, len(out))
        kind = rng.random()
        if kind < 0.3:
            out[start] = rng.choice(b"().0123CFGIJKLMNPQRSTUVX]abcdeghijlmopqrstu}\x80\x81"
                                    b"\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e"
                                    b"\x8f\x90\x91\x92\x93\x94\x95\x96\x97\x98")
        elif kind < 0.5:
            del out[start:end]
        elif kind < 0.7:
            out[start:start] = out[start:end]
        elif end - start > 1:  # an argument byte
            out[rng.randrange(start + 1, end)] = rng.randrange(256)
    return data[:begin] + bytes(out) + data[end:]


def mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for _ in range(rng.randint(1, 3)):
        names = [k for k in header if k != "__metadata__"]
        kind = rng.random()
        entry = header[rng.choice(names)] if names else {}
        entry = entry if isinstance(entry, dict) else {}
        if kind < 0.2 and entry:
            entry["shape"] = [rng.choice([*EDGES, -1, 3])
                              for _ in range(rng.randint(0, 4))]
        elif kind < 0.4 and _offsets(entry):
            a, b = entry["data_offsets"]
            entry["data_offsets"] = [a + rng.choice([-8, -1, 0, 1, 8]),
                                     b + rng.choice([-8, -1, 0, 1, 8, 2**40])]
        elif kind < 0.5 and entry:
            entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I64", "F8_E4M3", "F4", "X",
                                         "", 3, None])
        elif kind < 0.6 and entry:
            entry["data_offsets"] = rng.choice([[0], "x", [1, 0], [0, 0, 0], None])
        elif kind < 0.7:
            header["__metadata__"] = rng.choice([{"a": 1}, [], "x", {"ckptool.aliases": "{"},
                                                 {"ckptool.aliases": '{"z": "z"}'}])
        elif kind < 0.8 and names:
            header[rng.choice(names) + "_copy"] = dict(entry)
        elif kind < 0.9 and names:
            del header[rng.choice(names)]
        else:
            header = rng.choice([[], "x", {"a": []}, header])
            break
    raw = json.dumps(header).encode()
    tail = data[8 + n:]
    if rng.random() < 0.2:
        tail = tail + rng.randbytes(rng.randint(1, 9)) if rng.random() < 0.5 else tail[:-1]
    return struct.pack("<Q", len(raw)) + raw + tail


def _offsets(entry: object) -> bool:
    """An entry whose data_offsets an earlier mutation left a pair of ints."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return isinstance(offsets, list) and len(offsets) == 2 and all(
        isinstance(o, int) for o in offsets)


def _end_records(data: bytes) -> int:
    return data.rfind(b"PK\x05\x06")


def mutate_zipdir(rng: random.Random, data: bytes) -> bytes:
    """A field of a central-directory entry or of the end record."""
    out = bytearray(data)
    eocd = _end_records(data)
    (cd_offset,) = struct.unpack_from("<I", data, eocd + 16)
    entries = []
    pos = cd_offset
    while data[pos:pos + 4] == b"PK\x01\x02":
        entries.append(pos)
        nlen, xlen, clen = struct.unpack_from("<HHH", data, pos + 28)
        pos += 46 + nlen + xlen + clen
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.3 or not entries:  # end record: count, size, offset
            field, width = rng.choice([(8, 2), (10, 2), (12, 4), (16, 4), (20, 2)])
            at = eocd + field
        else:  # an entry: flags, method, crc, sizes, name length, local offset
            field, width = rng.choice([(8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2),
                                       (30, 2), (42, 4)])
            at = rng.choice(entries) + field
        value = rng.choice(EDGES) % (1 << (8 * width))
        out[at:at + width] = value.to_bytes(width, "little")
    return bytes(out)


def zip64(data: bytes) -> bytes:
    """The same archive with ZIP64 end records, as torch writes past 4 GiB."""
    eocd = _end_records(data)
    count, cd_size, cd_offset = struct.unpack_from("<HII", data, eocd + 10)
    record = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count,
                         cd_size, cd_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, eocd, 1)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                      0xFFFFFFFF, 0)
    return data[:eocd] + record + locator + end


def mutate_zip64(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    eocd = _end_records(data)
    locator, record = eocd - 20, eocd - 20 - 56
    for _ in range(rng.randint(1, 2)):
        at, width = rng.choice([(locator + 4, 4), (locator + 8, 8), (locator + 16, 4),
                                (record + 4, 8), (record + 24, 8), (record + 32, 8),
                                (record + 40, 8), (record + 48, 8), (eocd + 10, 2)])
        value = rng.choice([*EDGES, len(data), len(data) + 1]) % (1 << (8 * width))
        out[at:at + width] = value.to_bytes(width, "little")
    return bytes(out)


# -- what each mutant must survive ----------------------------------------------------

def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(path: Path, write: bool) -> Iterator[tuple[str, Callable[[], object]]]:
    """(operation, action) pairs to run on a mutant."""
    yield "open", lambda: ckptool.open(path)
    if write:
        out = path.parent / "out"
        yield "fix", lambda: ckptool.fix(str(path), ckptool.FixOptions(
            strip_module=True, to="cpu"), str(out / "fixed.pth"))
        yield "fix --extract --dtype", lambda: ckptool.fix(str(path), ckptool.FixOptions(
            extract="auto", dtype="float16"), str(out / "cast.pth"))
        yield "convert", lambda: ckptool.convert(str(path), str(out / "c.safetensors"))


def survive(path: Path, write: bool) -> list[tuple[str, str]]:
    """Run every operation; the ones that failed otherwise than cleanly."""
    problems = []
    before = _sha(path)
    out = path.parent / "out"
    for operation, action in check(path, write):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        start = time.monotonic()
        try:
            action()
        except CkptoolError:
            if any(out.iterdir()):
                problems.append((operation, f"left {sorted(p.name for p in out.iterdir())}"))
        except BaseException:  # the fuzzer's verdict: anything else is a bug
            problems.append((operation, traceback.format_exc(limit=-3).strip()[-600:]))
        else:
            if len(list(out.iterdir())) > 1:
                problems.append((operation, f"left {sorted(p.name for p in out.iterdir())}"))
        if time.monotonic() - start > SLOW:
            problems.append((operation, f"took {time.monotonic() - start:.1f} s"))
        if _sha(path) != before:
            problems.append((operation, "modified its input"))
    return problems


@functools.cache
def corpus() -> dict[str, tuple[bytes, list[str]]]:
    """name -> (original bytes, mutators that apply to it)."""
    files = {}
    for path in sorted(SAMPLES.iterdir()):
        if path.suffix in (".py",) or path.is_dir():  # a DCP directory: its files are
            continue                                  # pickles and zips already covered
        data = path.read_bytes()
        kinds = ["bytes"]
        if data[:4] == b"PK\x03\x04":
            kinds += ["zipdir"]
            if any(n.endswith("data.pkl") for n in zipfile.ZipFile(path).namelist()):
                kinds += ["pickle", "frames", "names"]
        elif path.suffix == ".safetensors":
            kinds += ["safetensors"]
        elif data[:4] == b"\x80\x02\x8a\x0a":  # a legacy torch file's magic number
            kinds += ["legacy"]
        files[path.name] = (data, kinds)
    dp = (SAMPLES / "dataparallel_cuda2.pth").read_bytes()
    files["dataparallel_zip64.pth"] = (zip64(dp), ["zip64", "bytes"])
    return files


MUTATORS: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "bytes": mutate_bytes, "pickle": mutate_pickle, "legacy": mutate_legacy,
    "safetensors": mutate_safetensors,
    "zipdir": mutate_zipdir, "zip64": mutate_zip64,
    "frames": mutate_frames, "names": mutate_names,
}


def mutant(seed: int, index: int) -> tuple[str, str, bytes]:
    """(file name, mutator, bytes) of mutant ``index`` of run ``seed``: the same
    every time, so that a failure can be made again on its own."""
    rng = random.Random(f"{seed}:{index}")
    files = corpus()
    name = rng.choice(sorted(files))
    data, kinds = files[name]
    kind = rng.choice(kinds)
    return name, kind, MUTATORS[kind](rng, data)


def run(seed: int, count: int | None = None, seconds: float | None = None,
        write_every: int = 4) -> tuple[int, list[Failure]]:
    """Mutants ``0..count`` of ``seed`` (or as many as ``seconds`` allow);
    returns (mutants tried, failures)."""
    failures: list[Failure] = []
    deadline = time.monotonic() + seconds if seconds else None
    index = 0
    with tempfile.TemporaryDirectory(prefix="ckptool-fuzz-") as tmp:
        while (count is None or index < count) and (
                deadline is None or time.monotonic() < deadline):
            name, kind, data = mutant(seed, index)
            work = Path(tmp) / str(index)
            work.mkdir()
            path = work / name
            path.write_bytes(data)
            for operation, error in survive(path, write=index % write_every == 0):
                failures.append(Failure(kind, seed, index, f"{operation} {name}", error))
            shutil.rmtree(work)
            index += 1
    return index, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--count", type=int)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--memory", type=int, default=4096, help="MiB the run may take")
    args = parser.parse_args()
    limit = args.memory << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    tried, failures = run(args.seed, args.count, None if args.count else args.seconds)
    print(json.dumps({"seed": args.seed, "tried": tried,
                      "failures": [str(f) for f in failures]}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
