"""Fill the demo's wheel folder: a CPU build of torch, numpy and what they need (`bash .ci/setup --demo`).

The demo's node has no package index, so `dfo demo` copies this folder onto it. The wheels are for
the python3 the node runs (the first python3 on root's standard PATH, as sshd gives it). torch must
be a CPU build: PyPI's torch for Linux is a CUDA build of several GB. Where it comes from, first
that works:

1. PyTorch's CPU index, https://download.pytorch.org/whl/cpu (or $DFO_TORCH_INDEX), when it answers
   within 5 s; numpy and torch's own dependencies come from pip's usual index.
2. A torch-<version>+cpu wheel that pip already finds without an index (its find-links, e.g. a
   machine's local wheel cache, or the folder itself, where one may copy wheels fetched elsewhere);
   the rest as above.
3. Neither: exit 3 with what to do. Nothing large is fetched behind your back.

Says what it fetches and how big, before and after. A folder that is complete for this python
(its .complete stamp) is left alone. Standard library only; run with the venv's python (its pip).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

TORCH = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # sshd's PATH for root
TORCH_MB = 190   # torch 2.13.0+cpu for x86_64 Linux (cp311: 183 MiB)
OTHERS_MB = 30   # numpy and torch's dependencies (sympy, networkx, jinja2, fsspec, ...): 27 MB for cp311


def say(msg: str) -> None:
    print(f"setup: {msg}", flush=True)


def mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def node_python() -> tuple[str, str]:
    """(path, "X.Y") of the python3 that the demo's node runs."""
    exe = shutil.which("python3", path=NODE_PATH)
    if exe is None:
        raise SystemExit("setup: no python3 on " + NODE_PATH + " for the demo's node (apt-get install python3)")
    r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                       capture_output=True, text=True, timeout=60)
    return exe, r.stdout.strip()


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout) as r:
            return int(r.status) < 400
    except urllib.error.HTTPError as exc:
        return exc.code < 400
    except (OSError, ValueError):
        return False


def pip_download(dest: Path, pyver: str, reqs: list[str], *extra: str) -> int:
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
            "--python-version", pyver, "-d", str(dest), *extra, *reqs]
    return subprocess.run(argv).returncode


def summary(dest: Path) -> str:
    wheels = sorted(dest.glob("*.whl"), key=lambda p: -p.stat().st_size)
    total = sum(p.stat().st_size for p in wheels)
    top = ", ".join(f"{p.name.split('-')[0]} {mb(p.stat().st_size)}" for p in wheels[:2])
    rest = len(wheels) - 2
    return f"{dest}: {len(wheels)} wheels, {mb(total)} ({top}{f', {rest} more' if rest > 0 else ''})"


def main(argv: list[str]) -> int:
    dest = Path(argv[1] if len(argv) > 1 else ".cache/demo-wheels")
    exe, pyver = node_python()
    stamp = dest / ".complete"
    if stamp.is_file() and stamp.read_text().strip() == pyver and any(dest.glob(f"torch-{TORCH}+cpu-*.whl")):
        say(f"the demo's wheels are there for the node's Python {pyver}: {summary(dest)}")
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    index = os.environ.get("DFO_TORCH_INDEX", CPU_INDEX).rstrip("/")
    reqs = [f"torch=={TORCH}+cpu", "numpy"]
    if reachable(index + "/torch/"):
        say(f"downloading the demo's wheels for the node's Python {pyver} ({exe}): torch {TORCH}, CPU build "
            f"(about {TORCH_MB} MB), from {index}; numpy and torch's dependencies (about {OTHERS_MB} MB) "
            "from your package index")
        rc = pip_download(dest, pyver, reqs, "--extra-index-url", index)
    else:
        say(f"PyTorch's CPU index {index} did not answer within 5 s; looking for a local torch {TORCH}+cpu "
            "wheel (pip's find-links)")
        probe = pip_download(dest, pyver, [reqs[0]], "--no-index", "--no-deps", "-q", "--find-links", str(dest))
        if probe != 0:
            print(f"""setup: no CPU build of torch {TORCH} for Python {pyver} can be had here, so the demo cannot run.
  PyTorch's CPU index ({index}) is unreachable and pip finds no local torch-{TORCH}+cpu wheel.
  (PyPI's torch is a CUDA build of several GB; the demo's node needs none of it.) Do one of:
  - where download.pytorch.org answers, run
      pip download --only-binary=:all: --python-version {pyver} --platform manylinux_2_28_{platform.machine()} \\
        --extra-index-url {CPU_INDEX} -d demo-wheels 'torch=={TORCH}+cpu' numpy
    copy demo-wheels/*.whl into {dest.resolve()}/ and run: bash .ci/setup --demo
  - point pip at a folder that holds the wheel: PIP_FIND_LINKS=/that/folder bash .ci/setup --demo
  - or at a mirror of PyTorch's CPU index: DFO_TORCH_INDEX=https://mirror/whl/cpu bash .ci/setup --demo""",
                  file=sys.stderr)
            return 3
        local = sorted(dest.glob(f"torch-{TORCH}+cpu-*.whl"))
        say(f"took {local[0].name} ({mb(local[0].stat().st_size)}) from a local folder, nothing downloaded for it; "
            f"numpy and torch's dependencies (about {OTHERS_MB} MB) come from your package index")
        rc = pip_download(dest, pyver, reqs, "--find-links", str(dest))
    if rc != 0:
        print(f"setup: pip download of the demo's wheels failed (exit {rc}); see above", file=sys.stderr)
        return 3
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(pyver + "\n")
    tmp.replace(stamp)
    say(f"the demo's wheels: {summary(dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
