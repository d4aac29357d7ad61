"""The bytes of a remote checkpoint's files, for ``verify URL``.

By default no byte is read beyond what the structure checks read (headers,
zip directories, pickles, indexes, ``.metadata``): the records the zip
checks found wait in ``CrcPool.deferred``, unread. With ``--full`` each
file that has something to check its bytes against is read once, whole,
``stream.BLOCK`` bytes a request (memory: a block per file in flight), on
``STREAMS`` threads: its zip records against their CRC-32, and the whole
file against the sha256 its store lists (the Hub's, for an LFS file). A
file with neither (a safetensors file over S3 or HTTPS) is not read: its
bytes prove nothing without a manifest.

Every file read keeps its sha256 for the command (``filehash.remember``),
so that ``--manifest`` does not read it a second time.
"""

from __future__ import annotations

import hashlib
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptool.check.verify.filehash import remember
from ckptool.check.verify.files import Run
from ckptool.check.verify.problems import BLOB_HASH, NOT_READ, Problem
from ckptool.check.verify.zipcheck import CrcPool, Failure, Record
from ckptool.read.remote import stream

STREAMS = 4  # files read at once



@dataclass
class Read:
    """What reading the files found."""

    failures: list[Failure] = field(default_factory=list)  # records against their CRC-32
    problems: list[Problem] = field(default_factory=list)  # files against the store's sha256
    checked: int = 0  # bytes checked against a CRC-32 or a sha256
    records: int = 0  # zip records checked against their CRC-32
    hashed: set[str] = field(default_factory=set)  # files compared with the store's sha256
    unchecked: list[str] = field(default_factory=list)  # files with nothing to check against


def check(run: Run, pool: CrcPool, jobs: int, full: bool) -> Read:
    """The bytes of ``run``'s remote files: with ``full`` read once and
    checked (``read_all``); else left unread, and a note says so."""
    if not full:
        run.note(f"{NOT_READ}: only what the files say of themselves was (headers, "
                 "zip directories, pickles, indexes); verify --full reads every byte once "
                 "(zip records against their CRC-32, Hub files against their sha256)")
        return Read()
    read = read_all(run, pool, jobs)
    run.add(*read.problems)
    if read.unchecked:
        shown = ", ".join(read.unchecked[:3]) + (", …" if len(read.unchecked) > 3 else "")
        run.note(f"not read by --full: {shown}: nothing to check their bytes against here "
                 "(no CRC-32, no sha256 listed by the store)")
    return read


def read_all(run: Run, pool: CrcPool, jobs: int) -> Read:
    """Every file of ``run`` with records or a listed sha256, read once."""
    out = Read()
    work = []
    for name in run.sizes:
        path = run.path(name)
        records = sorted(pool.deferred.get(path, ()), key=lambda item: item[1].offset)
        listed = stream.listed_sha256(path)
        if records or listed:
            work.append((name, path, records, listed))
        else:
            out.unchecked.append(name)
    if not work:
        return out
    with ThreadPoolExecutor(min(STREAMS, max(1, jobs), len(work)),
                            thread_name_prefix="ckptool-stream") as threads:
        for (name, _, records, listed), (failures, sha, size) in zip(
                work, threads.map(lambda w: _read(w[1], w[2]), work), strict=True):
            out.failures += failures
            out.records += len(records)
            if listed is None:
                out.checked += sum(r.size for _, r, _ in records)
                continue
            out.hashed.add(name)
            out.checked += size
            if sha != listed:
                out.problems.append(Problem(
                    BLOB_HASH, f"its bytes hash to {sha[:12]}…, not to the sha256 the store "
                    f"lists for it ({listed[:12]}…): they changed after the upload, or on the "
                    "way", name))
    return out


def _read(path: str, records: list[tuple[str, Record, object]]) -> tuple[list[Failure], str,
                                                                        int]:
    """The records of ``path`` that fail their CRC-32, its sha256 and size,
    from one pass over its bytes."""
    h = hashlib.sha256()
    crcs = [0] * len(records)
    first = 0  # the first record not yet wholly read
    size = 0
    for offset, data in stream.blocks(path):
        h.update(data)
        size += len(data)
        view = memoryview(data)
        end = offset + len(data)
        i = first
        while i < len(records):
            r = records[i][1]
            if r.offset >= end:
                break
            lo, hi = max(r.offset, offset), min(r.offset + r.size, end)
            if lo < hi:
                crcs[i] = zlib.crc32(view[lo - offset:hi - offset], crcs[i])
            if r.offset + r.size <= end and i == first:
                first += 1
            i += 1
    sha = h.hexdigest()
    remember(path, size, sha)
    failures = [Failure(file, r, label) for (file, r, label), crc in zip(records, crcs,
                                                                         strict=True)
                if crc != r.crc]
    return failures, sha, size
