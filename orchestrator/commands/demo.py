"""dfo demo: the whole job on a throwaway node and S3 endpoint on this machine."""

from __future__ import annotations

import io
import os
import shlex
import signal
import tarfile
import tempfile
import time
from pathlib import Path

import click
import yaml

from ..cli_common import err_console
from ..demo_data import write_data, write_model
from ..errors import ConfigError, HostError
from .up import up_cmd

PROJECT = Path(__file__).resolve().parents[2]
DEFAULT_WHEELS = PROJECT / ".cache" / "demo-wheels"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _say(msg: str) -> None:
    err_console.print(f"[bold magenta]demo:[/] {msg}", highlight=False, soft_wrap=True)


def _upload_wheels(tb: object, node: object, wheels: Path) -> None:
    """Copy the wheel folder onto the node over SSH (the node has no package index)."""
    import subprocess

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(wheels.glob("*.whl")):
            tar.add(p, arcname=p.name)
    argv = tb.ssh_argv(node, "rm -rf /root/dfo-wheels && mkdir -p /root/dfo-wheels && tar -xf - -C /root/dfo-wheels")  # type: ignore[attr-defined]
    r = subprocess.run(argv, input=buf.getvalue(), capture_output=True, timeout=300)
    if r.returncode != 0:
        raise HostError(f"could not copy the demo's wheels to the node: {r.stderr.decode()[-300:]}")


def demo_job(workdir: Path, endpoint: str, steps: int) -> Path:
    """jobs/demo.yaml with the throwaway endpoint filled in, written beside the testbed."""
    src = PROJECT / "jobs" / "demo.yaml"
    doc = yaml.safe_load(src.read_text())
    doc["s3"]["endpoint_url"] = endpoint
    doc["run"]["upload"] = [str((src.parent / u).resolve()) for u in doc["run"]["upload"]]
    doc["run"]["command"] = doc["run"]["command"].replace("--max-steps 200", f"--max-steps {steps}")
    out = workdir / "demo.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


@click.command("demo")
@click.option("--keep", is_flag=True, help="Leave the node and S3 endpoint up (until Ctrl-C) and print how to reach them.")
@click.option("--wheels", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_WHEELS,
              show_default=True, help="Wheel folder for the node's venv (CPU torch); `bash .ci/setup --demo` fills it.")
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Training steps.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the testbed keeps its files (default: a new temporary folder).")
@click.pass_context
def demo_cmd(ctx: click.Context, keep: bool, wheels: Path, steps: int, workdir: Path | None) -> int:
    """Run dfo's main job end to end on a throwaway node on this machine.

    Starts a node (a network namespace with its own sshd, /dev/shm and /workspace) and an S3
    endpoint (SeaweedFS), puts a small tokenized dataset and a small target model into the
    bucket, then runs `dfo up` with jobs/demo.yaml: provision (a venv with CPU torch, every
    install verified), stage-model (S3 -> /dev/shm), sync-data (S3 -> /workspace), launch, and
    tail until training ends. Then it tears everything down, unless --keep. Needs root (for
    the node's namespaces), sshd, and the wheels from `bash .ci/setup --demo`.
    """
    from ..testbed import Testbed

    if not any(wheels.glob("torch-*.whl")):
        raise ConfigError(f"no torch wheel in {wheels}", hint="run: bash .ci/setup --demo (it fills .cache/demo-wheels)")
    missing = Testbed.missing_requirements(s3=True)
    if missing:
        raise ConfigError("the demo cannot start a throwaway node here: " + "; ".join(missing))
    wd = workdir or Path(tempfile.mkdtemp(prefix="dfo-demo-"))
    wd.mkdir(parents=True, exist_ok=True)
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
        _upload_wheels(tb, node, wheels)
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
    finally:
        if not keep:
            tb.stop()
            _say("node and S3 endpoint stopped")


COMMANDS = [demo_cmd]
