"""dfo: install the Triton autotuner guard in this interpreter, lazily, with no trainer change.

Put this folder first on the run's PYTHONPATH (``run.autotune_guard: true`` does). Python's
``site`` imports ``sitecustomize`` at start-up; this one then:

1. adds an import hook that waits for ``import triton`` to finish; a program that never
   imports triton pays for one finder on ``sys.meta_path`` and nothing else;
2. when triton has been imported, installs ``remote/gpu/autotune_guard.py`` (loaded from
   this folder's parent under a private module name, so nothing named ``remote`` lands on
   the trainer's path) and appends one JSON line to ``$DFO_AUTOTUNE_GUARD_LOG`` if set:
   ``{"installed": true, "triton": "3.6.0", "pid": 123, ...}``, or ``"installed": false``
   with the reason (a Triton version the guard was not checked against, say). A refusal
   prints one line to stderr and the program goes on unguarded, unless
   ``DFO_AUTOTUNE_GUARD_STRICT=1``, which makes it raise at ``import triton``;
3. chains to the ``sitecustomize`` that this one hides (the next one on ``sys.path``: a
   distribution's or a virtualenv's), as ``site`` would have run it.

``DFO_AUTOTUNE_GUARD=0`` turns all of it off but the chaining. Stdlib only, python3.8+.
"""
import importlib.machinery
import importlib.util
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_GUARD_FILE = os.path.join(os.path.dirname(_HERE), "autotune_guard.py")
_GUARD_MODULE = "_dfo_autotune_guard"
_TARGET = "triton"


def _log(record):
    path = os.environ.get("DFO_AUTOTUNE_GUARD_LOG")
    if not path:
        return
    record.setdefault("pid", os.getpid())
    record.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    record.setdefault("argv0", sys.argv[0] if sys.argv else None)
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    except OSError as exc:
        sys.stderr.write("dfo autotune guard: cannot write %s: %s\n" % (path, exc))


def _load_guard():
    mod = sys.modules.get(_GUARD_MODULE)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(_GUARD_MODULE, _GUARD_FILE)
    if spec is None or spec.loader is None:
        raise ImportError("cannot load %s" % _GUARD_FILE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_GUARD_MODULE] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(_GUARD_MODULE, None)
        raise
    return mod


def install_now():
    """Install the guard (triton must be importable); log and return the report."""
    strict = os.environ.get("DFO_AUTOTUNE_GUARD_STRICT", "") not in ("", "0")
    try:
        guard = _load_guard()
        report = guard.install()
    except Exception as exc:
        _log({"installed": False, "error": "%s: %s" % (type(exc).__name__, exc)})
        if strict:
            raise
        sys.stderr.write("dfo autotune guard NOT installed: %s\n" % (exc,))
        return None
    if not report.get("already"):
        _log({"installed": True, "triton": report.get("triton"), "verified": report.get("verified"),
              "forced": report.get("forced"), "existing_instances": report.get("existing_instances")})
    return report


class _Loader(object):
    """Runs the real loader, puts it back on the module, then installs the guard."""

    def __init__(self, real, finder):
        self._real = real
        self._finder = finder

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec.loader = self._real
        module.__loader__ = self._real
        self._real.exec_module(module)
        self._finder.remove()
        install_now()

    def __getattr__(self, name):
        return getattr(self._real, name)


class _Finder(object):
    """A meta path finder that only answers for ``triton`` itself, once."""

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        # duck-typed: _Loader delegates to the real loader (no importlib.abc import at start-up)
        spec.loader = _Loader(spec.loader, self)  # type: ignore[assignment]
        return spec

    def remove(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def invalidate_caches(self):
        pass


def _arm():
    if os.environ.get("DFO_AUTOTUNE_GUARD", "1") == "0":
        return
    if _TARGET in sys.modules:  # imported before site ran (unusual): install at once
        install_now()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _chain():
    """Run the sitecustomize this one hides, the way site.py runs one."""
    here = os.path.normcase(os.path.realpath(_HERE))
    rest = [p for p in sys.path if os.path.normcase(os.path.realpath(p or os.getcwd())) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             "%s: %s\n" % (err.__class__.__name__, err))
    return module


_arm()
chained = _chain()
