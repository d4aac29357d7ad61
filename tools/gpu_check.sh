#!/usr/bin/env bash
# The CUDA paths proved on a real GPU (run by hand on a machine with one;
# CI has none): load a fixed file onto cuda:0, CUDA_VISIBLE_DEVICES
# renumbering, ckptool.load / load_state_dict onto cuda:0, framework folders.
# Usage: bash tools/gpu_check.sh   (from the repository root; python3 has torch+CUDA)
set -u
PY=${PY:-python3}
export PYTHONPATH=$PWD NO_COLOR=1 COLUMNS=100
ck() { echo "\$ ckptool $*"; $PY -m ckptool "$@"; echo "[exit $?]"; }
W=$(mktemp -d)
cp samples/dataparallel_cuda2.pth "$W/"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
ck devices
ck devices samples/dataparallel_cuda2.pth
ck diagnose "$W/dataparallel_cuda2.pth" --model samples/make_samples.py:TinyNet
cmd=$($PY -m ckptool diagnose --json "$W/dataparallel_cuda2.pth" --model samples/make_samples.py:TinyNet \
  | $PY -c 'import json,sys; print(json.load(sys.stdin)["fix_command"])')
echo "\$ $cmd"; eval "$PY -m ckptool ${cmd#ckptool }"; echo "[exit $?]"
$PY - "$W" <<'PY'
import sys, torch
W = sys.argv[1]
try:
    torch.load(f"{W}/dataparallel_cuda2.pth", weights_only=False)
    print("original: plain torch.load worked (unexpected)")
except RuntimeError as e:
    print("original: plain torch.load fails:", str(e).splitlines()[0][:120])
fixed = [p for p in __import__("os").listdir(W) if "fixed" in p][0]
sd = torch.load(f"{W}/{fixed}")  # weights_only=True, no map_location
print("fixed:", fixed, {str(t.device) for t in sd.values()}, len(sd), "tensors")
sys.path.insert(0, "samples")
from make_samples import TinyNet
net = TinyNet().cuda()
print("strict load into TinyNet on cuda:0:", net.load_state_dict(sd, strict=True))
import ckptool
ref = ckptool.load_state_dict(f"{W}/dataparallel_cuda2.pth", model=TinyNet(), map_location="cpu")
got = ckptool.load_state_dict(f"{W}/dataparallel_cuda2.pth", model=TinyNet(), map_location="cuda:0")
print("load_state_dict cuda:0:", {str(t.device) for t in got.values()},
      all(torch.equal(ref[k], got[k].cpu()) for k in ref))
obj = ckptool.load(f"{W}/{fixed}", map_location="cuda:0")
print("ckptool.load cuda:0:", {str(t.device) for t in obj.values()})
for folder in ["llama_tied_bin_sharded", "trainer_checkpoint/checkpoint-2", "peft_lora"]:
    p = f"tests/fixtures/frameworks/{folder}"
    a = ckptool.load_state_dict(p, map_location="cuda:0"); b = ckptool.load_state_dict(p)
    print(folder, {str(t.device) for t in a.values()}, all(torch.equal(a[k].cpu(), b[k]) for k in b))
PY
echo "--- CUDA_VISIBLE_DEVICES renumbering"
CUDA_VISIBLE_DEVICES="" ck diagnose samples/dataparallel_cuda2.pth
CUDA_VISIBLE_DEVICES=0 ck devices
CUDA_VISIBLE_DEVICES=GPU-nonexistent ck devices
CUDA_VISIBLE_DEVICES=0 ck devices --device-ids 0,1
CUDA_VISIBLE_DEVICES=0 ck explain "RuntimeError: Attempting to deserialize object on CUDA device 2 but torch.cuda.device_count() is 1." --checkpoint samples/dataparallel_cuda2.pth
rm -rf "$W"
