"""Helpers of remote.env.provision: installers, pkgcheck in a fresh process, records (stdlib only)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

from remote._proto import RESULT_PREFIX, emit_event
from remote._vendor.packaging.requirements import InvalidRequirement, Requirement
from remote.env.pkgcheck import dist_key, first_line
from remote.lib.fsutil import (
    room_problem,
    write_json,  # noqa: F401 - re-exported: the one durable JSON writer
)
from remote.lib.redact import redact, redact_obj  # noqa: F401 - re-exported
from remote.lib.triton_cache import cache_dir as triton_cache_path  # noqa: F401 - re-exported
from remote.lib.triton_cache import dir_size  # noqa: F401 - re-exported

AGENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAIL_CHARS = 3000


def tail(text: str, limit: int = TAIL_CHARS) -> str:
    text = redact(text.strip())
    return text if len(text) <= limit else "..." + text[-limit:]


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class StepFailed(Exception):
    """A step that could not do its job; ``extra`` lands in the step's report."""

    def __init__(self, message: str, hint: str | None = None, kind: str = "verify", **extra: object) -> None:
        Exception.__init__(self, message)
        self.message, self.hint, self.kind, self.extra = message, hint, kind, extra


def pkgcheck(python: str, pins: list, overrides: list, names: list, candidates: list | None = None,
             timeout: float = 300) -> dict:
    """Run remote.env.pkgcheck with ``python`` in a fresh process; return its data."""
    req = json.dumps({"pins": pins, "overrides": overrides, "names": names, "candidates": candidates or []})
    env = dict(os.environ, PYTHONPATH=AGENT_DIR, PYTHONDONTWRITEBYTECODE="1")
    try:
        proc = subprocess.run([python, "-m", "remote.env.pkgcheck"], input=req.encode(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=AGENT_DIR, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StepFailed("cannot run %s to read the venv's packages: %s" % (python, exc)) from None
    for line in reversed(proc.stdout.decode("utf-8", "replace").splitlines()):
        if line.startswith(RESULT_PREFIX):
            doc = json.loads(line[len(RESULT_PREFIX):])
            if doc.get("ok"):
                return doc["data"]
            err = doc.get("error") or {}
            raise StepFailed("%s: %s" % (python, err.get("message")), kind=err.get("kind", "verify"))
    raise StepFailed("%s could not report its packages (exit %d): %s"
                     % (python, proc.returncode, tail(proc.stderr.decode("utf-8", "replace"), 400)))


CACHE_ROOM = 1 << 30  # below this free in the home (or a read-only one), pip and uv keep no download cache there


class Installer:
    """Command lines for uv or pip, with the job's index options."""

    def __init__(self, kind: str, exe: str, venv_python: str, index: dict, override_file: str | None) -> None:
        self.kind, self.exe, self.python, self.index, self.override_file = kind, exe, venv_python, index, override_file

    def env(self) -> dict:
        env = dict(os.environ)
        prefix = "UV_" if self.kind == "uv" else "PIP_"
        if self.index.get("url"):
            env[prefix + "INDEX_URL"] = self.index["url"]
        if self.index.get("extra_urls"):
            env[prefix + "EXTRA_INDEX_URL"] = " ".join(self.index["extra_urls"])
        secret_links = [x for x in self.index.get("find_links") or [] if redact(x) != x]
        if secret_links:  # URLs with credentials stay out of argv (uv: comma-separated, pip: spaces)
            env[prefix + "FIND_LINKS"] = ("," if self.kind == "uv" else " ").join(secret_links)
        if self.kind == "pip":
            env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        if room_problem(os.path.expanduser("~/.cache"), CACHE_ROOM):  # a home read-only or short of room: the
            env.setdefault("PIP_NO_CACHE_DIR", "1")  # installers keep no cache there (a wheel never fills it)
            env.setdefault("UV_NO_CACHE", "1")
        return env

    def argv(self, reqs: list, overrides: bool = True) -> list:
        if self.kind == "uv":
            argv = [self.exe, "pip", "install", "--python", self.python]
        else:
            argv = [self.python, "-m", "pip", "install"]
        if self.index.get("no_index"):
            argv.append("--no-index")
        for link in self.index.get("find_links") or []:
            if redact(link) == link:  # plain paths and URLs; credentialed ones go through env()
                argv += ["--find-links", link]
        if self.kind == "uv" and overrides and self.override_file:
            argv += ["--override", self.override_file]
        return argv + list(reqs)

    def display(self, argv: list) -> str:
        shown = []
        if self.index.get("url"):
            shown.append("--index-url " + redact(self.index["url"]))
        for u in self.index.get("extra_urls") or []:
            shown.append("--extra-index-url " + redact(u))
        head = " ".join(redact(a) for a in argv[: 5 if self.kind == "uv" else 4])
        rest = " ".join(redact(a) for a in argv[5 if self.kind == "uv" else 4:])
        return " ".join(x for x in [head] + shown + [rest] if x)

    def run(self, reqs: list, timeout: float, overrides: bool = True) -> dict:
        """Install ``reqs``. Lines with credentials in a URL never reach argv (the node's process
        listing): they go to the installer in a 0600 requirements file (``-r``) inside a fresh 0700
        temp dir, removed when the installer is done. What is shown has them redacted."""
        shown = self.display(self.argv(reqs, overrides))
        secret = [r for r in reqs if redact(r) != r]
        emit_event("install", command=shown)
        start, tmpdir = time.time(), None
        try:
            argv = self.argv([r for r in reqs if redact(r) == r], overrides)
            if secret:
                tmpdir = tempfile.mkdtemp(prefix="dfo-req-")
                argv += ["-r", private_file(tmpdir, "requirements.txt", "".join(r + "\n" for r in secret))]
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env(), cwd="/",
                                  timeout=timeout)
            code, out = proc.returncode, proc.stdout.decode("utf-8", "replace")
        except subprocess.TimeoutExpired as exc:
            code, out = -1, (exc.stdout or b"").decode("utf-8", "replace") + "\n(timed out after %ds)" % timeout
        except OSError as exc:
            code, out = -1, "cannot run %s: %s" % (self.exe, exc)
        finally:
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
        return {"command": shown, "exit_code": code, "seconds": round(time.time() - start, 2),
                "output_tail": tail(out)}


def private_file(directory: str, name: str, text: str) -> str:
    """Create ``directory/name`` holding ``text``, mode 0600 from the start; its path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def run_tool(argv: list, timeout: float = 600) -> tuple:
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, cwd="/")
        return proc.returncode, proc.stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)


def parse_req(spec: str) -> Requirement:
    try:
        return Requirement(spec)
    except (InvalidRequirement, ValueError) as exc:
        raise StepFailed("invalid package spec %r: %s" % (spec, first_line(exc)), kind="config") from None


def req_key(spec: str) -> str:
    """The normalized distribution name of a package line (``Fla_Core>=0.5`` -> ``fla-core``)."""
    return dist_key(parse_req(spec))


def satisfied(spec: str, packages: dict) -> bool:
    req = parse_req(spec)
    have = packages.get(dist_key(req))
    return have is not None and req.specifier.contains(have, prereleases=True)


def diff_packages(before: dict, after: dict) -> list:
    out = []
    for k in sorted(set(before) | set(after)):
        b, a = before.get(k), after.get(k)
        if b != a:
            out.append("%s %s -> %s" % (k, b or "(none)", a or "(none)"))
    return out


def venv_state(before: dict, after: dict) -> str:
    changes = diff_packages(before, after)
    if not changes:
        return "the venv is unchanged"
    return "the venv changed: " + ", ".join(changes)


def _cfg_version(cfg: str) -> str:
    try:
        with open(cfg) as fh:
            for line in fh:
                k, _, v = line.partition("=")
                if k.strip() in ("version", "version_info"):
                    return v.strip()
    except OSError:
        pass
    return "?"


def _last_lines(text: str, n: int = 3) -> str:
    """The installer's own words: from its first error line on (at most 4 lines), else its last lines."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.lower().startswith(("error", "× ", "x ")):
            return " | ".join(lines[i:i + 4])
    return " | ".join(lines[-n:]) or "(no output)"


def _redacted_index(index: dict) -> dict:
    out = dict(index)
    if out.get("url"):
        out["url"] = redact(out["url"])
    out["extra_urls"] = [redact(u) for u in out.get("extra_urls") or []]
    out["find_links"] = [redact(u) for u in out.get("find_links") or []]
    return out
