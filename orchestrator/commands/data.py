"""dfo sync-data / stage-model: thin click commands over orchestrator.steps.transfer."""

from __future__ import annotations

import inspect
import textwrap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from ..cli_common import (
    console,
    emit,
    exit_code_of,
    hosts_json,
    hosts_option,
    job_option,
    json_option,
    print_json,
    print_outcome,
    session,
)
from ..config.models import LoadedJob, load_job
from ..steps.transfer import ProgressView, TransferReport, What, build_request, transfer
from ..transport.base import Transport
from .report_view import print_moved, print_names

if TYPE_CHECKING:
    from ..hosts import HostSession, Outcome

_OUT = threading.Lock()

COMMON_HELP = """\
    The node fetches the bytes itself (the controller only drives it): objects are listed
    (every page) and compared with a manifest kept beside the data (DEST/.dfo/), so only
    missing or changed objects move. Many objects at once, big ones in ranged parts at once
    (s3.concurrency, s3.part_size_mb, s3.multipart_threshold_mb in the job file). Each file is
    written under a temporary name, its size and content checked (MD5 where the ETag is one,
    the multipart ETag or an S3 checksum otherwise), then renamed: a reader never sees half a
    file. After an interruption (dropped link, killed process) the next run fetches only what
    had not finished. Before any byte moves, the destination filesystem must have room for
    what is missing{margin}, else exit 3 with the numbers.

    Credentials: resolved here by botocore's chain (AWS_* variables, then s3.profile or the
    default profile, SSO, ...) and sent to the node on stdin, never in argv, a process
    listing or a log; none found is exit 2 before any host is touched. With s3.credentials:
    node the node uses its own (AWS_* variables, ~/.aws/credentials, or an EC2 instance
    profile); with s3.credentials: anonymous requests go unsigned (a public bucket).
    s3.endpoint_url and s3.region choose the endpoint (any S3-compatible server works).

    \b
    Exit codes: 0 done (or nothing to do); 2 bad job file, or no S3 credentials found on
    this machine; 3 S3 refused (no such bucket, access denied), a check failed, or the
    destination is full or not writable; 4 the node or the S3 endpoint could not be reached.
    """


def _render(host: str, r: TransferReport, command: str) -> None:
    verified = ", ".join(f"{k} {v}" for k, v in sorted(r.verified.items()))
    with _OUT:
        print_moved(host, command, r,
                    detail=f" = {r.mb_per_s:.1f} MB/s" + (f"; verified: {verified}" if verified else ""))
        # dest safety (docs/data.md): files swapped on the node, files --delete left because they are not dfo's
        print_names(r.changed, r.changed_files, "changed on the node since dfo wrote {them}, fetched again")
        print_names(r.kept, r.kept_files, "changed on the node since dfo wrote {them}, not deleted")


def _run(ctx: click.Context, hosts: tuple[str, ...], job_path: str, as_json: bool, what: What, command: str,
         delete: bool | None = None) -> int:
    loaded = load_job(job_path)
    request = build_request(loaded, what, delete)
    with session(ctx, hosts) as s:
        # each host's report printed as soon as that host is done (a slow host holds nobody back)
        outcomes = run_transfer(s, loaded, what, request, quiet=as_json, on_done=None if as_json else (
            lambda o: print_outcome(o, lambda host, r: _render(host, r, command))))
    if as_json:
        print_json(hosts_json(outcomes, TransferReport.model_dump))
    return exit_code_of(outcomes)


def run_transfer(s: HostSession, loaded: LoadedJob, what: What, request: dict[str, Any], *, quiet: bool,
                 on_done: Callable[[Outcome[TransferReport]], None] | None = None
                 ) -> list[Outcome[TransferReport]]:
    """The transfer on every host of the session, on its one connection (a progress bar on a terminal
    unless ``quiet``); ``on_done(outcome)`` as each host finishes (HostSession.each)."""
    with ProgressView(console, enabled=not quiet) as view:
        def one(conn: Transport) -> TransferReport:
            return transfer(conn, loaded, what, request, on_event=view.callback(conn.name))

        return s.each(one, on_done=on_done)


def render_transfer(outcomes: list[Outcome[TransferReport]], command: str) -> None:
    emit(outcomes, False, TransferReport.model_dump, lambda host, r: _render(host, r, command))


@click.command("sync-data")
@hosts_option
@job_option()
@click.option("--delete/--no-delete", "delete", default=None,
              help="Also remove files under data.dest that the source no longer has (default: the job's "
                   "data.delete, which is off). dfo's own DEST/.dfo/ is never removed.")
@json_option
@click.pass_context
def sync_data(ctx: click.Context, hosts: tuple[str, ...], job_path: str, delete: bool | None, as_json: bool) -> int:
    """Copy the job's data.source (s3://bucket/prefix/) to data.dest on each node.
    """
    return _run(ctx, hosts, job_path, as_json, "data", "sync-data", delete)


@click.command("stage-model")
@hosts_option
@job_option()
@json_option
@click.pass_context
def stage_model(ctx: click.Context, hosts: tuple[str, ...], job_path: str, as_json: bool) -> int:
    """Put the job's model.source at model.dest on each node (normally under /dev/shm).

    \b
    Sources:
      s3://bucket/prefix/      fetched by the node, as sync-data does
      /a/path (or file://...)  a directory already on the node, copied in parallel; each
                               file's CRC32 is checked on the copy read back
      hf://org/name[@rev]      through huggingface_hub, run by the job's venv python (it must
                               be installed there); HF_TOKEN is sent like S3 credentials
    A staged model whose manifest matches the source is left alone ("no change").
    """
    return _run(ctx, hosts, job_path, as_json, "model", "stage-model")


sync_data.help = inspect.cleandoc(sync_data.help or "") + "\n\n" + textwrap.dedent(
    COMMON_HELP.format(margin="")).strip()
stage_model.help = inspect.cleandoc(stage_model.help or "") + "\n\n" + textwrap.dedent(
    COMMON_HELP.format(margin=" plus model.margin_pct (default 5%)")).strip()

COMMANDS = [stage_model, sync_data]
