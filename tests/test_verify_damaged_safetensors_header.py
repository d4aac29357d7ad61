"""``verify`` of a file named as safetensors whose header is damaged (a
flipped byte in its 8-byte length, or in the header's first byte) says
the file is damaged, exit 1, naming it and what is wrong: damage to a known
file is no "not a checkpoint" (exit 3). A file of no format whose name
says none is still exit 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptool.cli import main
from ckptool.errors import EXIT_BAD_INPUT, EXIT_FINDINGS

MODEL = Path(__file__).parent / "fixtures" / "frameworks" / "llama_tied" / "model.safetensors"


@pytest.mark.parametrize(("at", "said"), [(0, "header"), (5, "8-byte length"),
                                         (8, "starts with")])
def test_a_flipped_header_byte_is_damage_to_that_file(tmp_path: Path, at: int, said: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(MODEL.read_bytes())
    data[at] ^= 0x41 if at == 8 else 0x01
    damaged = tmp_path / "model.safetensors"
    damaged.write_bytes(bytes(data))
    code = main(["verify", str(damaged)])
    out = capsys.readouterr().out
    assert code == EXIT_FINDINGS, out
    assert "model.safetensors" in out and said in " ".join(out.split())


def test_bytes_of_no_format_under_another_name_are_still_no_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "notes.bin"
    junk.write_bytes(b"\xd8\x07" + bytes(200))
    assert main(["verify", str(junk)]) == EXIT_BAD_INPUT
    capsys.readouterr()
