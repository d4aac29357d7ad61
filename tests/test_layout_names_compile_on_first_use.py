"""The name patterns of ``read/layouts/framework.py`` and ``loaders.py``
(~4 ms of ``re`` work) are compiled when a name is first looked up, not by
every run that imports them, and look names up as before."""

from __future__ import annotations

import json
import subprocess
import sys

from ckptool.read.layouts import framework, loaders

PROBE = """
import json, re
compiled = []
for name in ("compile", "_compile"):
    orig = getattr(re, name)
    def wrapped(pattern, *a, _orig=orig, **k):
        compiled.append(getattr(pattern, "pattern", pattern))
        return _orig(pattern, *a, **k)
    setattr(re, name, wrapped)
from ckptool.read.layouts import framework, loaders
def text(p):
    return getattr(p, "pattern", p)
ours = {text(p) for p, _ in framework.ROLES} | {text(p) for _, p in loaders._NAMES}
ours |= {text(framework.OTHER_MODEL), text(framework.LM_HEAD)}
at_import = sorted(ours & {c for c in compiled if isinstance(c, str)})
framework.role_of("optimizer.pt"); loaders.parse("model.safetensors")
print(json.dumps([at_import, len(ours & set(compiled))]))
"""


def test_importing_compiles_none_of_the_name_patterns() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout
    at_import, after_lookup = json.loads(out)
    assert at_import == []
    assert after_lookup > 10  # the probe sees compiles: the lookups made them


def test_names_are_looked_up_as_before() -> None:
    assert framework.role_of("optimizer.pt") == "optimizer state"
    assert framework.role_of("model_1.safetensors") == "model 1 (accelerate's model_1)"
    assert framework.role_of("model_0.safetensors") is None
    assert framework.role_of("weights.npz") is None
    w = loaders.parse("model.fp16-00001-of-00002.safetensors")
    assert w is not None and (w.kind, w.variant, w.ext) == (loaders.SHARD, "fp16", "safetensors")
    i = loaders.parse("pytorch_model.bin.index.json")
    assert i is not None and (i.kind, i.ext) == (loaders.INDEX, "bin")
    assert loaders.parse("model.txt") is None
