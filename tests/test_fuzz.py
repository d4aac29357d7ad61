"""The fuzzer (tests/fuzzing.py), bounded: a few hundred mutants of every
sample through ckptool.open, fix and convert; every outcome success or a
clean CkptoolError, the input untouched, nothing left beside the output.
``make fuzz`` runs it for minutes."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import ckptool
from ckptool.cli import main
from ckptool.errors import CkptoolError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzzing


def test_a_bounded_run_finds_nothing() -> None:
    """In a subprocess with an address-space limit: a mutant that makes the
    reader allocate what the file claims fails this test, not the machine."""
    proc = subprocess.run([sys.executable, str(Path(fuzzing.__file__)), "--seed", "20261124",
                           "--count", "600", "--memory", "3072"],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    assert report["tried"] == 600
    assert report["failures"] == [], "\n".join(report["failures"])
    assert proc.returncode == 0


def test_every_mutator_makes_mutants() -> None:
    kinds = {fuzzing.mutant(3, i)[1] for i in range(200)}
    assert kinds == set(fuzzing.MUTATORS)


@pytest.mark.parametrize("kind", sorted(fuzzing.MUTATORS))
def test_mutants_are_reproducible(kind: str) -> None:
    index = next(i for i in range(500) if fuzzing.mutant(5, i)[1] == kind)
    assert fuzzing.mutant(5, index) == fuzzing.mutant(5, index)


def test_zip64_locator_past_the_file_is_a_clean_error(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """Found by fuzzing: a ZIP64 locator pointing past the end of the file
    made a seek raise (ValueError, or OSError taken for a failed write)."""
    data = bytearray(fuzzing.zip64((fuzzing.SAMPLES / "dataparallel_cuda2.pth").read_bytes()))
    locator = data.rfind(b"PK\x06\x07")
    for value in (2**63 - 1, 2**64 - 1, len(data) + 10):
        data[locator + 8:locator + 16] = struct.pack("<Q", value)
        path = tmp_path / "z64.pth"
        path.write_bytes(data)
        with pytest.raises(CkptoolError, match="ZIP64"):
            ckptool.open(path)
        assert main(["inspect", str(path)]) == 3
        err = capsys.readouterr().err
        assert err.startswith("ckptool: error:") and "Traceback" not in err
        assert "free space" not in err


def test_a_valid_zip64_archive_reads_as_the_plain_one(tmp_path: Path) -> None:
    """The control: the fuzzer's ZIP64 form is a real archive."""
    plain = fuzzing.SAMPLES / "dataparallel_cuda2.pth"
    path = tmp_path / "z64.pth"
    path.write_bytes(fuzzing.zip64(plain.read_bytes()))
    assert [t.key for t in ckptool.open(path).tensors] == [
        t.key for t in ckptool.open(plain).tensors]


def test_mutations_change_the_file() -> None:
    rng = random.Random(1)
    data = (fuzzing.SAMPLES / "tinynet.safetensors").read_bytes()
    assert sum(fuzzing.mutate_safetensors(rng, data) != data for _ in range(20)) >= 15
