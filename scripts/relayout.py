#!/usr/bin/env python3
"""Lay the tree out by subpackage (issue 21, item 1): ``git mv`` per MOVES, then rewrite every
import and every module name or path that names a moved module, across the repository.

    python3 scripts/relayout.py            # move what is still at its old place, rewrite, sort imports
    python3 scripts/relayout.py --check    # change nothing; list what is still old (exit 1 if any)

Idempotent: a second run moves nothing and rewrites nothing. Run it again after merging a branch
that still used the old layout: git follows renames, so that branch's edits land in the moved files,
and this script then fixes the old names those edits brought (imports written for a file's old
place included) and the files the branch added.

What it rewrites:
* Python imports (``ast``): absolute and relative, lazy ones and TYPE_CHECKING ones too. Each
  statement keeps its style (relative stays relative, computed from the file's new place); a name
  that was a module keeps its local name (``from remote import s3verify`` becomes
  ``from remote.s3 import verify as s3verify``). ``ruff check --select I --fix`` then re-sorts the
  files it touched.
* Text in *.py, *.md, *.toml, *.yaml, *.yml, *.sh, *.json, *.txt and .ci/*: dotted module names
  (``remote.s3sync``, ``python3 -m remote.runs``, ``orchestrator.connection.X``), paths
  (``remote/s3sync.py``, ``orchestrator/demo_job/``) and one-line ``from X import a, b`` in strings
  (Python source run with ``python -c``).
  bench/results/ (records of past runs) and remote/_vendor/ (vendored as is) are left alone.
* FIXUPS: the few lines that locate files relative to ``__file__`` or list modules by file name.
* Never: text between ``<!-- relayout: keep -->`` and ``<!-- /relayout: keep -->`` (the mapping in
  docs/architecture-layout.md), and the files in SKIP_FILES.

Stdlib only; python3 >= 3.10 (the controller's).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------- the mapping
# old path -> new path (files, or one folder). A module whose old name is now a package keeps that
# name for ``python3 -m`` through the package's __main__.py (remote.runs, remote.gang).
MOVES: list[tuple[str, str]] = [
    # remote/lib: small helpers every node module may use
    ("remote/fsutil.py", "remote/lib/fsutil.py"),
    ("remote/redact.py", "remote/lib/redact.py"),
    ("remote/retry.py", "remote/lib/retry.py"),
    ("remote/globpat.py", "remote/lib/globpat.py"),
    ("remote/triton_cache.py", "remote/lib/triton_cache.py"),
    ("remote/s3dest.py", "remote/lib/destsafety.py"),
    # remote/s3: the S3 client and engines (no entry point)
    ("remote/s3client.py", "remote/s3/client.py"),
    ("remote/s3sig.py", "remote/s3/sig.py"),
    ("remote/s3errors.py", "remote/s3/errors.py"),
    ("remote/s3verify.py", "remote/s3/verify.py"),
    ("remote/s3manifest.py", "remote/s3/manifest.py"),
    ("remote/s3engine.py", "remote/s3/download.py"),
    ("remote/s3put.py", "remote/s3/upload.py"),
    ("remote/putlimits.py", "remote/s3/limits.py"),
    # remote/transfer: sync-data and stage-model
    ("remote/s3sync.py", "remote/transfer/sync.py"),
    ("remote/s3stage.py", "remote/transfer/stage.py"),
    # remote/files: files between the laptop and the node
    ("remote/codepush.py", "remote/files/push.py"),
    ("remote/pullfiles.py", "remote/files/pull.py"),
    ("remote/uploads.py", "remote/files/runfiles.py"),
    # remote/env: the node's Python environment
    ("remote/probe.py", "remote/env/probe.py"),
    ("remote/pkgcheck.py", "remote/env/pkgcheck.py"),
    ("remote/provision.py", "remote/env/provision.py"),
    ("remote/provision_lib.py", "remote/env/installers.py"),
    ("remote/known_bad.py", "remote/env/known_bad.py"),
    ("remote/known_bad.json", "remote/env/known_bad.json"),
    # remote/runs: launch, status, tail, stop; the supervisor and the run record
    ("remote/runs.py", "remote/runs/ops.py"),
    ("remote/runrecord.py", "remote/runs/record.py"),
    ("remote/logfollow.py", "remote/runs/logfollow.py"),
    ("remote/runs_outputs.py", "remote/runs/outputs.py"),
    ("remote/supervisor.py", "remote/runs/supervisor.py"),
    # remote/ship: the outputs shipper
    ("remote/shipper.py", "remote/ship/shipper.py"),
    ("remote/shipscan.py", "remote/ship/scan.py"),
    ("remote/shipstate.py", "remote/ship/state.py"),
    ("remote/shipwatch.py", "remote/ship/watch.py"),
    # remote/gang: multi-node runs
    ("remote/gang.py", "remote/gang/ops.py"),
    ("remote/gangwatch.py", "remote/gang/watch.py"),
    ("remote/gangwire.py", "remote/gang/wire.py"),
    ("remote/gangdoor.py", "remote/gang/door.py"),  # added on main after the move was planned
    ("remote/fleetexec.py", "remote/exec.py"),
    # orchestrator/transport: how a node is reached
    ("orchestrator/transport.py", "orchestrator/transport/base.py"),
    ("orchestrator/connection.py", "orchestrator/transport/ssh.py"),
    ("orchestrator/localconn.py", "orchestrator/transport/local.py"),
    ("orchestrator/hostkeys.py", "orchestrator/transport/hostkeys.py"),
    ("orchestrator/known_hosts.py", "orchestrator/transport/known_hosts.py"),
    ("orchestrator/liveness.py", "orchestrator/transport/liveness.py"),
    ("orchestrator/openssh.py", "orchestrator/transport/openssh.py"),  # the OpenSSH transport, added on main
    ("orchestrator/openssh_errors.py", "orchestrator/transport/openssh_errors.py"),  # after the move was planned
    ("orchestrator/openssh_keys.py", "orchestrator/transport/openssh_keys.py"),
    ("orchestrator/openssh_setup.py", "orchestrator/transport/openssh_setup.py"),
    # orchestrator/config: inventory and job files
    ("orchestrator/config.py", "orchestrator/config/models.py"),
    ("orchestrator/jobrules.py", "orchestrator/config/rules.py"),
    ("orchestrator/yamlpos.py", "orchestrator/config/yamlpos.py"),
    # orchestrator/testbed: throwaway nodes and S3 on this machine (the package is the Testbed)
    ("orchestrator/testbed.py", "orchestrator/testbed/__init__.py"),
    ("orchestrator/testbed_node.py", "orchestrator/testbed/node.py"),
    ("orchestrator/testbed_proxy.py", "orchestrator/testbed/proxy.py"),
    ("orchestrator/testbed_s3.py", "orchestrator/testbed/s3.py"),
    ("orchestrator/testbed_sys.py", "orchestrator/testbed/system.py"),
    # orchestrator/demo: dfo demo's data, job and trainer
    ("orchestrator/demo_data.py", "orchestrator/demo/data.py"),
    ("orchestrator/demo_job", "orchestrator/demo/job"),
]

# names the hand edits after the move took elsewhere (new module -> {name: where it is now}): an import of
# one of them from its old module (a branch merged later still writes it) is pointed at the new one
NAME_MOVES: dict[str, dict[str, str]] = {
    "orchestrator.transport.ssh": {"open_connection": "orchestrator.transport"},
    "orchestrator.transport.base": {"open_connection": "orchestrator.transport"},
    "orchestrator.steps.runs": {"job_workspace": "orchestrator.steps.workspace",
                                "run_dir_of": "orchestrator.steps.workspace"},
    "orchestrator.testbed.s3": {"FaultProxy": "orchestrator.testbed.proxy",
                                "PROXY_MODES": "orchestrator.testbed.proxy"},
    "orchestrator.config.models": {n: "orchestrator.transport.resolve" for n in (
        "resolve_host", "ssh_config_only", "ssh_config_path", "ssh_configuration")},
    "orchestrator.commands.runs": {"Launched": "orchestrator.steps.fleet"},
    "orchestrator.commands.up": {"live_runs": "orchestrator.steps.fleet"},
    "orchestrator.commands.demo": {n: "orchestrator.demo.setup" for n in (
        "DEMO_JOB", "CPU_INDEX", "checkout", "default_wheels", "DEFAULT_WHEELS", "wheels_hint", "demo_job")},
}

# __init__.py of each new package (created when missing; never overwritten)
PACKAGES: dict[str, str] = {
    "remote/lib": "Small helpers every node module may use: files, secrets, retries, globs, destinations.",
    "remote/s3": "The node's S3 client (SigV4, errors, verification, manifests) and its download and "
                 "upload engines.",
    "remote/transfer": "``python3 -m remote.transfer.sync`` (sync-data) and ``remote.transfer.stage`` "
                       "(stage-model).",
    "remote/files": "Files between the laptop and the node: code push, pull, a run's upload files.",
    "remote/env": "The node's Python environment: probe, provision, package checks, known-bad versions.",
    "remote/runs": "``python3 -m remote.runs``: launch, status, tail, stop (remote/runs/ops.py), the run's "
                   "supervisor and its record.",
    "remote/ship": "The outputs shipper a run's supervisor starts (``python3 -m remote.ship.shipper``).",
    "remote/gang": "``python3 -m remote.gang``: a run over several nodes (remote/gang/ops.py) and its "
                   "watch.",
    "orchestrator/transport": "How a node is reached: the Transport interface (base), OpenSSH/paramiko "
                              "(ssh), this machine (local), host keys and liveness.",
    "orchestrator/config": "The inventory and job files: pydantic models, job rules, YAML positions.",
    "orchestrator/demo": "dfo demo's pieces: its data and model (data), its job and trainer (job/).",
}

# a package that is also a node entry: ``python3 -m remote.X`` runs its __main__.py
MAINS: dict[str, tuple[str, str]] = {
    "remote/runs/__main__.py": ("remote.runs.ops", "handle"),
    "remote/gang/__main__.py": ("remote.gang.ops", "gang"),
}
MAIN_TEXT = '''"""``python3 -m {pkg}``: see {mod}."""
from remote._proto import main
from {mod} import {fn}

main({fn})
'''

# (path after the move, regex, replacement): lines that follow a file's place. Each pattern no longer
# matches once applied, so a second run changes nothing.
FIXUPS: list[tuple[str, str, str]] = [
    *[(p, r"(?m)^AGENT_DIR = os\.path\.dirname\(os\.path\.dirname\(os\.path\.abspath\(__file__\)\)\)$",
       "AGENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))")
      for p in ("remote/runs/ops.py", "remote/env/pkgcheck.py", "remote/env/installers.py")],
    ("orchestrator/testbed/node.py", r"(?m)^PROJECT_ROOT = Path\(__file__\)\.resolve\(\)\.parent\.parent$",
     "PROJECT_ROOT = Path(__file__).resolve().parents[2]"),
    ("pyproject.toml", r'(?m)^remote = \["\*\.json", ', 'remote = ["env/*.json", '),
    ("pyproject.toml", r'"demo_job/', '"demo/job/'),
    ("tests/test_retry.py", r'root\.glob\("s3\*\.py"\)', 'root.glob("s3/*.py")'),
    ("tests/test_transfer_unit.py",
     r'for name in \("s3client", "s3engine", "s3manifest", "s3sig", "s3stage", "s3sync", "s3verify"\):',
     'for name in ("s3/client", "s3/download", "s3/manifest", "s3/sig", "transfer/stage", "transfer/sync",\n'
     '                 "s3/verify"):'),
    ("tests/test_hardening_dest.py", r'root / "s3dest\.py"', 'root / "lib" / "destsafety.py"'),
    ("tests/test_outputs_node.py", r'self\.agent / "remote" / "shipper\.py"',
     'self.agent / "remote" / "ship" / "shipper.py"'),
]

TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".json", ".txt", ".cfg", ".ini"}
SKIP_PREFIXES = ("remote/_vendor/", "bench/results/", ".git/", ".venv/")
SKIP_FILES = {"scripts/relayout.py", "scripts/importgraph.py", "docs/architecture-layout.md"}  # name the old
# layout on purpose
TOP = ("orchestrator", "remote")


# ------------------------------------------------------------------------------------- module names

def mod_of(path: str) -> str | None:
    """Dotted module name of a repository path (``remote/runs/ops.py`` -> ``remote.runs.ops``)."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


OLD2NEW: dict[str, str] = {}
for _old, _new in MOVES:
    if _old.endswith(".py"):
        OLD2NEW[mod_of(_old)] = mod_of(_new)  # type: ignore[index]
NEW2OLD = {v: k for k, v in OLD2NEW.items()}
PATH_NEW2OLD = {n: o for o, n in MOVES}


def git(*args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        sys.exit(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def repo_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, that exist."""
    out = git("ls-files", "-co", "--exclude-standard", "-z")
    return sorted({p for p in out.split("\0") if p and (ROOT / p).is_file()})


def current_modules(files: Iterable[str]) -> set[str]:
    mods: set[str] = set()
    for p in files:
        if p.startswith(TOP) and not p.startswith("remote/_vendor/"):
            m = mod_of(p)
            if m:
                mods.add(m)
                parts = m.split(".")
                for i in range(1, len(parts)):
                    mods.add(".".join(parts[:i]))
    mods.add("remote._vendor")
    return mods


# --------------------------------------------------------------------------------------------- moves

def do_moves(dry: bool) -> tuple[list[str], list[str]]:
    """git mv what is still at its old place; returns (new paths moved now, problems)."""
    moved, problems = [], []
    for old, new in MOVES:
        po, pn = ROOT / old, ROOT / new
        if not po.exists():
            continue
        if pn.exists():
            problems.append(f"both {old} and {new} exist: merge them by hand")
            continue
        if dry:
            problems.append(f"not moved yet: {old} -> {new}")
            continue
        pn.parent.mkdir(parents=True, exist_ok=True)
        git("mv", old, new)
        if pn.is_dir():
            moved += [str(p.relative_to(ROOT)) for p in pn.rglob("*") if p.is_file()]
        else:
            moved.append(new)
    return moved, problems


def make_packages(dry: bool) -> list[str]:
    made = []
    for pkg, doc in PACKAGES.items():
        init = ROOT / pkg / "__init__.py"
        if not init.exists() and (ROOT / pkg).is_dir():
            made.append(str(init.relative_to(ROOT)))
            if not dry:
                init.write_text('"""' + "\n".join(textwrap.wrap(doc, 100)) + '\n"""\n')
    for rel, (mod, fn) in MAINS.items():
        p = ROOT / rel
        if not p.exists() and p.parent.is_dir():
            made.append(rel)
            if not dry:
                pkg = ".".join(Path(rel).parent.parts)
                p.write_text(MAIN_TEXT.format(pkg=pkg, mod=mod, fn=fn))
    if not dry and made:
        git("add", *made)
    return made


# ------------------------------------------------------------------------------------------ imports

def resolve_relative(pkg: str, level: int, module: str | None) -> str | None:
    parts = pkg.split(".") if pkg else []
    if level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    if module:
        base += module.split(".")
    return ".".join(base)


def package_of(mod: str, path: str) -> str:
    return mod if path.endswith("__init__.py") else mod.rpartition(".")[0]


_INIT_NAMES: dict[str, set[str]] = {}


def _top_names(path: Path, guarded: bool) -> set[str]:
    """Names a file binds at its top level; ``guarded``: also imports under a try or an if (not
    TYPE_CHECKING's, which bind nothing at run time). A file that does not parse binds nothing."""
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif guarded and (isinstance(node, ast.Try) or (isinstance(node, ast.If) and not _is_type_checking(node.test))):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return names


def init_names(pkg: str) -> set[str]:
    """Names a package's __init__.py binds at its top level (empty for a namespace package)."""
    if pkg not in _INIT_NAMES:
        init = ROOT / pkg.replace(".", "/") / "__init__.py"
        _INIT_NAMES[pkg] = _top_names(init, guarded=True) if init.is_file() else set()
    return _INIT_NAMES[pkg]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def defined_names(mod: str) -> set[str]:
    """Names a module (a .py file, or a package's __init__.py) binds at its top level."""
    if mod not in _INIT_NAMES:
        path = ROOT / (mod.replace(".", "/") + ".py")
        if not path.is_file():
            return init_names(mod)
        _INIT_NAMES[mod] = _top_names(path, guarded=False)
    return _INIT_NAMES[mod]


def is_package(mod: str) -> bool:
    return (ROOT / mod.replace(".", "/")).is_dir()


def names_resolve(base: str, names: list[tuple[str, str | None]], mods: set[str]) -> bool:
    """Whether ``from base import names`` makes sense in the new tree."""
    if base not in mods:
        return False
    if not is_package(base):
        return True
    return all(n == "*" or f"{base}.{n}" in mods or n in init_names(base) for n, _ in names)


def map_from(base: str, names: list[tuple[str, str | None]],
             mods: set[str]) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """``from base import names`` (a name may be old) -> [(new base, [(name, alias)])], in order."""
    groups: dict[str, list[tuple[str, str | None]]] = {}
    for name, alias in names:
        full = f"{base}.{name}"
        if name != "*" and full in OLD2NEW and OLD2NEW[full] != full:  # a moved module, imported by name
            nb, _, nn = OLD2NEW[full].rpartition(".")
            local = alias or name
            groups.setdefault(nb, []).append((nn, local if local != nn else None))
        elif full in mods:
            groups.setdefault(base, []).append((name, alias))
        elif base in OLD2NEW and OLD2NEW[base] != base and name in defined_names(OLD2NEW[base]):
            groups.setdefault(OLD2NEW[base], []).append((name, alias))  # the old module's name, where it is now
        elif is_package(base) and name in init_names(base):
            groups.setdefault(base, []).append((name, alias))  # moved into the package's __init__ since
        elif base in OLD2NEW:  # a name of a moved module (remote.runs.describe -> remote.runs.ops)
            groups.setdefault(OLD2NEW[base], []).append((name, alias))
        else:
            groups.setdefault(base, []).append((name, alias))
    out: dict[str, list[tuple[str, str | None]]] = {}
    for b, ns in groups.items():
        for name, alias in ns:
            where = NAME_MOVES.get(b, {}).get(name)
            if where is not None and name not in defined_names(b):
                b2 = where
            else:
                b2 = b
            out.setdefault(b2, []).append((name, alias))
    return list(out.items())


def render_from(base: str, names: list[tuple[str, str | None]], relative_to: str | None) -> str:
    if relative_to is not None:
        p, t = relative_to.split("."), base.split(".")
        k = 0
        while k < min(len(p), len(t)) and p[k] == t[k]:
            k += 1
        mod = "." * (len(p) - k + 1) + ".".join(t[k:])
    else:
        mod = base
    return f"from {mod} import " + ", ".join(n if a is None else f"{n} as {a}" for n, a in names)


def rewrite_imports(path: str, text: str, mods: set[str], moved_now: set[str]) -> tuple[str, list[str]]:
    """The file's text with its imports in new terms; and problems found."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        return text, [f"{path}: not parsed ({exc.msg}), imports left as they are"]
    cur = mod_of(path) or ""
    old_mod = NEW2OLD.get(cur)
    cur_pkg = package_of(cur, path)
    old_pkg = package_of(old_mod, PATH_NEW2OLD[path]) if old_mod and path in PATH_NEW2OLD else None
    lines = re.split(r"(?<=\n)", text)  # as ast counts lines (splitlines also splits on \x0c and others)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))

    def pos(lineno: int, col: int) -> int:
        """Character offset in text of ast's (line, UTF-8 byte column)."""
        return offsets[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    def span(node: ast.stmt) -> tuple[int, int]:
        return pos(node.lineno, node.col_offset), pos(node.end_lineno or node.lineno, node.end_col_offset or 0)

    edits: list[tuple[int, int, str]] = []
    problems: list[str] = []

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [(a.name, a.asname) for a in node.names]
            if node.level:
                # a moved file's relative imports were written for its old place (this run's moves, or
                # lines a merge brought); one that already resolves from the new place is kept
                new_base = resolve_relative(cur_pkg, node.level, node.module)
                old_base = resolve_relative(old_pkg, node.level, node.module) if old_pkg is not None else None
                if old_base is not None and path in moved_now:
                    base = old_base
                elif new_base is not None and names_resolve(new_base, names, mods):
                    base = new_base
                else:
                    base = old_base or new_base
                if base is None:
                    problems.append(f"{path}:{node.lineno}: relative import beyond the top package")
                    continue
                rel: str | None = cur_pkg
            else:
                base = node.module or ""
                if base.split(".")[0] not in TOP or base.startswith("remote._vendor"):
                    continue
                rel = None
            if not (base == "remote" or base.startswith(("remote.", "orchestrator"))):
                continue
            groups = map_from(base, names, mods)
            new = [render_from(b, ns, rel) for b, ns in groups]
            start, end = span(node)
            old_text = text[start:end]
            bare = re.sub(r"#[^\n]*", "", old_text).replace("\\\n", " ")
            norm = " ".join(bare.replace("(", " ").replace(")", " ").split()).replace(" ,", ",").rstrip(",")
            if len(new) == 1 and norm == " ".join(new[0].split()):
                continue
            if len(groups) == 1 and groups[0][1] == names:  # only the module changes: edit it in place
                spec = new[0][len("from "):new[0].index(" import ")]
                m = re.match(r"from\s+([.\w]+)\s+import\b", old_text)
                if m:
                    edits.append((start + m.start(1), start + m.end(1), spec))
                    continue
            if "#" in old_text:
                problems.append(f"{path}:{node.lineno}: an import with a comment inside needs a hand edit")
                continue
            indent = " " * (start - offsets[node.lineno - 1])
            edits.append((start, end, ("\n" + indent).join(new)))
        elif isinstance(node, ast.Import):
            changed = False
            parts = []
            for a in node.names:
                n = OLD2NEW.get(a.name, a.name) if a.name.startswith(TOP) else a.name
                changed |= n != a.name
                parts.append(n if a.asname is None else f"{n} as {a.asname}")
            if changed:
                start, end = span(node)
                edits.append((start, end, "import " + ", ".join(parts)))
    for start, end, new_text in sorted(edits, reverse=True):
        text = text[:start] + new_text + text[end:]
    return text, problems


# --------------------------------------------------------------------------------------------- text

# each rule: (pattern, replacement, a literal the pattern cannot match without: a text without it is skipped)
def _dotted_rules(mods: set[str]) -> list[tuple[re.Pattern[str], object, str]]:
    rules: list[tuple[re.Pattern[str], object, str]] = []
    for old in sorted(OLD2NEW, key=len, reverse=True):
        new = OLD2NEW[old]
        if old == new:
            continue
        if old in mods:  # the old name is now a package (remote.runs): only ``old.attr`` moves
            def sub(m: re.Match[str], old: str = old, new: str = new) -> str:
                attr = m.group(1)
                keep = f"{old}.{attr}" in mods or (attr in init_names(old) and attr not in defined_names(new))
                return m.group(0) if keep else f"{new}.{attr}"
            rules.append((re.compile(rf"(?<![\w.]){re.escape(old)}\.(\w+)"), sub, old))
        else:
            rules.append((re.compile(rf"(?<![\w.]){re.escape(old)}(?![\w])"), new, old))
    return rules


def _path_rules() -> list[tuple[re.Pattern[str], str, str]]:
    rules = []
    for old, new in sorted(MOVES, key=lambda m: len(m[0]), reverse=True):
        if old.endswith((".py", ".json")):
            rules.append((re.compile(rf"(?<![\w-]){re.escape(old)}(?![\w/])"), new, old))
        else:  # a folder: the name alone, or followed by a slash
            rules.append((re.compile(rf"(?<![\w-]){re.escape(old)}(?![\w])"), new, old))
    rules.append((re.compile(r'/ "demo_job" /'), '/ "demo" / "job" /', '"demo_job"'))
    return rules


_FROM_TEXT = re.compile(r"\bfrom ((?:remote|orchestrator)(?:\.\w+)*) import (\w+(?:, \w+)*)(?![\w,]| as\b)")


_KEEP = re.compile(r"(<!-- relayout: keep -->.*?<!-- /relayout: keep -->)", re.S)


def rewrite_text(text: str, mods: set[str], dotted, paths) -> str:  # type: ignore[no-untyped-def]
    """``text`` with old names rewritten, except between ``<!-- relayout: keep -->`` and
    ``<!-- /relayout: keep -->`` (a doc that shows the old layout on purpose)."""
    parts = _KEEP.split(text)
    return "".join(part if i % 2 else _rewrite_text(part, mods, dotted, paths) for i, part in enumerate(parts))


def _rewrite_text(text: str, mods: set[str], dotted, paths) -> str:  # type: ignore[no-untyped-def]
    def from_sub(m: re.Match[str]) -> str:
        names = [(n, None) for n in m.group(2).split(", ")]
        groups = map_from(m.group(1), names, mods)  # type: ignore[arg-type]
        if groups == [(m.group(1), names)]:
            return m.group(0)
        return "; ".join(render_from(b, ns, None) for b, ns in groups)

    text = _FROM_TEXT.sub(from_sub, text)
    for pat, rep, literal in paths:
        if literal in text:
            text = pat.sub(rep, text)
    for pat, rep, literal in dotted:
        if literal in text:
            text = pat.sub(rep, text)  # type: ignore[call-overload]
    return text


def is_text(path: str) -> bool:
    if path.startswith(SKIP_PREFIXES) or path in SKIP_FILES:
        return False
    return Path(path).suffix in TEXT_SUFFIXES or path.startswith(".ci/")


# ------------------------------------------------------------------------------------------- checks

def unresolved(files: list[str], mods: set[str]) -> list[str]:
    """Imports of orchestrator/remote modules that name no module (after the rewrite)."""
    out = []
    for path in files:
        if not path.endswith(".py") or path.startswith(SKIP_PREFIXES) or path in SKIP_FILES:
            continue
        try:
            tree = ast.parse((ROOT / path).read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        cur = mod_of(path) or ""
        pkg = package_of(cur, path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = resolve_relative(pkg, node.level, node.module) if node.level else (node.module or "")
                if not base or not (base == "remote" or base.startswith(("remote.", "orchestrator"))):
                    continue
                if base.startswith("remote._vendor"):
                    continue
                if base not in mods:
                    out.append(f"{path}:{node.lineno}: no module {base}")
                elif not names_resolve(base, [(a.name, a.asname) for a in node.names], mods):
                    out.append(f"{path}:{node.lineno}: a name not in package {base}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(TOP) and a.name not in mods:
                        out.append(f"{path}:{node.lineno}: no module {a.name}")
    return out


# --------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is still old")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    dry = args.check

    moved, problems = do_moves(dry)
    made = make_packages(dry)
    files = repo_files()
    mods = current_modules(files)
    dotted, paths = _dotted_rules(mods), _path_rules()
    fixups: dict[str, list[tuple[str, str]]] = {}
    for p, pat, rep in FIXUPS:
        fixups.setdefault(p, []).append((pat, rep))

    changed: list[str] = []
    for path in files:
        if not is_text(path):
            continue
        try:
            text = (ROOT / path).read_text()
        except UnicodeDecodeError:
            continue
        new = text
        if path.endswith(".py"):
            new, probs = rewrite_imports(path, new, mods, set(moved))
            problems += probs
        new = rewrite_text(new, mods, dotted, paths)
        for pat, rep in fixups.get(path, []):
            new = re.sub(pat, rep, new)
        if new != text:
            changed.append(path)
            if not dry:
                (ROOT / path).write_text(new)

    py = [p for p in changed if p.endswith(".py")]
    if py and not dry:
        ruff = next((r for r in (ROOT / ".venv/bin/ruff", Path(sys.executable).parent / "ruff",
                                 shutil.which("ruff")) if r and Path(r).is_file()), None)
        if ruff is not None:
            subprocess.run([str(ruff), "check", "--quiet", "--select", "I", "--fix", *py], cwd=ROOT)
        else:
            problems.append("ruff not found: imports not re-sorted (ruff check --select I --fix)")
    problems += unresolved(repo_files(), current_modules(repo_files()))

    for p in moved:
        print(f"moved: {p}")
    for p in made:
        print(f"{'would create' if dry else 'created'}: {p}")
    for p in changed:
        print(f"{'would rewrite' if dry else 'rewrote'}: {p}")
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    if dry:
        return 1 if (changed or made or problems) else 0
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
