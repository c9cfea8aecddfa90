"""What is installed in an interpreter, and does it hold together? (python3 3.8+, stdlib + vendored packaging)

Run it with the interpreter to inspect -- a job's venv python -- so the answer comes from
that environment in a fresh process:  ``VENV/bin/python -m remote.env.pkgcheck`` with the request
as JSON on stdin (agent.run_module(conn, "remote.env.pkgcheck", req, python=job.venv_python)).

Request::

    {"pins": ["torch==2.11.0", "triton>=3.6", ...],           # PEP 508 specs that must hold
     "overrides": [{"package": "triton==3.7.0", "reason": "..."}],
     "names": ["torch", ...] | null,                          # whose module __version__ to read
     "candidates": ["triton==3.7.0"]}                         # optional: who forbids these versions?

Checks, reported as ``problems`` (each {"kind", "package", "expected", "found", "message"}):

* ``pin``/``missing``: each pin whose marker holds here is installed at a matching version;
* ``requirement``/``missing``: like ``pip check``, every installed distribution's Requires-Dist
  holds (markers evaluated, with the extras actually requested: those in the pins and,
  transitively, in other distributions' requirements), e.g.
  ``torch 2.11.0 requires triton==3.6.0; triton is 3.7.0``;
* ``version_mismatch``: the module's ``__version__`` differs from the distribution's metadata
  (a stale or shadowing copy); ``import``: the module of a named distribution fails to import.

Modules are imported only for ``names`` (null means: the pins' distributions; [] means none),
because importing torch takes seconds; everything else is read from metadata.

A ``pin``/``requirement`` problem on an overridden package whose installed version satisfies
the override becomes a warning (same shape plus ``reason``) quoting the override's reason.
Names are normalized per PEP 503 (lowercase, runs of -_. become -). ``conflicts`` lists, for each
exact candidate version, the installed distributions whose pins forbid it (used to name the pin
when an installer refuses a request).
"""
from __future__ import annotations

import importlib
import os
import platform
import sys
import warnings

try:
    import importlib.metadata as metadata
except ImportError:  # pragma: no cover - python < 3.8
    metadata = None  # type: ignore[assignment]

from remote._proto import RemoteError, main
from remote._vendor.packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from remote._vendor.packaging.requirements import InvalidRequirement, Requirement
from remote._vendor.packaging.specifiers import InvalidSpecifier, SpecifierSet
from remote._vendor.packaging.utils import canonicalize_name
from remote._vendor.packaging.version import Version
from remote.lib.redact import redact, redact_obj


class Dist:
    __slots__ = ("key", "name", "version", "requires", "dist")

    def __init__(self, dist: metadata.Distribution) -> None:
        self.dist = dist
        self.name = dist.metadata["Name"]
        self.key = canonicalize_name(self.name)
        self.version = dist.version
        self.requires = list(dist.requires or [])


AGENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def search_path() -> list:
    """sys.path without dfo's own code (the agent copy on PYTHONPATH) and the working directory."""
    skip = set([os.path.realpath(AGENT_DIR), os.path.realpath(os.getcwd())])
    return [p for p in sys.path if p and os.path.realpath(p) not in skip]


def installed() -> dict:
    """Normalized name -> Dist, the first one on sys.path winning (as import would)."""
    out = {}  # type: dict
    for d in metadata.distributions(path=search_path()):
        try:
            if not d.metadata["Name"]:
                continue
            dist = Dist(d)
        except Exception:  # noqa: BLE001 - a broken dist-info is skipped, never fatal
            continue
        out.setdefault(dist.key, dist)
    return out


def problem(kind: str, package: str | None, expected: str | None, found: str | None, message: str,
            **extra: object) -> dict:
    p: dict[str, object] = {"kind": kind, "package": package, "expected": expected, "found": found,
                            "message": message}
    p.update(extra)
    return p


def first_line(exc: Exception) -> str:
    """packaging's parse errors add the text and a caret on further lines; messages keep one."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def dist_key(req: Requirement) -> str:
    """The normalized (PEP 503) distribution name of a requirement."""
    return canonicalize_name(req.name)


def _parse(spec: str) -> Requirement:
    try:
        return Requirement(spec)
    except (InvalidRequirement, InvalidSpecifier) as exc:
        raise RemoteError("config", redact("invalid package spec %r: %s" % (spec, first_line(exc)))) from None


def _applies(req: Requirement, extras: set) -> bool:
    if req.marker is None:
        return True
    for extra in [""] + sorted(extras):
        try:
            if req.marker.evaluate({"extra": extra}):
                return True
        except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName):
            return False
    return False


def _contains(spec: SpecifierSet, version: str) -> bool:
    """Pre-releases that match count (an installed 3.7.0rc1 satisfies >=3.6, as for pip check)."""
    return spec.contains(version, prereleases=True)


def check_pins(pins: list, dists: dict) -> list:
    out = []
    for spec in pins:
        req = _parse(spec)
        if not _applies(req, set(req.extras)):
            continue
        d = dists.get(dist_key(req))
        want = str(req.specifier) or None
        if d is None:
            out.append(problem("missing", dist_key(req), want, None,
                               "asked %s; %s is not installed" % (spec, req.name)))
        elif not _contains(req.specifier, d.version):
            out.append(problem("pin", dist_key(req), want, d.version, "asked %s; %s is %s" % (spec, d.name, d.version)))
    return out


def requested_extras(pins: list, dists: dict) -> dict:
    """Normalized name -> extras requested of it (by the pins, then transitively)."""
    extras = {}  # type: dict
    for spec in pins:
        req = _parse(spec)
        extras.setdefault(dist_key(req), set()).update(canonicalize_name(e) for e in req.extras)
    changed = True
    while changed:
        changed = False
        for d in dists.values():
            for req in _requirements(d):
                if req.extras and _applies(req, extras.get(d.key, set())):
                    have = extras.setdefault(dist_key(req), set())
                    new = set(canonicalize_name(e) for e in req.extras) - have
                    if new:
                        have.update(new)
                        changed = True
    return extras


def _requirements(d: Dist) -> list:
    out = []
    for text in d.requires:
        try:
            out.append(Requirement(text))
        except (InvalidRequirement, InvalidSpecifier):
            continue  # a malformed Requires-Dist is the producer's bug; pip skips it too
    return out


def check_consistency(dists: dict, extras: dict) -> list:
    out = []
    for d in sorted(dists.values(), key=lambda x: x.key):
        for req in _requirements(d):
            if not _applies(req, extras.get(d.key, set())):
                continue
            target = dists.get(dist_key(req))
            want = req.name + str(req.specifier)
            if target is None:
                out.append(problem("missing", dist_key(req), str(req.specifier) or None, None,
                                   "%s %s requires %s, which is not installed" % (d.name, d.version, want),
                                   required_by=d.key))
            elif not _contains(req.specifier, target.version):
                out.append(problem("requirement", dist_key(req), str(req.specifier), target.version,
                                   "%s %s requires %s; %s is %s" % (d.name, d.version, want, target.name,
                                                                    target.version),
                                   required_by=d.key))
    return out


def check_candidates(candidates: list, dists: dict, extras: dict) -> list:
    """Installed distributions whose pins forbid an asked exact version (``name==V``)."""
    out = []
    for spec in candidates:
        cand = _parse(spec)
        version = exact_version(cand.specifier)
        if version is None:
            continue
        for d in sorted(dists.values(), key=lambda x: x.key):
            if d.key == dist_key(cand):
                continue
            for req in _requirements(d):
                if dist_key(req) == dist_key(cand) and _applies(req, extras.get(d.key, set())) \
                        and not _contains(req.specifier, version):
                    out.append(problem("requirement", dist_key(cand), str(req.specifier), version,
                                       "%s %s requires %s%s; the job asks %s" % (d.name, d.version, req.name,
                                                                                 req.specifier, spec),
                                       required_by=d.key))
    return out


def exact_version(spec: SpecifierSet) -> str | None:
    """The version of a single ``==V`` (no wildcard) clause, else None."""
    clauses = list(spec)
    if len(clauses) == 1 and clauses[0].operator in ("==", "===") and "*" not in clauses[0].version:
        return clauses[0].version
    return None


def _top_level(d: Dist) -> list:
    names = []
    text = None
    try:
        text = d.dist.read_text("top_level.txt")
    except Exception:  # noqa: BLE001
        pass
    if text:
        names = [n.strip() for n in text.splitlines() if n.strip()]
    else:
        for f in d.dist.files or []:
            parts = str(f).replace("\\", "/").split("/")
            head = parts[0]
            if head in ("..", "") or head.endswith((".dist-info", ".data", ".egg-info")) or head == "__pycache__":
                continue
            if len(parts) == 1 and head.endswith(".py"):
                names.append(head[:-3])
            elif len(parts) > 1 and parts[-1] == "__init__.py" and len(parts) == 2:
                names.append(head)
    names = [n for n in dict.fromkeys(names) if n.isidentifier()]
    prefer = d.key.replace("-", "_")
    return sorted(names, key=lambda n: (n.lower() != prefer, n))


def module_versions(names: list, dists: dict) -> tuple:
    versions: dict[str, str | None] = {}
    problems: list[dict] = []
    for raw in names:
        key = canonicalize_name(raw)
        d = dists.get(key)
        versions[key] = None
        if d is None:
            continue
        for mod in _top_level(d):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    m = importlib.import_module(mod)
                    mv = getattr(m, "__version__", None)
            except BaseException as exc:  # noqa: BLE001 - SystemExit from a module counts too
                problems.append(problem("import", key, d.version, None, "import %s (from %s %s) failed: %s: %s"
                                        % (mod, d.name, d.version, type(exc).__name__, str(exc)[:300])))
                break
            if not isinstance(mv, str):
                continue
            versions[key] = mv
            if not _same_version(mv, d.version):
                where = getattr(m, "__file__", None) or "?"
                problems.append(problem(
                    "version_mismatch", key, d.version, mv,
                    "%s: the module %s says __version__ %s but the installed distribution is %s (module at %s)"
                    % (d.name, mod, mv, d.version, where)))
            break
    return versions, problems


def _same_version(a: str, b: str) -> bool:
    """Equal as public versions: a local label on one side only is a build tag, not another
    release (torch's module says 2.11.0+cu130 where some images record the distribution as 2.11.0,
    as seen on an H200 image)."""
    try:
        va, vb = Version(a), Version(b)
    except ValueError:
        return a.strip() == b.strip()
    if va == vb:
        return True
    la, lb = a.partition("+")[2], b.partition("+")[2]
    if bool(la) != bool(lb):
        return Version(a.partition("+")[0]) == Version(b.partition("+")[0])
    return False


def apply_overrides(problems: list, overrides: list) -> tuple:
    """Split problems into (problems, warnings): an overridden package's broken pin is a warning."""
    by_key = {}
    for o in overrides:
        req = _parse(o["package"])
        by_key[dist_key(req)] = (req, o.get("reason") or "")
    kept, warned = [], []
    for p in problems:
        hit = by_key.get(p.get("package") or "")
        if hit and p["kind"] in ("pin", "requirement") and p.get("found") is not None \
                and _contains(hit[0].specifier, p["found"]):
            w = dict(p)
            w["reason"] = hit[1]
            w["message"] = '%s (overridden by %s: "%s")' % (p["message"], hit[0], hit[1])
            warned.append(w)
        else:
            kept.append(p)
    return kept, warned


def check(request: dict) -> dict:
    if metadata is None:
        raise RemoteError("verify", "python %s has no importlib.metadata; dfo needs python 3.8 or newer"
                          % platform.python_version())
    pins = list(request.get("pins") or [])
    overrides = list(request.get("overrides") or [])
    names = request.get("names")
    if names is None:
        names = [dist_key(_parse(p)) for p in pins]
    dists = installed()
    extras = requested_extras(pins, dists)
    problems = check_pins(pins, dists)
    problems += check_consistency(dists, extras)
    versions, import_problems = module_versions(names, dists)
    problems, warnings = apply_overrides(problems + import_problems, overrides)
    return redact_obj({  # a package line's URL credentials never leave the node
        "python": platform.python_version(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "packages": dict(sorted((k, d.version) for k, d in dists.items())),
        "module_versions": versions,
        "problems": problems,
        "warnings": warnings,
        "conflicts": check_candidates(list(request.get("candidates") or []), dists, extras),
    })


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main(check)
