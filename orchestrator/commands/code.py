"""dfo sync-code: a thin click command over orchestrator.steps.code."""

from __future__ import annotations

import threading
from typing import Any

import click

from remote.fsutil import human_bytes

from ..cli_common import console, emit, err_console, hosts_option, job_option, json_option, safe, session
from ..config import load_job
from ..connection import Connection
from ..steps.code import CodeReport, push_code, resolve

_OUT = threading.Lock()


def render(host: str, r: CodeReport, command: str = "sync-code") -> None:
    with _OUT:
        if r.status == "no change":
            console.print(f"{safe(host)}: {command}: [dim]no change[/]: {r.files_total} files "
                          f"({human_bytes(r.bytes_total)}) in {safe(r.dest)} match {safe(r.source)} "
                          f"({r.seconds:.2f}s)", soft_wrap=True)
        else:
            console.print(f"{safe(host)}: {command}: [green]done[/]: {safe(r.source)} -> {safe(r.dest)}",
                          soft_wrap=True)
            console.print(f"  sent {r.fetched} files ({human_bytes(r.bytes)}), skipped {r.skipped}, "
                          f"deleted {r.deleted}, in {r.seconds:.1f}s", soft_wrap=True)
        if r.kept:
            more = f" and {r.kept - len(r.kept_files)} more" if r.kept > len(r.kept_files) else ""
            console.print(f"  {r.kept} file{'s' if r.kept != 1 else ''} gone here but changed on the node since "
                          f"dfo pushed {'them' if r.kept != 1 else 'it'}, not deleted: "
                          f"{safe(', '.join(r.kept_files))}{more}", soft_wrap=True)


def warn_for(host: str) -> Any:
    def warn(text: str) -> None:
        with _OUT:
            err_console.print(f"[yellow]{safe(host)}[/]: {safe(text)}", soft_wrap=True)
    return warn


@click.command("sync-code")
@hosts_option
@job_option()
@json_option
@click.pass_context
def sync_code(ctx: click.Context, hosts: tuple[str, ...], job_path: str, as_json: bool) -> int:
    """Push the job's code: folder to the node (launch and up do it first).

    In a git work tree the code is what git would commit, as the work tree is now (tracked
    files plus untracked ones .gitignore does not exclude; a file deleted with rm is gone);
    outside git, every file under code.source. Less code.exclude (gitignore-style) and names
    dfo never pushes (.git/, anything starting with .dfo). Only changed files travel, as one
    stream, each checked by sha256 on arrival; a file deleted here is deleted on the node
    only if dfo pushed it and it is unchanged there. The executable bit and symlinks inside
    the tree arrive intact; a symlink pointing outside the tree is refused (exit 2).
    Files over 100 MB and trees over 10,000 files are warned about before they travel.

    \b
    Exit codes: 0 done (or nothing to do); 2 bad job file, a refused symlink or code.dest;
    3 a check failed on the node; 4 the node could not be reached.
    """
    loaded = load_job(job_path)
    resolve(loaded)  # a bad code: section is exit 2 before any host is touched
    with session(ctx, hosts) as s:
        def one(conn: Connection) -> CodeReport:
            return push_code(conn, loaded, warn=warn_for(conn.name), note=lambda _t: None)

        outcomes = s.each(one)
    return emit(outcomes, as_json, lambda r: r.to_json(), render)


COMMANDS = [sync_code]
