"""What ``ckptool verify`` reports: each ``Problem`` found (its kind, the file
and tensor it concerns, one line saying what is wrong) and the ``Report``
of a whole run (the layout, the files, what was checked).

Kinds are stable machine names (the JSON's ``kind``):

- ``missing-file``, ``extra-file``: a file the layout names is absent; a
  file looks like one of the layout's but nothing names it;
- ``truncated``: a file shorter than what it or the layout says;
- ``size``: two sizes that must agree do not (a record and its storage, a
  chunk and its elements, bytes after the end);
- ``header``: a zip directory, a safetensors header, an index or a DCP
  ``.metadata`` that is damaged; ``pickle``: a pickle that does not parse;
- ``crc``: a zip record whose bytes do not match its CRC-32;
- ``bounds``: a byte range outside its file, or two overlapping;
- ``coverage-gap``, ``coverage-overlap``: chunks that leave part of a tensor
  out, or hold part of it twice; ``duplicate``: a tensor stored twice;
- ``missing-tensor``: a file lacks a tensor its index puts there;
  ``unlisted-tensor``: a file holds a tensor its index does not list;
- ``mismatch``: what a file holds disagrees with what the others say of it
  (a DCP item of another shape, ranks of two saves...);
- ``unreadable``: a file that cannot be read at all;
- ``blob-hash``, ``incomplete-download``: a Hugging Face cache's blobs;
- ``nan``, ``inf``, ``all-zero``, ``same-values`` (``--values``) and
  ``manifest-*`` (``--manifest``) come from the other checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ERROR, WARNING = "error", "warning"

MISSING_FILE, EXTRA_FILE, TRUNCATED, SIZE = "missing-file", "extra-file", "truncated", "size"
HEADER, PICKLE, CRC, BOUNDS = "header", "pickle", "crc", "bounds"
GAP, OVERLAP, DUPLICATE = "coverage-gap", "coverage-overlap", "duplicate"
MISSING_TENSOR, UNLISTED_TENSOR = "missing-tensor", "unlisted-tensor"
MISMATCH, UNREADABLE = "mismatch", "unreadable"
BLOB_HASH, INCOMPLETE = "blob-hash", "incomplete-download"
NOT_READ = "tensor bytes not read"  # the note of a URL verified without --full


@dataclass(frozen=True)
class Problem:
    """One thing found wrong (``severity`` error: damage, exit 1) or worth
    a look (warning: listed, the exit code unchanged)."""

    kind: str
    message: str  # one line, naming what is wrong
    file: str | None = None  # relative to the checkpoint's directory (or the file's name)
    tensor: str | None = None  # the tensor's key as ``inspect`` shows it
    severity: str = ERROR

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": self.severity, "file": self.file,
                "tensor": self.tensor, "message": self.message}


@dataclass
class Report:
    """What one verify run found."""

    path: str
    layout: str | None  # the checkpoint's format as inspect names it
    files: list[dict[str, Any]]  # {"name", "size"} of every file checked
    tensors: int | None  # None: the checkpoint could not be read whole to count them
    bytes_checked: int  # bytes whose CRC-32 or hash was computed
    problems: list[Problem]
    checks: list[str]  # "structure", "crc", "hf-cache"; "values", "manifest" added
    manifest: dict[str, Any] | None = None  # {"written": FILE} or {"checked": FILE}
    # what the checks cannot see here ("safetensors has no checksum...")
    notes: list[str] = field(default_factory=list)
    values: dict[str, Any] | None = None  # --values: check_values' summary
    # a URL: {"requests", "bytes", "listings"} asked of its store, "full": its bytes read
    remote: dict[str, Any] | None = None
    # the checkpoint as its reader read it (None: it could not be read whole),
    # for the checks that follow (values, manifests); no part of the JSON
    checkpoint: Any = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)


# words in a reader's message that say what kind of damage it found
# ("a pickle frame ends inside an opcode" is a byte changed inside a whole
# frame, not a file cut short: a frame cut short "claims N bytes, but only M follow")
_CLUES = (
    (TRUNCATED, ("truncated", "cut short", "ends before", "ends inside storage",
                 "ends inside the bytes", "ends at byte", "past the end", "bytes, but only",
                 "ran out of input", "unpack requires a buffer")),
    (MISSING_FILE, ("is missing", "are missing", " lacks the shards", "no such file",
                    "holds no *")),
    (EXTRA_FILE, ("states of rank(s)",)),
    (CRC, ("checksum",)),
    (OVERLAP, ("both hold", "overlaps")),
    (GAP, ("no chunk holds", "not whole", "do not make it whole")),
    (DUPLICATE, ("stored in two",)),
    (SIZE, ("bytes follow", " expected", "spans ")),
)


def classify(message: str, default: str) -> str:
    """The kind of damage a reader's error ``message`` names, by its words;
    ``default`` when it says none of them."""
    lowered = message.lower()
    for kind, words in _CLUES:
        if any(w in lowered for w in words):
            return kind
    return default


def dedupe(problems: list[Problem]) -> list[Problem]:
    """``problems`` in their order, each said once."""
    seen: set[Problem] = set()
    out = []
    for p in problems:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
