"""dfo sync-code: a thin click command over orchestrator.steps.code."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import click

from remote.lib.fsutil import human_bytes

from ..cli_common import console, emit, err_console, hosts_option, job_option, json_option, safe, session
from ..config.models import load_job
from ..steps.code import CodeReport, push_code, start_local, took_over_line
from .report_view import files, print_moved, print_names

if TYPE_CHECKING:
    from ..transport.base import Transport

_OUT = threading.Lock()


def render(host: str, r: CodeReport, command: str = "sync-code") -> None:
    with _OUT:
        print_moved(host, command, r, verb="sent")
        print_names(r.kept, r.kept_files, "gone here but changed on the node since dfo pushed {them}, not deleted")
        if r.took_over is not None:
            console.print(f"  {safe(took_over_line(r.took_over, r.released))}", soft_wrap=True)


def warn_for(host: str) -> Any:
    def warn(text: str) -> None:
        with _OUT:
            err_console.print(f"[yellow]{safe(host)}[/]: {safe(text)}", soft_wrap=True)
    return warn


def _warm_printer(local: Any) -> None:
    try:
        local.result()
        from ..console import DfoConsole  # noqa: F401 - imported for its import's sake
    except BaseException:  # noqa: BLE001 - the main thread reports (and imports again) on its own
        pass


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
    the tree arrive intact; a symlink pointing outside the tree is refused (exit 2), and so is
    a file with a symlinked folder on its path whose real path leaves the tree (every file is
    read without following links). Files over 100 MB and trees over 10,000 files are warned
    about before they travel.

    The folder on the node belongs to the job that pushed it (its manifest says which). Another
    job's push into it is refused (exit 2, naming both jobs) while that job has a live run; with
    none, the new job takes the folder over: the old job's files are left in place, never
    deleted, and only what the new job pushes is ever deleted by it later.

    \b
    Exit codes: 0 done (or nothing to do); 2 bad job file, a refused symlink or code.dest,
    or the folder is another job's with a live run; 3 a check failed on the node; 4 the node
    could not be reached.
    """
    loaded = load_job(job_path)
    # a bad code: section is exit 2 before any host is touched; the files here are listed and
    # hashed in a thread while the SSH layer is imported and the hosts connect
    local = start_local(loaded)
    if not as_json:  # the report's printer (rich), imported while this waits on the network
        threading.Thread(target=_warm_printer, args=(local,), daemon=True).start()
    with session(ctx, hosts) as s:
        def one(conn: Transport) -> CodeReport:
            return push_code(conn, loaded, warn=warn_for(conn.name), note=lambda _t: None, local=local)

        outcomes = s.each(one)
    return emit(outcomes, as_json, lambda r: r.to_json(), render)



def render_pull(host: str, r: Any) -> None:
    with _OUT:
        if r.status == "no change":
            same = r.files_total - r.kept - getattr(r, "refused", 0) - r.changed
            what = (f"{files(r.files_total)} ({human_bytes(r.bytes_total)})" if same == r.files_total
                    else f"{files(same)} of {r.files_total}")
            console.print(f"{safe(host)}: pull: [dim]no change[/]: {what} "
                          f"in {safe(r.dest)} match {safe(r.source)} of run {safe(r.run)} ({r.seconds:.2f}s)",
                          soft_wrap=True)
        else:
            console.print(f"{safe(host)}: pull: [green]done[/]: {safe(r.source)} (run {safe(r.run)}) -> {safe(r.dest)}",
                          soft_wrap=True)
            console.print(f"  fetched {files(r.fetched)} ({human_bytes(r.bytes)}"
                          + (f", {r.resumed} resumed" if r.resumed else "") + f"), skipped {r.skipped}, "
                          f"in {r.seconds:.1f}s = {r.mb_per_s:.1f} MB/s; verified: sha256 {r.fetched}", soft_wrap=True)
        if r.changed:
            console.print(f"  {r.changed} file{'s' if r.changed != 1 else ''} changed on the node while being pulled, "
                          f"not fetched (pull again): {safe(', '.join(r.changed_files))}", soft_wrap=True)
        if r.links_skipped:
            console.print(f"  {r.links_skipped} symlink{'s' if r.links_skipped != 1 else ''} not pulled",
                          soft_wrap=True)
        print_names(r.kept, r.kept_files, "kept here, not replaced: not written by dfo pull or changed since "
                                          "(--overwrite replaces those), or behind a symlink or in a folder's place")
        refused = getattr(r, "refused", 0)
        if refused:
            more = f" and {refused - len(r.refused_files)} more" if refused > len(r.refused_files) else ""
            console.print(f"  {refused} name{'s' if refused != 1 else ''} with a .git component refused "
                          f"(dfo pull never writes into .git): {safe(', '.join(r.refused_files))}{more}",
                          soft_wrap=True)


@click.command("pull")
@hosts_option
@click.argument("run", required=False)
@click.argument("paths", nargs=-1, metavar="[PATH]...")
@click.option("--to", "to", metavar="DIR",
              help="Write into DIR itself (default ./runs/RUN/); with several hosts, into DIR/HOST/.")
@click.option("--overwrite", is_flag=True,
              help="Replace files in DIR that dfo pull did not write, or that changed here since it wrote them "
                   "(by default they are kept, and named). Never .git, a folder, or anything behind a symlink.")
@job_option(required=False)
@json_option
@click.pass_context
def pull_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, paths: tuple[str, ...], to: str | None,
             overwrite: bool, job_path: str | None, as_json: bool) -> int:
    """Copy a run's files from the node to this machine, verified (default ./runs/RUN/).

    RUN is a run id or its unique prefix (default: the newest run, of the job with -j). The
    files are those under the run's outputs.path (as its record on the node says, or the
    job's with -j), else under the run's workdir; PATH... (relative to that folder) narrows them.

    With several hosts (a gang's ranks share one run id) each gets its own folder,
    ./runs/RUN/HOST/ (or DIR/HOST/). One pull at a time writes into a folder (a lock in
    DIR/.dfo/lock); a second one is refused at once (exit 3), naming the folder.

    The node is not trusted: the run id it reports must look like a run id and be the RUN
    asked for; a name it lists must stay inside DIR, and one with a .git component is refused
    (not pulled, named in the report); a file's bytes may not pass its listed size (the
    transfer stops at once). Each file lands in DIR/.dfo/partial/ first, is read back from
    disk and checked against its listed size and the sha256 the node computed as it read
    it, then renamed into place. A file here that no earlier pull wrote (as
    DIR/.dfo/pull-manifest.json lists them), or that changed since, is kept unless
    --overwrite; nothing is written through a symlinked folder inside DIR. Files already
    here as an earlier pull left them, and unchanged on the node, are skipped. An
    interrupted pull keeps its partial files: the next one fetches only the rest. Names
    starting with .dfo are never pulled; symlinks on the node are not followed (and not
    pulled).

    \b
    Exit codes: 0 done (or nothing to do; kept and refused files are named);
    2 bad usage (no such run or PATH); 3 the node's run id, names or bytes failed a check
    (nothing of that file kept), another pull holds the folder, or a local error (disk full,
    permission: the error names the path); 4 the node could not be reached.
    """
    from ..steps.pull import pull
    from ..steps.transfer import ProgressView

    loaded = load_job(job_path) if job_path else None
    with session(ctx, hosts) as s, ProgressView(console, enabled=not as_json) as view:
        per_host = len(s.names) > 1
        outcomes = s.each(lambda conn: pull(conn, run=run, paths=list(paths), to=to, loaded=loaded,
                                            on_event=view.callback(conn.name), per_host=per_host,
                                            overwrite=overwrite))
    return emit(outcomes, as_json, lambda r: r.to_json(), render_pull)


COMMANDS = [sync_code, pull_cmd]
