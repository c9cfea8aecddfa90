"""Node side of ``dfo provision``: the job's venv, its installer, every package line verified.

Runs with the node's python3 (stdlib only). Steps, each check -> act -> verify, each reported
(a ``step`` event) as ``done``, ``no change``, ``warning`` (done, with an override's warning) or
``failed``:

1. ``workspace``: the workspace, ``<workspace>/.dfo/provision`` and the job's run directories;
2. ``venv``: ``uv venv --python PY`` when the job's installer is uv and the node has uv (on PATH,
   or in ~/.local/bin or ~/.cargo/bin, where uv's installer puts it: no ensurepip needed), else
   ``PY -m venv`` (uv is then installed into it by step 3); ``PY -m venv`` needs ensurepip (Debian:
   python3.X-venv), and a node without it is told so before anything is made;
3. ``installer``: uv (the node's, else the venv's, else ``pip install uv`` into the venv) or pip
   (the venv's; ``ensurepip`` when missing);
4. one step per package line, in order. Check: the venv's interpreter, in a fresh process
   (remote.env.pkgcheck), says the line and every earlier line hold and the environment is
   consistent -> ``no change``, no installer call. Act: install the line together with the
   earlier lines, so the resolver sees their pins and refuses a conflicting request before it
   touches the venv. Verify, in a fresh process: the asked version is installed (metadata and the
   module's ``__version__``), and the environment is consistent; else the step fails (exit 3) with
   the version before, the version after, what was asked and the installer's own output;
5. ``overrides``: every overridden package that is installed satisfies its override;
6. ``triton cache`` (only with clear_triton_cache): remove it and say how many bytes went.

Overrides: uv gets them as real overrides (``--override FILE``): any requirement on that package,
the job's own line included, is replaced by the override. pip has no overrides, so dfo does the
honest equivalent: lines on overridden packages are left out of pip's resolution; after each
install, every installed overridden package that does not satisfy its override is installed
at the override's version (``pip install SPEC``, pip's resolver ignores the installed packages'
pins), then pkgcheck confirms that the only broken pins are overridden ones, each reported as
a warning quoting the reason. Any other break fails the step.

Index options travel in the installer's environment (PIP_INDEX_URL / UV_INDEX_URL and the
EXTRA variants, as index URLs may hold credentials) and ``--find-links`` / ``--no-index`` flags.
A line with credentials in its URL reaches the installer in a 0600 file, never argv (so does uv's
overrides file); events, result, errors and the record show URLs' userinfo as ``***`` (remote.lib.redact).

The record of the run is written (temp + rename, mode 0600) to ``<workspace>/.dfo/provision/<job>.json``.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
from typing import Callable

from remote._proto import RemoteError, emit_event, main
from remote.env.installers import (
    Installer,
    StepFailed,
    _cfg_version,
    _last_lines,
    _redacted_index,
    diff_packages,
    dir_size,
    now_iso,
    pkgcheck,
    private_file,
    req_key,
    run_tool,
    satisfied,
    tail,
    triton_cache_path,
    venv_state,
    write_json,
)
from remote.env.probe import ensurepip, find_uv, interpreter
from remote.lib.destsafety import open_meta
from remote.lib.fsutil import human_bytes, node_path, room_problem
from remote.lib.fsutil import workspace as fsutil_workspace
from remote.lib.redact import redact, redact_obj

HISTORY = 10  # earlier runs kept in the record (started, ok, installed, changed, error)
VENV_ROOM_PIP = 32 << 20  # a venv that `python3 -m venv` makes with pip: about 25 MB (python 3.11)
VENV_ROOM_UV = 1 << 20  # uv's: no pip, a few links and files


class Provision:
    def __init__(self, req: dict) -> None:
        job = req["job"]
        self.req, self.job, self.name = req, job, job["name"]
        self.venv = node_path(job["venv"]).rstrip("/") or "/"  # ~ and $HOME: this user's home
        self.vpy = self.venv + "/bin/python"
        self.lines = list(job.get("packages") or [])
        self.overrides = list(job.get("overrides") or [])
        self.okeys = dict((req_key(o["package"]), o) for o in self.overrides)
        self.keys = [req_key(line) for line in self.lines]
        self.effs = [self.okeys[self.keys[i]]["package"] if self.keys[i] in self.okeys else self.lines[i]
                     for i in range(len(self.lines))]
        self.timeout = float(req.get("install_timeout") or 3600)
        self.workspace = fsutil_workspace(req.get("workspace"))  # none given: the node's default
        self.record_dir = self.workspace + "/.dfo/provision"
        self.record_path = None  # type: str | None
        self.steps, self.installs, self.changed = [], [], []  # type: list, list, list
        self.state = {"packages": {}, "problems": [], "warnings": []}  # type: dict
        self.before = {}  # type: dict
        self.inst = None  # type: Installer | None
        self.tmpdir = None  # type: str | None
        self.installer_info = {}  # type: dict
        self.started, self.t0 = now_iso(), time.time()

    # ------------------------------------------------------------------ plumbing
    def step(self, name: str, fn: Callable[[], dict]) -> None:
        start = time.time()
        try:
            rep = fn()
        except StepFailed as exc:
            rep = dict(exc.extra, status="failed", message=exc.message)
            self.steps.append(redact_obj(dict(rep, name=name, seconds=round(time.time() - start, 2))))
            emit_event("step", step=self.steps[-1])
            raise
        self.steps.append(redact_obj(dict(rep, name=name, seconds=round(time.time() - start, 2))))
        emit_event("step", step=self.steps[-1])

    def private_dir(self) -> str:  # 0700, for files that may hold credentials; cleanup() removes it
        self.tmpdir = self.tmpdir or tempfile.mkdtemp(prefix="dfo-provision-")
        return self.tmpdir

    def cleanup(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def check(self, names: list, candidates: list | None = None) -> dict:
        self.state = pkgcheck(self.vpy, self.effs, self.overrides, names, candidates)
        return self.state

    def relevant(self, k: int, state: dict) -> list:
        """Problems that concern lines 0..k (a later line not installed yet is not one)."""
        later = set(self.keys[k + 1:]) - set(self.keys[: k + 1])
        return [p for p in state["problems"]
                if p.get("required_by") or p["kind"] not in ("pin", "missing") or p["package"] not in later]

    def new_warnings(self, old: list, new: list) -> list:
        seen = set(w["message"] for w in old)
        return [w for w in new if w["message"] not in seen]

    # ------------------------------------------------------------------ steps
    def step_workspace(self) -> dict:
        dirs = [self.workspace, self.workspace + "/.dfo", self.record_dir] + [
            node_path(d) for d in self.req.get("dirs") or []]
        created = []
        for d in dirs:
            if d == self.workspace + "/.dfo":  # no symlink, this user's, nobody else may write it (made 0700)
                try:
                    os.close(open_meta(self.workspace, "workspace"))
                except RemoteError as exc:
                    raise StepFailed(exc.message, hint=exc.extra.get("hint"), kind="config") from None
            if os.path.isdir(d):
                continue
            if os.path.lexists(d):
                raise StepFailed("%s exists and is not a directory" % d, hint="move it away, or choose another path")
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as exc:
                raise StepFailed("cannot create %s: %s" % (d, exc.strerror), hint="check the path and its "
                                 "permissions (workspace: in the inventory or job)") from None
            created.append(d)
        bad = [d for d in dirs if not os.access(d, os.W_OK | os.X_OK)]
        if bad:
            raise StepFailed("not writable: %s" % ", ".join(bad), hint="fix the permissions, or choose another path")
        self.record_path = "%s/%s.json" % (self.record_dir, self.name)
        if created:
            return {"status": "done", "message": "created " + ", ".join(created)}
        return {"status": "no change", "message": "exist: " + ", ".join(dirs)}

    def step_venv(self) -> dict:
        cfg = os.path.join(self.venv, "pyvenv.cfg")
        if os.path.isfile(cfg) and os.access(self.vpy, os.X_OK):
            return {"status": "no change", "message": "%s (python %s)" % (self.venv, _cfg_version(cfg))}
        if os.path.lexists(self.venv) and not (os.path.isdir(self.venv) and not os.listdir(self.venv)):
            raise StepFailed("%s exists and is not a venv (no pyvenv.cfg or bin/python)" % self.venv,
                             hint="remove it, or set venv: in the job file to another path")
        py = self.job.get("python") or "python3"
        exe = interpreter(py)
        if not exe:
            raise StepFailed("the job's python %r is not on the node (PATH=%s)" % (py, os.environ.get("PATH", "")),
                             hint="install it there, or set python: in the job file to one the node has (python3)")
        uv = find_uv() if self.job.get("installer") == "uv" else None
        short = room_problem(self.venv, VENV_ROOM_UV if uv else VENV_ROOM_PIP)  # before anything is written
        if short:
            raise StepFailed("cannot create the venv %s: %s" % (self.venv, short),
                             hint="make room there, or set venv: in the job file to a folder on a disk with room "
                                  "(e.g. under the workspace)")
        if not uv:  # `python -m venv` gives the venv its pip with ensurepip: say what is missing before it fails
            ep = ensurepip(exe)
            if not ep["ok"]:
                fix = "install %s on the node (sudo apt install %s)" % (ep["package"], ep["package"])
                if self.job.get("installer") == "uv":
                    raise StepFailed("installer: uv, but the node has no uv (PATH, ~/.local/bin, ~/.cargo/bin), and "
                                     "%s has no ensurepip to make a venv that pip could install uv into" % exe,
                                     hint="install uv on the node (its installer puts it in ~/.local/bin), or " + fix)
                raise StepFailed("cannot create the venv %s: `%s -m venv` needs ensurepip, and %s (python %s) has none"
                                 % (self.venv, py, exe, ep["version"] or "?"),
                                 hint=fix + ", or use installer: uv with uv on the node")
        argv = [uv, "venv", "--python", exe, self.venv] if uv else [exe, "-m", "venv", self.venv]
        code, out = run_tool(argv, timeout=600)
        if code != 0 or not os.access(self.vpy, os.X_OK):
            shutil.rmtree(self.venv, ignore_errors=True)  # it did not exist before: leave nothing half-made
            full = "No space left on device" in out or "Disk quota exceeded" in out
            raise StepFailed("creating the venv failed (%s, exit %d): %s" % (" ".join(argv), code, tail(out, 600)),
                             hint="the disk that holds it is full: make room there, or set venv: to a folder on "
                                  "a disk with room" if full else
                                  "on Debian/Ubuntu, python3 -m venv needs the python3.X-venv package")
        return {"status": "done", "message": "created %s with %s (python %s)" % (self.venv, argv[0], _cfg_version(cfg)),
                "command": " ".join(argv)}

    def step_installer(self) -> dict:
        self.before = dict(self.check(names=[])["packages"])
        kind = self.job.get("installer") or "pip"
        index = dict(self.job.get("index") or {})
        ofile = None
        if self.overrides:  # private: an override may name a URL with credentials
            ofile = private_file(self.private_dir(), "overrides.txt",
                                 "".join("%s\n" % o["package"] for o in self.overrides))
        if kind == "pip":
            self.inst = Installer("pip", self.vpy, self.vpy, index, None)
            self.installer_info = {"kind": "pip", "path": self.vpy + " -m pip", "version": self.before.get("pip")}
            if "pip" in self.before:
                return {"status": "no change", "message": "pip %s in the venv" % self.before["pip"]}
            code, out = run_tool([self.vpy, "-m", "ensurepip"], timeout=600)
            have = self.check(names=[])["packages"].get("pip")
            if not have:
                raise StepFailed("the venv has no pip and ensurepip failed (exit %d): %s" % (code, tail(out, 600)),
                                 hint="use installer: uv, or install pip into the venv")
            self.installer_info["version"] = have
            return {"status": "done", "message": "installed pip %s with ensurepip" % have}
        found = find_uv(self.venv)  # PATH, ~/.local/bin, ~/.cargo/bin, the venv's own
        status, message = "no change", ""
        if found is None:
            if "pip" not in self.before:
                raise StepFailed("the node has no uv and the venv has no pip to install it with",
                                 hint="install uv on the node (on PATH), or use installer: pip")
            res = Installer("pip", self.vpy, self.vpy, index, None).run(["uv"], self.timeout)
            self.installs.append(res)
            found = self.venv + "/bin/uv"
            if res["exit_code"] != 0 or not os.access(found, os.X_OK):
                raise StepFailed("installing uv into the venv failed (exit %d): %s" % (res["exit_code"],
                                 res["output_tail"][-600:]), hint="is uv in the job's index or find_links?",
                                 installer=[res])
            status, message = "done", "installed into the venv with pip: "
            self.check(names=[])  # the packages steps compare against the venv as it is now (uv included)
        if status == "no change" and found == self.venv + "/bin/uv" and self.before.get("uv"):
            version = self.before["uv"]  # the venv's own uv: its metadata says which (no process to start)
        else:
            code, out = run_tool([found, "--version"], timeout=60)
            if code != 0:
                raise StepFailed("%s --version failed (exit %d): %s" % (found, code, tail(out, 300)))
            version = out.strip().split()[1] if len(out.split()) > 1 else out.strip()
        self.inst = Installer("uv", found, self.vpy, index, ofile)
        self.installer_info = {"kind": "uv", "path": found, "version": version}
        return {"status": status, "message": "%suv %s (%s)" % (message, version, found)}

    def step_package(self, k: int) -> dict:
        line, eff, key = self.lines[k], self.effs[k], self.keys[k]
        note = "" if eff == line else " (replaced by the override %s)" % eff
        old_state = self.state
        before = old_state["packages"]
        info = {"asked": line, "effective": eff, "before": before.get(key)}
        if not self.relevant(k, old_state):
            return dict(info, status="no change", after=before.get(key),
                        message="%s %s%s" % (key, before.get(key), note))
        runs = self._install(k)
        self.installs += runs
        after_state = self.check(names=[key])
        after = after_state["packages"]
        info.update(after=after.get(key), installer=runs)
        state = venv_state(before, after)
        self._note_changes(before, after)
        failed = [r for r in runs if r["exit_code"] != 0]
        if failed:
            r = failed[0]
            named = self.check(names=[], candidates=[eff])["conflicts"]
            pins = "".join("; " + p["message"] for p in named[:3])
            said = _last_lines(r["output_tail"])
            raise StepFailed("%s: %s exited %d: %s%s; %s" % (line, self.inst.kind, r["exit_code"],  # type: ignore[union-attr]
                                                           said.split(" | ")[0][:300], pins, state),
                             hint="the installer said: " + said, **info)
        mine = [p for p in self.relevant(k, after_state)
                if p["package"] == key and not p.get("required_by") and p["kind"] in ("pin", "missing")]
        if mine:
            if before.get(key) == after.get(key):
                what = "the installer exited 0 but %s is still %s" % (key, after.get(key) or "not installed")
            else:
                what = "%s is %s after the install (before: %s)" % (key, after.get(key), before.get(key))
            raise StepFailed("asked %s%s; %s; %s" % (line, note, what, state),
                             hint="installer output: %s -- check the node's installer configuration (pip config "
                                  "debug / uv.toml), constraints and caches" % _last_lines(runs[-1]["output_tail"]),
                             **info)
        others = self.relevant(k, after_state)
        if others:
            breaks_pin = any(p["kind"] == "requirement" for p in others)
            was = set(p["message"] for p in old_state["problems"])
            said = "; ".join(p["message"] + (" (already so before this step)" if p["message"] in was else "")
                             for p in others[:3])
            raise StepFailed("after installing %s: %s; %s" % (line, said, state),
                             hint=("if this break is deliberate, add it to overrides: with a reason" if breaks_pin
                                   else "the installer said: " + _last_lines(runs[-1]["output_tail"])), **info)
        warns = self.new_warnings(old_state["warnings"], after_state["warnings"])
        if before.get(key) == after.get(key):
            msg = "%s %s%s" % (key, after.get(key), note)
        else:
            msg = "%s %s -> %s%s" % (key, before.get(key) or "(none)", after.get(key), note)
        also = [c for c in diff_packages(before, after) if not c.startswith(key + " ")]
        if also:
            msg += "; also changed: " + ", ".join(also)
        if warns:
            return dict(info, status="warning", message=msg + "; " + "; ".join(w["message"] for w in warns))
        return dict(info, status="done", message=msg)

    def _install(self, k: int) -> list:
        assert self.inst is not None
        if self.inst.kind == "uv":
            return [self.inst.run(self.effs[: k + 1], self.timeout)]
        reqs = [self.effs[i] for i in range(k + 1) if self.keys[i] not in self.okeys]
        runs = [self.inst.run(reqs, self.timeout)] if reqs else []
        if runs and runs[-1]["exit_code"] != 0:
            return runs
        pk = self.check(names=[])["packages"] if runs else self.state["packages"]
        unsat = [o["package"] for key, o in sorted(self.okeys.items())
                 if (key in pk or key == self.keys[k]) and not satisfied(o["package"], pk)]
        if unsat:
            runs.append(self.inst.run(unsat, self.timeout))
        return runs

    def step_overrides(self) -> dict:
        pk = self.state["packages"]
        unsat = [o["package"] for key, o in sorted(self.okeys.items()) if key in pk and not satisfied(o["package"], pk)]
        summary = ", ".join("%s %s (%s: %s)" % (key, pk.get(key) or "not installed", o["package"], o["reason"])
                            for key, o in sorted(self.okeys.items()))
        if not unsat:
            return {"status": "no change", "message": summary}
        assert self.inst is not None
        before = dict(pk)
        reqs = self.effs + unsat if self.inst.kind == "uv" else unsat
        runs = [self.inst.run(reqs, self.timeout)]
        self.installs += runs
        after_state = self.check(names=[req_key(u) for u in unsat])
        self._note_changes(before, after_state["packages"])
        left = [u for u in unsat if not satisfied(u, after_state["packages"])]
        problems = self.relevant(len(self.lines), after_state)
        if runs[0]["exit_code"] != 0 or left or problems:
            why = "; ".join([p["message"] for p in problems[:3]] + ["%s not installed" % u for u in left])
            raise StepFailed("applying overrides %s failed (exit %d): %s; %s" % (
                ", ".join(unsat), runs[0]["exit_code"], why, venv_state(before, after_state["packages"])),
                hint="the installer said: " + _last_lines(runs[0]["output_tail"]), installer=runs)
        pk = after_state["packages"]
        summary = ", ".join("%s %s (%s: %s)" % (key, pk.get(key), o["package"], o["reason"])
                            for key, o in sorted(self.okeys.items()))
        return {"status": "warning" if after_state["warnings"] else "done", "message": summary, "installer": runs}

    def step_triton_cache(self) -> dict:
        path = triton_cache_path(self.req.get("triton_cache_dir"))
        real = os.path.realpath(path)
        home = os.path.realpath(os.path.expanduser("~"))
        if real in ("/", home, os.path.realpath(self.workspace)) or (home + "/").startswith(real + "/"):
            raise StepFailed("refusing to clear %s as a Triton cache: it is / , $HOME or the workspace" % path,
                             hint="set TRITON_CACHE_DIR to a directory of its own")
        if not os.path.isdir(real):
            return {"status": "no change", "message": "no Triton cache at %s" % path, "path": path, "bytes_removed": 0}
        size, files = dir_size(real)
        for entry in os.listdir(real):  # empty the directory, keep it (and a symlink to it) in place
            p = os.path.join(real, entry)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        return {"status": "done", "message": "removed %s (%d file%s) from %s" % (human_bytes(size), files,
                                                                             "" if files == 1 else "s", path),
                "path": path, "bytes_removed": size, "files_removed": files}

    # ------------------------------------------------------------------ record
    def _note_changes(self, before: dict, after: dict) -> None:
        self.changed += diff_packages(before, after)

    def report(self, ok: bool, error: dict | None = None) -> dict:
        final = self.state
        warnings = list(final.get("warnings") or [])
        for i, key in enumerate(self.keys):
            line, eff = self.lines[i], self.effs[i]
            if eff != line:
                o = self.okeys[key]
                warnings.append({"kind": "override", "package": key, "expected": line, "found": eff,
                                 "reason": o["reason"],
                                 "message": 'the job\'s %s is replaced by the override %s: "%s"' % (line, eff,
                                                                                                    o["reason"])})
        return redact_obj({
            "ok": ok, "job": self.name, "host": self.req.get("host"), "started": self.started,
            "finished": now_iso(), "seconds": round(time.time() - self.t0, 2), "venv": self.venv,
            "python": final.get("python"), "installer": self.installer_info, "asked": self.lines,
            "overrides": self.overrides, "index": _redacted_index(self.job.get("index") or {}),
            "steps": self.steps, "changed": self.changed,
            "installed": [dict((k, s.get(k)) for k in ("asked", "effective", "before", "after"))
                          for s in self.steps if s.get("installer")], "packages_before": self.before,
            "packages_after": final.get("packages"), "warnings": warnings,
            "problems": [] if ok else list(final.get("problems") or []), "installer_runs": self.installs,
            "error": error, "record": self.record_path,
        })

    def save(self, rep: dict) -> None:
        """Write the record; the runs before it are kept, newest first, as a short history."""
        if self.record_path:
            try:
                try:
                    with open(self.record_path) as fh:
                        prev = json.load(fh)
                except (OSError, ValueError):
                    prev = None
                if isinstance(prev, dict):
                    keep = dict((k, prev.get(k)) for k in ("started", "ok", "installed", "changed", "error"))
                    rep["history"] = ([keep] + list(prev.get("history") or []))[:HISTORY]
                write_json(self.record_path, rep)
            except OSError as exc:
                rep["record_error"] = "could not write %s: %s" % (self.record_path, exc.strerror)


def provision(req: dict) -> dict:
    try:
        p = Provision(req)
    except StepFailed as exc:
        raise RemoteError(exc.kind, redact(exc.message), hint=exc.hint and redact(exc.hint)) from None
    try:
        return _provision(p, req)
    finally:
        p.cleanup()


def _provision(p: Provision, req: dict) -> dict:
    try:
        p.step("workspace", p.step_workspace)
        p.step("venv", p.step_venv)
        p.step("installer", p.step_installer)
        for k, line in enumerate(p.lines):
            p.step(line, functools.partial(p.step_package, k))
        if p.overrides:
            p.step("overrides", p.step_overrides)
        if req.get("clear_triton_cache"):
            p.step("triton cache", p.step_triton_cache)
    except StepFailed as exc:
        rep = p.report(False, {"message": exc.message, "hint": exc.hint})
        p.save(rep)
        raise RemoteError(exc.kind, redact(exc.message), hint=exc.hint and redact(exc.hint), report=rep) from None
    rep = p.report(True)
    p.save(rep)
    return rep


if __name__ == "__main__":
    main(provision)
