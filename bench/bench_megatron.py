"""Memory of ``ckptool convert`` on a Megatron-core ``torch_dist`` checkpoint
(issue 37), against torch's own ``dcp_to_torch_save``, measured in one run.

Run with the project's interpreter from the repository root, after
``make .venv/.installed``::

    .venv/bin/python bench/bench_megatron.py [--quick] [--keep] [--runs N] [--source]

The checkpoint: a GPT's weights laid out as Megatron-core saves them under
TP 2 x PP 2 (4 ranks under ``torchrun``, gloo, each a DTensor over a 2 x 2
mesh: the layers stacked on a leading axis, split over the pipeline stages;
column-parallel weights split on their rows, row-parallel ones on their
columns, the vocabulary on its rows), written by ``torch.distributed.checkpoint``,
with Megatron's ``metadata.json``, a ``common.pt`` holding the run's ``args``
Namespace, and the tracker file: 8 layers, hidden 1536, GQA 12 heads over 4
groups, SwiGLU 4096, vocabulary 32000: 1.2 GiB, the largest tensor (the
stacked ``linear_fc1``) 384 MiB. ``--quick``: hidden 384, 80 MiB.

Targets:

  (a) ``ckptool convert RUN out.safetensors --unstack-layers``: peak RSS at
      most 2x the largest tensor + 300 MB;
  (b) ``ckptool convert RUN out --map llama`` (a Hugging Face folder): the same.

Beside them, reported: ``dcp_to_torch_save`` (torch's converter, which holds
every tensor at once): its peak RSS and wall time, and each command's wall
time as a ratio of it. The first run of each command is untimed; the two
outputs are checked against the checkpoint's tensors in a child (each layer
of the unstacked file equal to its slab; the map's q/k/v and gate/up equal
to their rows). Inputs live under ``bench/_work/`` (gitignored), deleted at
the end unless ``--keep``. Exit code 0 if both targets pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_inspect import MB, PY, ROOT, WORK, Row, best, check_rc, report, spread
from bench_multifile import (
    Commands,
    bench_arguments,
    child_check,
    ckptool_cmd,
    failure,
    first_runs,
    free_port,
    mb,
    remove,
    timed_rounds,
    warm,
    which_ckptool,
)

RANKS = 4
HEADROOM_MB = 300.0
LAYERS, HEADS, GROUPS, VOCAB = 8, 12, 4, 32000


def sizes(quick: bool) -> tuple[int, int]:
    """(hidden, ffn)."""
    return (384, 1024) if quick else (1536, 4096)


def checkpoint(quick: bool) -> Path:
    return WORK / f"megatron_torch_dist_h{sizes(quick)[0]}"


def largest_bytes(quick: bool) -> int:
    hidden, ffn = sizes(quick)
    return max(LAYERS * 2 * ffn * hidden, VOCAB * hidden) * 4


def worker(out: str, hidden: int, ffn: int) -> None:
    """One rank of TP 2 x PP 2: its DTensor shards saved (run under torchrun)."""
    import argparse as ap
    import json

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    d = hidden // HEADS
    qkv = (HEADS + 2 * GROUPS) * d
    g = torch.Generator().manual_seed(0)

    def full(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    # (pp, tp) placements: layers over the stages, then Megatron's TP split
    stacked = {
        "decoder.layers.input_layernorm.weight": (full(LAYERS, hidden), None),
        "decoder.layers.self_attention.linear_qkv.weight": (full(LAYERS, qkv, hidden), 1),
        "decoder.layers.self_attention.linear_proj.weight": (full(LAYERS, hidden, hidden), 2),
        "decoder.layers.pre_mlp_layernorm.weight": (full(LAYERS, hidden), None),
        "decoder.layers.mlp.linear_fc1.weight": (full(LAYERS, 2 * ffn, hidden), 1),
        "decoder.layers.mlp.linear_fc2.weight": (full(LAYERS, hidden, ffn), 2),
    }
    state = {}
    for key, (value, tp_dim) in stacked.items():
        tp = Shard(tp_dim) if tp_dim is not None else Shard(0)
        placements = [Shard(0), tp] if tp_dim is not None else [Shard(0), Shard(0)]
        state[key] = distribute_tensor(value, mesh, placements)
    flat = init_device_mesh("cpu", (4,))
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[key] = distribute_tensor(full(VOCAB, hidden), flat, [Shard(0)])
    state["decoder.final_layernorm.weight"] = full(hidden)
    folder = Path(out) / "iter_0000100"
    dcp.save(state, checkpoint_id=str(folder))
    if dist.get_rank() == 0:
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                          "sharded_backend_version": 1}))
        args = ap.Namespace(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
            expert_model_parallel_size=1, num_layers=LAYERS, hidden_size=hidden,
            ffn_hidden_size=ffn, num_attention_heads=HEADS, num_query_groups=GROUPS,
            group_query_attention=True, kv_channels=d, swiglu=True, normalization="RMSNorm",
            norm_epsilon=1e-5, position_embedding_type="rope", rotary_base=10000,
            max_position_embeddings=4096, vocab_size=VOCAB, padded_vocab_size=VOCAB,
            untie_embeddings_and_output_weights=True, add_bias_linear=False,
            params_dtype=torch.float32, ckpt_format="torch_dist")
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 100},
                   folder / "common.pt")
        (Path(out) / "latest_checkpointed_iteration.txt").write_text("100")
    dist.destroy_process_group()


def ensure(quick: bool) -> str:
    path = checkpoint(quick)
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return "reused"
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    remove(tmp)
    hidden, ffn = sizes(quick)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           __file__, "--worker", str(tmp), str(hidden), str(ffn)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / "latest_checkpointed_iteration.txt").is_file():
        sys.exit(f"writing the checkpoint failed (exit code {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    tmp.rename(path)
    return "generated"


CHECK = """\
import json, sys
import torch
from safetensors.torch import load_file
src, layers, hf = sys.argv[1], load_file(sys.argv[2]), sys.argv[3]
whole = torch.load(src, weights_only=True)
bad = []
for key, value in whole.items():
    if ".layers." in key and not key.split(".layers.")[1][0].isdigit():
        for i in range(value.shape[0]):
            name = key.replace("layers.", f"layers.{i}.", 1)
            if not torch.equal(layers[name], value[i]):
                bad.append(name)
    elif key in layers and not torch.equal(layers[key], value):
        bad.append(key)
mapped = load_file(hf + "/model.safetensors")
fc1 = whole["decoder.layers.mlp.linear_fc1.weight"]
half = fc1.shape[1] // 2
for i in range(fc1.shape[0]):
    if not (torch.equal(mapped[f"model.layers.{i}.mlp.gate_proj.weight"], fc1[i, :half])
            and torch.equal(mapped[f"model.layers.{i}.mlp.up_proj.weight"], fc1[i, half:])):
        bad.append(f"layer {i} gate/up")
print(json.dumps({"differ": bad[:5], "layers": len(layers), "mapped": len(mapped)}))
"""


def target(quick: bool, rounds: int) -> tuple[list[Row], list[str]]:
    src = checkpoint(quick)
    torch_out = WORK / "megatron_torch.pt"
    layers_out = WORK / "megatron_layers.safetensors"
    hf_out = WORK / "megatron_hf"
    to_torch = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                f"dcp_to_torch_save({str(src / 'iter_0000100')!r}, {str(torch_out)!r})")
    commands: Commands = {
        "dcp_to_torch_save": ([PY, "-c", to_torch], torch_out),
        "unstack": (ckptool_cmd("convert", str(src), str(layers_out), "--unstack-layers",
                                "-q"), layers_out),
        "map": (ckptool_cmd("convert", str(src), str(hf_out), "--map", "llama", "-q"),
                hf_out),
    }

    def check() -> list[str]:
        found = child_check(CHECK, str(torch_out), str(layers_out), str(hf_out))
        if found.get("error") or found.get("differ"):
            return [f"outputs differ from the checkpoint: {found}"]
        return [f"checked: {found['layers']} tensors unstacked, {found['mapped']} mapped, "
                "equal to the checkpoint's"]

    first, notes = first_runs(commands, check)
    broken = [m for name, run in first.items() for m in failure(run, name)]
    if broken or any("differ" in n for n in notes):
        return [Row("(a), (b)", "not timed", "", "", False, broken + notes)], []
    runs = timed_rounds(commands, rounds)
    problems = [p for name in commands for p in check_rc(runs[name], name)]
    base_rss = max(r.maxrss_kb for r in runs["dcp_to_torch_save"])
    largest = largest_bytes(quick)
    limit = 2 * largest / MB + HEADROOM_MB
    rows = [Row("dcp_to_torch_save (torch)", spread(runs["dcp_to_torch_save"]),
                notes=[f"peak RSS {mb(base_rss):.0f} MB"])]
    for label, name in (("(a) convert --unstack-layers", "unstack"),
                        ("(b) convert --map llama", "map")):
        rss = max(r.maxrss_kb for r in runs[name])
        ratio = best(runs[name]) / best(runs["dcp_to_torch_save"])
        rows.append(Row(f"{label} peak RSS", f"{mb(rss):.0f} MB",
                        f"{mb(rss) / mb(base_rss):.2f}x torch's; wall {ratio:.2f}x",
                        f"<= 2 x {largest / MB:.0f} MiB + {HEADROOM_MB:.0f} MB",
                        mb(rss) <= limit and not problems, problems))
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    ap = bench_arguments(__doc__, "an 80 MiB checkpoint", "keep the checkpoint for reruns")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return 0
    rounds = args.runs or (1 if args.quick else 2)
    t0 = time.perf_counter()
    how = ensure(args.quick)
    src = checkpoint(args.quick)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    log = [f"{src.relative_to(ROOT)}: {size / MB:.0f} MiB, torch_dist, TP 2 x PP 2, "
           f"largest tensor {largest_bytes(args.quick) / MB:.0f} MiB ({how})",
           which_ckptool(args.source, "megatron_source")]
    warm(src)
    try:
        rows, checked = target(args.quick, rounds)
    finally:
        for name in ("megatron_torch.pt", "megatron_layers.safetensors", "megatron_hf",
                     "megatron_source"):
            remove(WORK / name)
    notes = ["warm page cache: each command run once untimed (outputs checked) before "
             "timing; each output deleted after its run", *checked]
    code = report(rows, log, [], notes, args.quick, t0, [])
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
