"""Reading pickles from a file: ``load`` one object with ckptool's unpickler
(every way a pickle can be malformed becomes a ``CorruptCheckpointError``),
and ``scan_rest`` for what follows it.

The format readers call these for each pickle their format holds; the
unpickler itself (``ckptool.read.pickle.unpickler``) knows no file, only a stream.
"""

from __future__ import annotations

import gc
import io
import pickle
import struct
from typing import IO, Any

from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError, RefusedPickleError
from ckptool.read import fastpickle, observe
from ckptool.read.pickle.unpickler import EmbeddedReader, PersistentLoader, SafeUnpickler
from ckptool.read.seen import GlobalsSeen
from ckptool.read.treecheck import HINT, check_tree

__all__ = ["HINT", "PersistentLoader", "load", "scan_rest"]


MAX_TRAILING_PICKLES = 16  # pickles read after the end of the one a format reads


def scan_rest(stream: IO[bytes], end: int, seen: GlobalsSeen, part: str,
              read_embedded: EmbeddedReader | None = None) -> str | None:
    """What follows the pickle just read from ``stream``, up to ``end``.

    torch.load reads one pickle, but another ``pickle.load`` of the same file
    reads the next, so every pickle that follows is read too (its objects
    dropped), for the globals it names. Returns a warning that says what
    follows, or None when nothing does."""
    start = stream.tell()
    if start >= end:
        return None
    outer, pickles = seen.part, 0
    seen.part = f"after the end of {part}"
    try:
        while stream.tell() < end and pickles < MAX_TRAILING_PICKLES:
            at = stream.tell()
            try:
                load(stream, ignore_persistent, seen, {}, read_embedded)
            except RefusedPickleError:
                raise  # refused for what it does: as the first pickle would be
            except CorruptCheckpointError:
                stream.seek(at)
                break
            pickles += 1
    finally:
        seen.part = outer
    what = (f"{plural(pickles, 'more pickle')}, read for what they name"
            if pickles else "not a pickle")
    if pickles and stream.tell() < end:
        what += f", then {end - stream.tell()} bytes that are not"
    return (f"{plural(end - start, 'byte')} follow the end of {part} ({what}): torch.load "
            "ignores them, but they are not what torch.save writes")


def ignore_persistent(pid: tuple[Any, ...]) -> None:
    """A pickle after the one torch reads refers to storages nothing loads."""
    return None


def load(data: bytes | IO[bytes], persistent: PersistentLoader | None,
         seen: GlobalsSeen, embedded: dict[str, Any] | None = None,
         read_embedded: EmbeddedReader | None = None) -> Any:
    """Unpickle one object from ``data`` safely; format errors become CorruptCheckpointError."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    # unpickling makes many small objects and no cycles worth collecting:
    # the collector's passes over them cost more than the read itself
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        fast = (fastpickle.load(stream, persistent)
                if persistent is not None and embedded is None
                and isinstance(stream, io.BytesIO) else None)
        if fast is None:
            obj = SafeUnpickler(stream, persistent, seen, embedded, read_embedded).load()
        else:
            obj = fast[0]
            for dotted, verdict in fast[1]:
                seen.add(dotted, verdict)
        check_tree(obj)
        return obj
    except CorruptCheckpointError:
        raise
    except observe.ObserverFailed as failed:
        raise failed.error from None
    except RecursionError as exc:
        raise CorruptCheckpointError("pickle nests too deeply to read", HINT) from exc
    except MemoryError as exc:
        raise CorruptCheckpointError("pickle asks for more memory than it could hold",
                                     HINT) from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, LookupError,
            AttributeError, ArithmeticError, struct.error) as exc:
        # any of these is a malformed or truncated stream, or a hostile one
        # trying to use an inert stand-in in a way real data never does
        text = str(exc) or type(exc).__name__
        raise CorruptCheckpointError(f"cannot read pickle: {text[:200]}", HINT) from exc
    finally:
        if gc_was_enabled:
            gc.enable()
