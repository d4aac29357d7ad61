"""``ckptool convert``: any layout into any other (one torch file, one
safetensors file, a Hugging Face directory of shards, a DCP directory), and
TorchScript archives and plain pickles into torch files; the command and
its JSON report (the text view: ``fix_text.py``, beside fix's).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from ckptool.cli.common import SCHEMA_VERSION, console, fsync_help, progress, write_json
from ckptool.cli.inputs import InputPath
from ckptool.errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError

if TYPE_CHECKING:
    from ckptool.write.convert.run import ConvertResult


class _Command(click.Command):
    """convert's command: run by every process of a launch, whose usage
    errors rank 0 alone says (the others exit 2 without a word)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _quiet_rank(None, exc)
            raise


def _quiet_rank(err: UsageError | None, cause: BaseException) -> None:
    """Exit 2 without a word when rank 0 says the usage error ``err`` (None:
    one of the command line): this process is another rank of a launch."""
    from ckptool.write.distributed import world

    if world.quiet_rank(err):
        raise click.exceptions.Exit(EXIT_USAGE) from cause


@click.command(cls=_Command)
@click.argument("path", type=InputPath())
@click.argument("output", metavar="OUT", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["hf", "hf-bin", "dcp"]),
              help="Write OUT as a directory: hf (safetensors shards + "
              "model.safetensors.index.json; the default for a name without an "
              "extension), hf-bin (torch shards + pytorch_model.bin.index.json), dcp "
              "(torch.distributed.checkpoint).")
@click.option("--max-shard-size", "max_shard", metavar="SIZE", default=None,
              help="Largest shard of --format hf / hf-bin, e.g. 5GB, 500MB (as Hugging Face "
              "means it: a tensor larger than SIZE gets a shard of its own). Default 5GB.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Cast floating-point tensors (as fix --dtype).")
@click.option("--weights", type=click.Choice(["fp32", "module"]), default=None,
              help="Of a DeepSpeed checkpoint: fp32 (the default) writes the consolidated fp32 "
              "master weights; module the weights the model held (bf16/fp16 in such a run; "
              "ZeRO 1 and 2 only).")
@click.option("--unstack-layers", "unstack", is_flag=True,
              help="Of a Megatron torch_dist checkpoint: write each layer stacked on a leading "
              "axis as its own tensor, named as the model names it (decoder.layers.3.…).")
@click.option("--map", "hf_map", metavar="MODEL", default=None,
              help="Of a Megatron GPT checkpoint: write the Hugging Face model MODEL (llama, "
              "gpt2, mixtral, qwen2-moe) with its config.json: its names, q/k/v and "
              "gate/up split, vocabulary padding cut; or the names and cuts a rules file "
              "says (rules.toml, rules.json: docs/megatron.md).")
@click.option("--salvage", is_flag=True,
              help="Write from a file flagged unsafe: its tensors and plain values only, "
                   "the output re-read and refused unless clean.")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="Convert on N processes of this machine, started by torch's elastic "
              "launcher (as torchrun would). Under torchrun or srun, convert uses the "
              "processes it was started in.")
@click.option("--dry-run", is_flag=True,
              help="Show the plan (which process writes which files, how many bytes each "
              "reads and writes) and write nothing; with --workers N, for N processes.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--manifest", "manifest", metavar="FILE", default=None,
              help="Also write OUT's manifest to FILE (as ckptool verify OUT --write-manifest "
              "FILE would). Not with many processes yet.")
@click.option("--fsync", is_flag=True, help=fsync_help("--force"))
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(path: str, output: str, fmt: str | None, max_shard: str | None, dtype: str | None,
            weights: str | None, unstack: bool, hf_map: str | None, salvage: bool,
            workers: int | None, dry_run: bool, force: bool, manifest: str | None,
            fsync: bool, quiet: bool, as_json: bool) -> None:
    """Convert PATH (a file, a Hugging Face directory, a DCP or DeepSpeed directory) into OUT:
    one file (safetensors or torch, from OUT's extension) or a directory
    (--format). Under torchrun or srun, or with --workers N, on many processes."""
    from ckptool.cli.inputs import local_output
    from ckptool.write.convert.run import convert as run_convert

    try:  # a usage error before the processes meet: said by rank 0 alone
        local_output(output, "OUT")
        local_output(manifest, "--manifest")
        options, launch = _settings(fmt, max_shard, dtype, weights, salvage, workers)
        options.update(unstack_layers=unstack, hf_map=hf_map)
        if manifest is not None and not dry_run and (workers is not None or
                                                     launch is not None):
            raise UsageError("--manifest is not written by a conversion on many processes "
                             "yet", "write it after: ckptool verify OUT --write-manifest FILE")
    except UsageError as exc:
        _quiet_rank(exc, exc)
        raise
    if manifest is not None and not dry_run:
        from ckptool.check.verify.outmanifest import check_destination

        check_destination(manifest, output, path)
    if dry_run:
        from ckptool.cli.convert_dist import show_plan

        show_plan(path, output, workers or (launch.size if launch else 1), options,
                  as_json, quiet or (launch is not None and launch.rank != 0))
        return
    if workers is not None and launch is None:
        from ckptool.write.distributed.launch import run_workers

        argv = [*(["--traceback"] if "--traceback" in sys.argv else []), "convert", path, output,
                *[word for flag, value in (("--format", fmt), ("--max-shard-size", max_shard),
                                           ("--dtype", dtype), ("--weights", weights),
                                           ("--map", hf_map))
                  if value is not None for word in (flag, value)],
                *[flag for flag, on in (("--unstack-layers", unstack), ("--salvage", salvage),
                                        ("--force", force),
                                        ("--fsync", fsync), ("--quiet", quiet),
                                        ("--json", as_json)) if on]]
        try:
            code = run_workers(workers, argv, output=output)
        except KeyboardInterrupt:  # the workers' rank 0 said it
            code = EXIT_INTERRUPTED
        raise click.exceptions.Exit(code)
    from ckptool.cli.convert_dist import run_distributed, staged

    if launch is not None or staged(output):
        if manifest is not None:  # a run on many processes left OUT half-written
            raise UsageError("--manifest is not written by a conversion on many processes yet",
                             "write it after: ckptool verify OUT --write-manifest FILE")
        result = run_distributed(launch, path, output, force, fsync, quiet, options)
        if result is None:
            return
    else:
        streams: dict[str, Any] | None = {} if manifest is not None else None
        with progress(quiet) as update:
            result = run_convert(path, output, force=force, progress=update, fsync=fsync,
                                 streams=streams, **options)
    if manifest is not None:
        from ckptool.check.verify.outmanifest import default_jobs, write_for_output

        result.notes.append(write_for_output(result.output, manifest, default_jobs(),
                                             streams)[1])
    if as_json:
        write_json(convert_dict(result, manifest))
    elif not quiet:
        from ckptool.cli.fix_text import render_convert

        render_convert(console(), result)


command = convert


def _settings(fmt: str | None, max_shard: str | None, dtype: str | None, weights: str | None,
              salvage: bool, workers: int | None) -> tuple[dict[str, Any], Any]:
    """The conversion's options, and the launch this process is part of
    (``world.detect``), with the distributed settings checked."""
    from ckptool.write.distributed import world
    from ckptool.write.fix import plan as planning
    from ckptool.write.shards import parse_size

    options: dict[str, Any] = {
        "fmt": fmt, "max_shard_size": parse_size(max_shard) if max_shard is not None else None,
        "dtype": planning.DTYPE_NAMES[dtype] if dtype else None,
        "weights": None if weights == "fp32" else weights, "salvage": salvage}
    launch = world.detect()
    if launch is not None or workers is not None:
        from ckptool.write.distributed.coordinate import lost_after

        lost_after(), world.join_timeout()
    if launch is not None and workers is not None and workers != launch.size:
        raise UsageError(f"--workers {workers} under {launch.launcher}, which started "
                         f"{launch.size} process(es)",
                         "leave --workers out: convert uses the processes it was started in")
    return options, launch


def convert_dict(result: ConvertResult, manifest: str | None = None) -> dict[str, Any]:
    """The ``convert --json`` schema (a ConvertResult from ckptool.write.convert.run);
    ``manifest``: where OUT's manifest was written."""
    return {
        "schema_version": SCHEMA_VERSION,
        "input": result.source.path,
        "input_format": result.source.format,
        "output": result.output,
        "output_format": result.output_format,
        "files": result.files,
        "tensors": result.tensors,
        "aliases": result.aliases,
        "copied_views": result.copied_views,
        "kept_entries": result.kept_entries,
        "left_out": result.left_out,
        "bytes_written": result.bytes_written,
        "notes": result.notes,
        "manifest": manifest,
        **({"distributed": result.distributed} if result.distributed is not None else {}),
    }
