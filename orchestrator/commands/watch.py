"""dfo watch: watch a running run of a job with run.spares / run.restarts, and recover it (issue 20).

The watcher holds nothing of its own: what it needs is the run's generation record in S3 (beside
outputs.dest) and the runs on the nodes. The work is orchestrator/steps/recovery.py; this module
loads the job and prints the watcher's lines.
"""

from __future__ import annotations

import click

from ..cli_common import err_console, hosts_option, job_option, safe
from ..config.models import load_job
from ..steps.recovery import Watcher


def say(text: str) -> None:
    err_console.print(safe(text), highlight=False, soft_wrap=True)


def watch(ctx: click.Context, hosts: tuple[str, ...], job_path: str, run: str | None) -> int:
    loaded = load_job(job_path)
    return Watcher(ctx.obj.get("inventory"), loaded, list(hosts), run=run, say=say).run()


@click.command("watch")
@hosts_option
@click.argument("run", required=False)
@job_option()
@click.pass_context
def watch_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, job_path: str) -> int:
    """Watch a running run and recover it: a lost node replaced by a spare, a killed trainer relaunched.

    It watches the run of JOB until it succeeds or fails for good.
    The job needs outputs.dest and run.spares and/or run.restarts (docs/recovery.md). The run is
    found in its generation record, beside outputs.dest in S3 (RUN, when given, must be that
    run: its first id, or its current generation's). A node is lost when it has not answered for
    run.restarts.lost_after seconds (60), or when its gang watch says so; a trainer killed by a
    signal, or ended with an exit code listed in run.restarts.on, is restarted too (under
    launcher: torchrun, a worker killed by a signal counts: torchrun's failure report in the log
    says so). A trainer that fails on its own (exit 1) is not: the run fails, and the spares are
    left alone. A restart stops the old generation wherever it still runs, takes the first healthy
    spare in the lost node's rank (provision, stage-model, sync-data, the gang preflight), and
    launches a new generation that restores the last shipped checkpoint. run.restarts.max and
    backoff hold. With no healthy spare, it looks again every 10 s for 10 minutes
    (DFO_WATCH_SPARE_WAIT_S), saying so each minute, then the run fails (exit 5).

    The watcher keeps nothing that matters in memory: killed in the middle of a recovery and
    started again, it finishes that recovery. Two watchers of one run: the second refuses.
    Ctrl-C stops watching; the run goes on.

    \b
    Exit codes: 0 the run succeeded; 2 bad job file, no generation record, or another watcher
    holds the run; 3 the run succeeded but its last outputs pass failed, or S3 could not be read;
    5 the run failed for good (or was stopped by hand, or no spare came); 130 Ctrl-C.
    """
    return watch(ctx, hosts, job_path, run)


COMMANDS = [watch_cmd]
