"""dfo demo's setup, without its terminal output: where its job and wheels are, the job filled in for a
throwaway endpoint, the wheels copied onto the node, and the disk its folder uses."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import tarfile
from pathlib import Path

import yaml

from .. import cache_dir
from ..errors import HostError

# the demo's job and trainer: package data, so the demo runs from an installed wheel as from a checkout
DEMO_JOB = Path(__file__).resolve().parent / "job" / "demo.yaml"
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
    return cache_dir() / "demo-wheels"


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


def upload_wheels(tb: object, node: object, wheels: Path) -> None:
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


def disk_usage(folder: Path) -> tuple[int, int]:
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
