"""A folder's verdict covers every file a framework loads from it.

Starting from a real Trainer ``checkpoint-N/`` (transformers wrote it) and
a real DeepSpeed checkpoint (DeepSpeed wrote it), changed as an attacker
would: a payload in the 70th rank's RNG state, a companion ckptool cannot
read (a PROTO 1 header, which pickle reads; a pre-0.4 tar, which torch's
legacy loader unpickles), a DeepSpeed ``global_step*/`` beside the Trainer
model, and a ``latest`` naming a nested tag, which DeepSpeed follows. Each
makes the folder's verdict unsafe, and ``convert`` writes nothing from it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptool
from ckptool.cli import main
from ckptool.read.companions import UNREADABLE
from ckptool.write.flagged import flagged
from tests.test_malicious import call, g, pkl, s
from tests.test_safety_containers import zip_injected
from tests.test_safety_corpus import CORPUS
from tests.test_safety_round2 import v7_tar

FIXTURES = Path(__file__).parent / "fixtures"
TRAINER = FIXTURES / "frameworks" / "trainer_checkpoint" / "checkpoint-2"
DEEPSPEED = FIXTURES / "deepspeed" / "z1_fp32"


def _trainer(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(TRAINER, folder)
    return folder


def _evil_torch_file(canary: Path, src: Path, dst: Path) -> None:
    zip_injected(CORPUS["os_system"].build(canary), src, dst)


def _refused(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(folder), str(out)]) == 3 and not out.exists()


def test_every_rank_file_is_read_however_many(tmp_path: Path) -> None:
    folder = _trainer(tmp_path)
    rng = folder / "rng_state.pth"
    for rank in range(70):
        shutil.copy(rng, folder / f"rng_state_{rank}.pth")
    canary = tmp_path / "CANARY"
    _evil_torch_file(canary, rng, folder / "rng_state_67.pth")
    names = flagged(ckptool.open(folder))
    assert names == ["rng_state_67.pth: os.system"], names
    _refused(folder, tmp_path)
    assert not canary.exists()


@pytest.mark.parametrize("kind", ["proto1", "v7_tar"])
def test_a_companion_ckptool_cannot_read_is_unknown(kind: str, tmp_path: Path) -> None:
    folder = _trainer(tmp_path)
    if kind == "proto1":  # pickle.load reads any PROTO up to 5
        (folder / "optimizer.pt").write_bytes(b"\x80\x01" + pkl(call(
            g("os", "system"), s("true")))[2:])
    else:
        v7_tar(folder / "optimizer.pt", {"sys_info": b"x"})
    ckpt = ckptool.open(folder)
    assert ckpt.framework is not None
    (optimizer,) = [c for c in ckpt.framework.companions if c.path == "optimizer.pt"]
    assert optimizer.unsafe, optimizer
    if kind == "v7_tar":
        assert optimizer.unsafe == (UNREADABLE,) and optimizer.error
    else:  # read as the pickle it is
        assert optimizer.unsafe == ("os.system",)
    _refused(folder, tmp_path)


def test_a_deepspeed_tag_beside_a_trainer_model_is_read(tmp_path: Path) -> None:
    folder = _trainer(tmp_path)
    tag = folder / "global_step2"
    shutil.copytree(DEEPSPEED / "global_step2", tag)
    (folder / "latest").write_text("global_step2")
    canary = tmp_path / "CANARY"
    model = tag / "mp_rank_00_model_states.pt"
    _evil_torch_file(canary, model, tmp_path / "evil.pt")
    shutil.copy(tmp_path / "evil.pt", model)
    assert "global_step2/mp_rank_00_model_states.pt: os.system" in flagged(ckptool.open(folder))
    _refused(folder, tmp_path)
    assert not canary.exists()


def test_latest_naming_a_nested_tag_is_followed(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    shutil.copytree(DEEPSPEED / "global_step2", folder / "resume" / "global_step9")
    (folder / "latest").write_text("resume/global_step9\n")
    plain = ckptool.open(DEEPSPEED)
    nested = ckptool.open(folder)
    assert nested.format == plain.format and nested.metadata.get("tag") in (
        None, "resume/global_step9")
    assert {t.key for t in nested.tensors} == {t.key for t in plain.tensors}
    # a payload there is the checkpoint's own
    canary = tmp_path / "CANARY"
    model = folder / "resume" / "global_step9" / "mp_rank_00_model_states.pt"
    _evil_torch_file(canary, model, tmp_path / "evil.pt")
    shutil.copy(tmp_path / "evil.pt", model)
    try:
        assert "os.system" in ckptool.open(folder).unsafe_globals
    except ckptool.CkptoolError as exc:
        assert "os.system" in exc.message and exc.exit_code == 3
    assert not canary.exists()
    assert torch.__version__  # the DeepSpeed files are torch.save archives


def test_a_ranks_metadata_beside_metadata_is_read(tmp_path: Path) -> None:
    """dcp.load unpickles ``__0.metadata`` when ``.metadata`` fails it (here:
    a storage_meta it cannot set load_id on): that file is the checkpoint's
    too, and a payload in it is flagged; the control sees dcp.load run it."""
    import pickle
    import subprocess
    import sys

    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "multifile" / "dcp_4ranks", folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())  # written by dcp.save here
    meta.storage_meta = 1
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    canary = tmp_path / "RAN"
    (folder / "__0.metadata").write_bytes(pkl(call(g("os", "system"), s(f"touch {canary}"))))
    assert "os.system" in flagged(ckptool.open(folder))
    _refused(folder, tmp_path)
    assert not canary.exists()
    subprocess.run([sys.executable, "-c", "import torch.distributed.checkpoint as dcp\ntry:\n"
                    f"    dcp.load({{}}, checkpoint_id={str(folder)!r}, no_dist=True)\n"
                    "except BaseException:\n    pass"],  # CheckpointException is one
                   check=True, timeout=120, capture_output=True)
    assert canary.exists(), "dcp.load did not read __0.metadata: not a live payload"
