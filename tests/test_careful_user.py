"""What a careful new user found, each with the recipe that found it: the
README's promises hold on files made the way users make them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptool
from ckptool.check import gpus, modelspec

RunCli = Callable[..., tuple[int, str, str]]

MODEL = textwrap.dedent("""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.bn = torch.nn.BatchNorm1d(2)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.register_buffer("cache", torch.zeros(2), persistent=False)
            self.blocks[0].register_buffer("scratch", torch.zeros(1), persistent=False)
""")


@pytest.fixture
def whole(tmp_path: Path) -> dict[str, Path]:
    """A whole pickled module with non-persistent buffers, alone and in a dict."""
    (tmp_path / "m.py").write_text(MODEL)
    code = (f"import sys, torch; sys.path.insert(0, {str(tmp_path)!r}); import m\n"
            f"torch.save(m.M(), {str(tmp_path / 'whole.pth')!r})\n"
            f"torch.save({{'model': m.M(), 'epoch': 1}}, {str(tmp_path / 'in_dict.pth')!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    return {"model": tmp_path / "m.py", "whole": tmp_path / "whole.pth",
            "in_dict": tmp_path / "in_dict.pth"}


def load_model(path: Path) -> torch.nn.Module:
    sys.path.insert(0, str(path.parent))
    try:
        import m  # type: ignore[import-not-found]

        return m.M()  # type: ignore[no-any-return]
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop("m", None)


@pytest.mark.parametrize("which", ["whole", "in_dict"])
def test_a_pickled_module_is_its_state_dict(which: str, whole: dict[str, Path],
                                            tmp_path: Path, run_cli: RunCli) -> None:
    """inspect, diagnose, fix and convert agree with module.state_dict():
    persistent buffers only, _metadata included; the printed fix loads strictly."""
    path = whole[which]
    net = load_model(whole["model"])
    want = list(net.state_dict())
    ckpt = ckptool.open(path)
    assert ckpt.main_state_dict is not None and list(ckpt.main_state_dict.keys) == want
    keys = modelspec.build_model(f"{whole['model']}:M", {})
    d = ckptool.diagnose(ckpt, gpus.assumed(0), keys)
    assert d.keys is not None and d.keys.expected == d.keys.before == len(want)
    finding = next(f for f in d.findings if f.code == "pickled-module")
    index = "['model']" if which == "in_dict" else ""
    assert f"torch.load(path, weights_only=False){index}.state_dict()" in (finding.snippet or "")
    # the command as printed, run where diagnose ran
    assert d.fix_command is not None
    args = d.fix_command.split()[1:]
    code, _, err = run_cli(*args[:1], str(path.parent / args[1]), *args[2:-1],
                           str(path.parent / args[-1]))
    assert code == 0, err
    sd = torch.load(path.parent / d.fix_output)  # type: ignore[operator]
    assert list(sd) == want
    assert sd._metadata == net.state_dict()._metadata
    net.load_state_dict(sd, strict=True)
    result = ckptool.convert(str(path), str(tmp_path / f"{which}.safetensors"))
    assert result.tensors == len(want)
