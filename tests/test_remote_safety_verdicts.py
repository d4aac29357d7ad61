"""The safety verdict on a checkpoint behind a URL is the verdict on its
local copy: every payload of the suite's corpus (a plain pickle, and inside
a torch zip) read over HTTPS names the same unsafe globals, or is refused
with the same error, and runs nothing; every benign file of the corpus
stays clean. Only pickles are read, never a tensor's bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_malicious import PAYLOADS, in_zip

BENIGN = sorted((Path(__file__).parent / "fixtures" / "safety_benign").glob("*"))


pytestmark = pytest.mark.usefixtures("fresh_remote")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "t.pt"
    torch.save({"w": torch.ones(2)}, path)
    return path


def verdict(run_cli: Any, path: str) -> tuple[int, Any]:
    code, out, err = run_cli("inspect", "--json", path)
    if code != 0:
        return code, err.splitlines()[0].replace(path, "<path>")
    data = json.loads(out)
    return code, (sorted(data["unsafe_globals"]), sorted(g["name"] for g in data["globals"]))


@pytest.mark.parametrize("name", sorted(PAYLOADS))
@pytest.mark.parametrize("container", ["pickle", "zip"])
def test_a_payload_over_https_gets_the_local_verdict(name: str, container: str, tmp_path: Path,
                                                    http_server: Any, run_cli: Any,
                                                    template: Path) -> None:
    canary = tmp_path / "canary"
    data = PAYLOADS[name].build(canary)
    if container == "zip":
        data = in_zip(data, template)
    local = tmp_path / f"x.{'pt' if container == 'zip' else 'pkl'}"
    local.write_bytes(data)
    url = http_server.put(local.name, data)
    assert verdict(run_cli, url) == verdict(run_cli, str(local))
    assert not canary.exists()


@pytest.mark.parametrize("path", BENIGN, ids=[p.name for p in BENIGN])
def test_a_benign_file_over_https_stays_clean(path: Path, http_server: Any,
                                              run_cli: Any) -> None:
    if path.is_dir():
        pytest.skip("a folder: HTTPS has no listing")
    url = http_server.put(path.name, path.read_bytes())
    assert verdict(run_cli, url) == verdict(run_cli, str(path))
