"""``ckptool verify``: is a checkpoint whole, in every layout; the command
and its JSON report (the text view: ``verify_text.py``).

The structure and CRC checks (``ckptool.check.verify.structure``), then, as
asked: the checkpoint against a manifest written before (``--manifest``),
every tensor's values (``--values``), and a new manifest written once
nothing is wrong (``--write-manifest``); a Hugging Face cache snapshot
against the Hub's listing of its commit (``--against-hub``:
``ckptool.check.verify.hubsnapshot``). Exit 0 when whole, 1 when a
problem was found, 2 on a usage error, 3 when the input cannot be read at
all. Under torchrun or srun, or with ``--workers N``, every process checks
its share of the bytes and rank 0 reports (``_spread``,
``ckptool.check.verify.spread``). A URL is checked by one process, from
its structure alone unless ``--full`` (``ckptool.check.verify.remotebytes``).

``verify_dict`` is the ``--json`` schema.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from ckptool.check.verify.problems import NOT_READ, Report
from ckptool.cli.common import SCHEMA_VERSION, one_shot, write_json
from ckptool.cli.inputs import InputPath, is_spooled, shown_path
from ckptool.errors import EXIT_FINDINGS, EXIT_OK

if TYPE_CHECKING:
    from ckptool.check.verify.hfcache import Snapshot
    from ckptool.check.verify.hubsnapshot import Listed


@click.command()
@click.argument("path", type=InputPath())
@click.option("--full", is_flag=True,
              help="A URL: read every byte once, streamed (zip records against their CRC-32, "
                   "Hub files against their sha256). Without it a URL's structure is checked "
                   "and its tensor bytes are not read. A local file's are always read.")
@click.option("--against-hub", is_flag=True,
              help="A Hugging Face cache snapshot (models--org--name/snapshots/<commit>, or "
                   "models--org--name): compare it with the Hub's listing of that commit "
                   "(every file there and nothing else, sizes, LFS sha256s, git blob ids), "
                   "without downloading any file.")
@click.option("--values", "read_values", is_flag=True,
              help="Also read every tensor once: NaN and Inf, all-zero tensors, and tensors "
                   "identical to another that nothing ties.")
@click.option("--manifest", "against", metavar="FILE",
              type=click.Path(exists=True, dir_okay=False),
              help="Check against a manifest written before (--write-manifest): every file "
                   "and tensor that differs.")
@click.option("--write-manifest", "write_to", metavar="FILE", type=click.Path(dir_okay=False),
              help="Write the checkpoint's manifest (the sha256 of each file, a digest of "
                   "each tensor) to FILE, once nothing is found wrong.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), metavar="N",
              help="Threads checking files at once (default: one per CPU).")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="Check on N processes of this machine, each its share of the bytes "
              "(started as torchrun would). Under torchrun or srun, verify uses the "
              "processes it was started in.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--quiet", "-q", is_flag=True,
              help="Print nothing: the exit code says it (0 whole, 1 problems, 2 usage, "
                   "3 unreadable).")
def verify(path: str, full: bool, against_hub: bool, read_values: bool, against: str | None,
           write_to: str | None, jobs: int | None, workers: int | None, as_json: bool,
           quiet: bool) -> int:
    """Check that a checkpoint is whole: every file its layout names, with
    the size it implies; chunks and shards that cover every tensor once;
    zip records against their CRC-32; pickles and headers that parse; a
    Hugging Face cache's blobs against their names (with --against-hub,
    the snapshot against the Hub's files at its commit). Exits 0 when
    whole, 1 when a problem was found, 2 on a usage error (a bad option, a --manifest
    that is no ckptool manifest), 3 when it cannot be read. Under torchrun
    or srun, or with --workers N, on many processes. PATH may be a URL
    (hf://, s3://, gs://, https://): its structure is checked without
    reading its tensor bytes, or every byte with --full."""
    from ckptool.check.verify import hfcache
    from ckptool.check.verify.structure import check, default_jobs
    from ckptool.write.distributed import world

    launch = world.detect()
    given, jobs = jobs, jobs or default_jobs()
    hub = None
    # (--against-hub asks again for the digests the cache check computed: each blob read once)
    remembered = hfcache.remembered() if against_hub else contextlib.nullcontext()
    with one_shot(), remembered:
        if launch is not None or workers is not None:  # on many processes
            spread = _spread(launch, path, workers, given,
                             (read_values, against, write_to, against_hub), as_json, quiet)
            if spread is None:  # a rank other than 0: rank 0 reports
                return EXIT_OK
            report = spread
        else:
            # the Hub asked first: unreachable, it is said before any blob is hashed
            listed = _hub_listing(path) if against_hub else None
            report = check(path, jobs, full=full)
            if listed is not None:
                hub = _against_hub(report, *listed, jobs)
        if is_spooled(path):  # standard input: its file is named as given
            _as_given(report, path)
        if against is not None:
            _against(report, against, jobs)
        if read_values:
            _values(report, jobs)
        if write_to is not None:
            _write(report, write_to, jobs)
        report.remote = _remote(path, full or against is not None or write_to is not None)
        if report.remote is not None and report.remote["bytes_read"]:  # hashed for a manifest
            report.notes = [n for n in report.notes if not n.startswith(NOT_READ)]
    if quiet:
        pass
    elif as_json:
        write_json(verify_dict(report, hub))
    else:
        from ckptool.cli.common import console
        from ckptool.cli.verify_text import render_verify

        render_verify(console(), report, hub)
    return EXIT_OK if report.ok else EXIT_FINDINGS


command = verify


def _spread(launch: Any, path: str, workers: int | None, jobs: int | None,
            alone: tuple[bool, str | None, str | None, bool], as_json: bool,
            quiet: bool) -> Report | None:
    """``verify`` on many processes (``ckptool.check.verify.spread``): the
    report on rank 0; None on the others, and after ``--workers``, whose
    exit code is rank 0's (``click.exceptions.Exit``). A mistake on the
    command line is said by rank 0 alone."""
    from ckptool.check.verify.spread import verify_share
    from ckptool.check.verify.structure import default_jobs
    from ckptool.errors import EXIT_INTERRUPTED, EXIT_USAGE, CkptoolError, UsageError
    from ckptool.read import fs
    from ckptool.write.distributed import world

    refused = None
    if launch is not None and workers is not None and workers != launch.size:
        refused = UsageError(f"--workers {workers} under {launch.launcher}, which started "
                             f"{launch.size} process(es)",
                             "leave --workers out: verify uses the processes it was started in")
    elif any(alone):
        refused = UsageError("--values, --manifest, --write-manifest and --against-hub are "
                             "not run on many processes yet", "run them on one process for "
                             "now (without "
                             "--workers, or with CKPTOOL_DISTRIBUTED=0 under a launcher)")
    elif is_spooled(path):
        refused = UsageError("standard input is verified by one process",
                             "leave --workers out, or verify the file itself")
    elif "://" in path and fs.is_remote(path):
        refused = UsageError("a URL is verified by one process",
                             "leave --workers out (or set CKPTOOL_DISTRIBUTED=0 under a "
                             "launcher)")
    if refused is not None:
        if launch is not None and launch.rank != 0:  # said once, by rank 0
            raise click.exceptions.Exit(EXIT_USAGE)
        raise refused
    if launch is None:
        from ckptool.write.distributed.launch import run_workers

        assert workers is not None
        each = jobs or max(1, default_jobs() // workers)  # the machine's CPUs shared out
        argv = [*(["--traceback"] if "--traceback" in sys.argv else []), "verify", path,
                "--jobs", str(each),
                *[flag for flag, on in (("--json", as_json), ("--quiet", quiet)) if on]]
        try:
            code = run_workers(workers, argv)
        except KeyboardInterrupt:  # the workers' rank 0 said it
            code = EXIT_INTERRUPTED
        raise click.exceptions.Exit(code)
    joined = world.join(launch)
    try:
        return verify_share(joined, path, jobs or default_jobs())
    except CkptoolError as exc:
        if joined.rank != 0:  # posted for rank 0 to say
            raise click.exceptions.Exit(exc.exit_code) from exc
        raise
    finally:
        joined.close()


def _hub_listing(path: str) -> tuple[Snapshot, Listed] | None:
    """The cache snapshot ``path`` is (or is in) and the Hub's listing of
    its commit; a path that is no cache snapshot is a usage error, one that
    is not there is left for the check to say (exit 3)."""
    from ckptool.check.verify import hfcache, hubsnapshot
    from ckptool.errors import UsageError
    from ckptool.read import fs

    remote = "://" in path and fs.is_remote(path)
    if not remote and not is_spooled(path) and not os.path.lexists(path):
        return None
    snapshot = None if remote or is_spooled(path) else hfcache.locate(path)
    if snapshot is None:
        raise UsageError(f"--against-hub: {shown_path(path)} is not in a Hugging Face cache "
                         "snapshot", "give a snapshot's folder (~/.cache/huggingface/hub/"
                         "models--org--name/snapshots/<commit>) or its models--org--name folder"
                         + ("; a URL is read from its store already: verify --full URL"
                            if remote else ""))
    return snapshot, hubsnapshot.listing(snapshot)


def _against_hub(report: Report, snapshot: Snapshot, listed: Listed,
                 jobs: int) -> dict[str, Any]:
    """The snapshot against the Hub's listing (``hubsnapshot.compare``):
    its problems added to the report (a file the checks found missing
    already is said once); the JSON's ``hub`` object."""
    from ckptool.check.verify.hubsnapshot import compare
    from ckptool.check.verify.problems import MISSING_FILE

    problems, hub, hashed = compare(snapshot, listed, jobs)
    said = {p.file for p in report.problems if p.kind == MISSING_FILE}
    report.problems += [p for p in problems if not (p.kind == MISSING_FILE and p.file in said)]
    report.bytes_checked += hashed
    report.checks.append("hub")
    return hub


def _as_given(report: Report, path: str) -> None:
    temp, given = os.path.basename(path), shown_path(path)
    report.problems = [replace(p, file=given) if p.file == temp else p for p in report.problems]
    report.files = [{**f, "name": given} if f["name"] == temp else f for f in report.files]


def _against(report: Report, manifest_path: str, jobs: int) -> None:
    from ckptool.check.verify import manifest

    ckpt = report.checkpoint
    if ckpt is not None:
        report.problems += manifest.check_manifest(ckpt, manifest_path, jobs,
                                                   notes=report.notes)
    else:  # what can be said of files that do not open together
        from ckptool.read import fs

        root = report.path if fs.isdir(report.path) else fs.dirname(report.path)
        report.problems += manifest.check_files(root or ".", manifest_path, jobs)
    report.checks.append("manifest")
    report.manifest = {"checked": manifest_path}
    # checked against a manifest: the bytes no checksum covers were covered
    report.notes = [n for n in report.notes if "shows only against a manifest" not in n]


def _values(report: Report, jobs: int) -> None:
    from ckptool.check.verify.values import check_values

    if report.checkpoint is None:
        report.notes.append("values not read: the checkpoint cannot be read whole")
        return
    problems, summary = check_values(report.checkpoint, jobs)
    report.problems += problems
    report.values = summary
    report.checks.append("values")


def _write(report: Report, dest: str, jobs: int) -> None:
    from ckptool.check.verify.manifest import write_manifest

    if not report.ok or report.checkpoint is None:
        report.notes.append(f"no manifest written to {dest}: a manifest records a checkpoint "
                            "found whole")
        return
    written = write_manifest(report.checkpoint, dest, jobs)
    report.manifest = {"written": dest, "files": len(written.get("files", {})),
                       "tensors": len(written.get("tensors", {}))}


def _remote(path: str, read: bool) -> dict[str, Any] | None:
    """What verifying a URL asked of its store (None: a local path), and
    whether its bytes were read (``--full``, a manifest's hashes)."""
    if "://" not in path:
        return None
    from ckptool.read import fs
    from ckptool.read.remote import counts

    return {**counts.snapshot().as_json(), "bytes_read": read} if fs.is_remote(path) else None


def verify_dict(report: Report, hub: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` report (``remote``: only for a URL; ``hub``: only
    with ``--against-hub``)."""
    remote = {"remote": report.remote} if report.remote is not None else {}
    remote.update({"hub": hub} if hub is not None else {})
    return {
        "schema_version": SCHEMA_VERSION,
        "input": shown_path(report.path),
        "layout": report.layout,
        "ok": report.ok,
        "files": report.files,
        "tensors": report.tensors,
        "bytes_checked": report.bytes_checked,
        "checks": report.checks,
        "problems": [p.as_dict() for p in report.problems],
        "notes": report.notes,
        "values": report.values,
        "manifest": report.manifest,
        **remote,
    }
