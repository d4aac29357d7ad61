"""Helpers shared by tests: writing CUDA-tagged files without a GPU, and
reading what torch itself loads from a file, flattened like ckptool keys."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.serialization

import ckptool
from ckptool.keys import join_key

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"


def load_script(path: Path) -> types.ModuleType:
    """A fixture-writing script (not a package module) imported by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_samples_module() -> types.ModuleType:
    """samples/make_samples.py, which owns the sample models and ``saved_on``."""
    return load_script(SAMPLES / "make_samples.py")


make_samples = load_samples_module()
# tests/fixtures/nemo/make_nemo.py: NeMo's folders and .nemo files, written without NeMo
make_nemo = load_script(Path(__file__).resolve().parent / "fixtures" / "nemo" / "make_nemo.py")
saved_on = make_samples.saved_on


def flatten(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Tensors in a torch-loaded object, keyed like ckptool: '/' between
    containers (a name's own '/' and '\\' escaped), modules as their state
    dict (dotted names)."""

    def join(k: Any) -> str:
        return join_key(path, str(k))

    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, torch.nn.Module):
        for k, v in obj.state_dict(keep_vars=True).items():
            out[join(k)] = v
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, join(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten(v, join(i)))
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            out.update(flatten(v, join(k)))
    return out


def torch_view(path: str, script: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(flattened tensors, location tag of each storage) as torch.load sees them."""
    tags: list[str] = []

    def record(storage: Any, location: str) -> Any:
        tags.append(location)
        return storage

    if script:
        return flatten(torch.jit.load(path, map_location="cpu")), tags
    obj = torch.load(path, map_location=record, weights_only=False)
    return flatten(obj), tags


def sharing_groups(tensors: dict[str, Any], storage_of: Any) -> set[frozenset[str]]:
    groups: dict[Any, set[str]] = {}
    for key, t in tensors.items():
        groups.setdefault(storage_of(t), set()).add(key)
    return {frozenset(g) for g in groups.values()}


def check_against_torch(path: Path, script: bool = False) -> ckptool.Checkpoint:
    ckpt = ckptool.open(path)
    theirs, tags = torch_view(str(path), script=script)
    ours = {t.key: t for t in ckpt.tensors}
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        mine = ours[key]
        assert mine.shape == tuple(t.shape), key
        assert mine.dtype == str(t.dtype).removeprefix("torch."), key
        if t.layout == torch.strided and not t.is_quantized:
            assert mine.stride == t.stride(), key
            assert mine.storage_offset == t.storage_offset(), key
        assert mine.nbytes == t.numel() * t.element_size(), key
    # storage sharing: the same partition of keys
    theirs_groups = sharing_groups(theirs, lambda t: t.untyped_storage().data_ptr())
    ours_groups = sharing_groups(ours, lambda t: t.storage)
    assert ours_groups == theirs_groups
    if not script:  # one restore_location call per storage, with its tag
        assert Counter(s.location for s in ckpt.storages.values()) == Counter(tags)
    return ckpt


def flip_record_byte(path: Path, member: str, at: int = 100, mask: int = 0x10) -> None:
    """Flip one byte of a torch zip's record ``member`` (``at`` bytes into its
    data), keeping the file's times: the file's size and dates say nothing
    changed, only the record's CRC does."""
    import os
    import zipfile

    st = os.stat(path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        skip = int.from_bytes(f.read(2), "little") + int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + skip + at)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ mask]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def on_thread_ranks(n: int, work: Any, catch: tuple[type[BaseException], ...]) -> list[Any]:
    """``work(world)`` on ``n`` ranks run as threads of this process over one
    in-memory store (``world.alone_with``): each rank's result, or the
    exception of ``catch`` it raised."""
    import threading

    import torch.distributed as dist

    from ckptool.write.distributed import world

    store = dist.HashStore()
    out: list[Any] = [None] * n

    def rank(r: int) -> None:
        try:
            out[r] = work(world.alone_with(store, r, n))
        except catch as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def disk_full_lines(err: str, path: object, hint: str) -> bool:
    """Whether ``err`` is the full-disk error of writing ``path`` (with the
    filesystem's figures: what the output needs where known, what is free)
    and ``hint``."""
    import re

    lines = err.splitlines()
    said = (rf"ckptool: error: cannot write {re.escape(str(path))}: no space left on "
            r"device \((needs [\d.]+ k?[MGT]?B, )?[\d.]+ k?[MGT]?B free on /\S*\)")
    return len(lines) == 2 and re.fullmatch(said, lines[0]) is not None and lines[1] == hint


def clean_env() -> dict[str, str]:
    """This environment without what a launcher sets (a test run under
    torchrun or srun would pass it on), ckptool from this tree, one thread."""
    import os

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "CKPTOOL_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS="1")
    return env


def small_sharded_model(folder: Path) -> Path:
    """A three-tensor model in shards as huggingface_hub writes them (5 KB
    each), with a config.json: what the Hugging Face cache tests download."""
    import huggingface_hub

    folder.mkdir()
    torch.manual_seed(0)
    huggingface_hub.save_torch_state_dict(
        {"w": torch.randn(64, 32), "b": torch.randn(32), "emb.weight": torch.randn(100, 16)},
        str(folder), max_shard_size="5KB")
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    return folder


def cli_in_subprocess(*args: str, timeout: float) -> tuple[int | None, str]:
    """The CLI run in a child process killed after ``timeout`` seconds (a
    crafted input that would hang or eat memory): (its exit code, or None
    where it was killed; its stderr)."""
    code = "import sys; from ckptool.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "(killed: still running after the timeout)"
    return done.returncode, done.stderr
