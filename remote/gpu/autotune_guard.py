"""Make stock Triton's ``Autotuner`` safe to call from several threads, at run time.

Why: ``Autotuner.run`` keeps per-call state on the (shared, module-level) kernel object:
``self.nargs`` is written on *every* call, cached ones included, and reset to None at the
end, so thread B's cached call makes thread A, busy tuning, crash in ``_bench`` at
``full_nargs = {**self.nargs, **current}`` (TypeError), or run A's hooks on B's tensors.
``restore_copies``, ``configs_timings`` and ``bench_time`` have the same problem, and two
threads may tune the same key at once (see docs/gpu.md).

What ``install()`` does, once per process (a second call is a no-op):

a) per-thread call state: class-level data descriptors on ``Autotuner`` for ``nargs``,
   ``restore_copies``, ``configs_timings`` and ``bench_time``. A data descriptor on the class
   wins over the instance ``__dict__``, so it covers kernels built before ``install()`` and
   every subclass (FLA's ``CachedAutotuner`` included) with nothing stored on instances.
b) single-flight tuning: ``Autotuner.run`` is wrapped at class level. It computes the tuning
   key as Triton does; a cached key calls the original ``run`` with no lock; a missing key
   takes the kernel's own ``RLock`` (from a module-level registry, created under a module
   lock) and then calls the original ``run``, which re-checks the cache, so a thread that
   waited reuses the config the first one found. Subclasses that call ``super().run``
   (FLA's ``CachedAutotuner``) reach the wrapper.

The guard is written against ``triton/runtime/autotuner.py`` as shipped in the wheels listed
in ``VERIFIED``; on any other file it refuses (``GuardRefused``) unless
``DFO_AUTOTUNE_GUARD_FORCE=1`` (or ``install(force=True)``).

Import cost: stdlib only at import time; triton is imported by ``install()``.
"""
from __future__ import annotations

import gc
import hashlib
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

FORCE_ENV = "DFO_AUTOTUNE_GUARD_FORCE"
MARKER = "_dfo_autotune_guard"  # set on the Autotuner class: survives a second copy of this module

# sha256 of triton/runtime/autotuner.py in the PyPI wheels, each read before being listed here.
# 3.6.0, 3.7.0 and 3.7.1 are byte-identical. 3.8.0 and 3.9.0 keep run()'s key logic (the lines
# from `self.nargs = dict(zip(...))` to `key = tuple(key)`) and the same per-call attributes;
# they add a single-config short-cut, a knobs.autotuning.listener call (reads
# configs_timings and bench_time) and None-safe default hooks; 3.9.0 also sets
# restore_copies = {} in __init__.
VERIFIED: Dict[str, str] = {
    "3.6.0": "40f5e142806219942585a16742e9f3721d5bfef88145b571cf389f9aec6460bb",
    "3.7.0": "40f5e142806219942585a16742e9f3721d5bfef88145b571cf389f9aec6460bb",
    "3.7.1": "40f5e142806219942585a16742e9f3721d5bfef88145b571cf389f9aec6460bb",
    "3.8.0": "119055c98dfef66a1ae8a72e4bdf44185993ee24902ced5086caa7f9de9cef16",
    "3.9.0": "b8ad4c3605f36dedba0ed3a0cba0c29ccbede646064343c8923695cb5c9466e0",
}
SLOTS = ("nargs", "restore_copies", "configs_timings", "bench_time")
_REQUIRED_METHODS = ("run", "_bench", "prune_configs", "warmup", "check_disk_cache")


class GuardRefused(RuntimeError):
    """The installed Triton is not one the guard was checked against (or is missing)."""


_install_lock = threading.Lock()
_registry_lock = threading.Lock()
_locks: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_locks_by_id: Dict[int, threading.RLock] = {}  # for instances that take no weak reference
_stats = {"cold_calls": 0, "reused_after_wait": 0}
_MISSING = object()


# -- (a) per-thread state ------------------------------------------------------------------

def _make_slot(name: str, default: Optional[Callable[[], Any]], shared_fallback: bool) -> property:
    """A property storing ``name`` per thread and per instance.

    ``default`` builds the value a thread sees before it set one (None: AttributeError,
    as for an attribute Triton never set). With ``shared_fallback``, such a thread sees the
    value last set by any thread (kept for readers such as user code inspecting
    ``kernel.configs_timings`` after a worker tuned it; Triton itself only reads its own).
    """
    local = threading.local()
    published: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def fget(self: Any) -> Any:
        try:
            return local.values[self]
        except (AttributeError, KeyError):
            pass
        if shared_fallback:
            try:
                value = published.get(self, _MISSING)
            except TypeError:
                value = _MISSING
            if value is not _MISSING:
                return value
        if default is None:
            raise AttributeError(name)
        return default()

    def fset(self: Any, value: Any) -> None:
        try:
            local.values[self] = value
        except AttributeError:
            local.values = {self: value}
        if shared_fallback:
            try:
                published[self] = value
            except TypeError:
                pass

    def fdel(self: Any) -> None:
        try:
            del local.values[self]
        except (AttributeError, KeyError):
            raise AttributeError(name) from None

    return property(fget, fset, fdel, "per-thread %r (dfo autotune guard)" % name)


_SLOT_SPECS: Dict[str, Tuple[Optional[Callable[[], Any]], bool]] = {
    "nargs": (lambda: None, False),
    "restore_copies": (dict, False),
    "configs_timings": (None, True),
    "bench_time": (None, True),
}


# -- (b) single-flight tuning ------------------------------------------------------------

def tuning_key(kernel: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """The key ``Autotuner.run`` looks up in ``kernel.cache``.

    Same result as Triton's ``run`` (argument names zipped with positional args, updated by
    keyword args that are kernel arguments, in that order; the ``key`` arguments' values,
    then the dtype of every argument that has one), computed with fewer temporaries.
    """
    arg_names = kernel.arg_names
    named = dict(zip(arg_names, args))  # noqa: B905 - truncating, as Triton; no strict= on 3.8
    for k in kwargs:
        if k in arg_names:
            named[k] = kwargs[k]
    key = [named[k] for k in kernel.keys if k in named]
    for value in named.values():
        dtype = getattr(value, "dtype", _MISSING)
        if dtype is not _MISSING:
            key.append(str(dtype))
    return tuple(key)


def _lock_for(kernel: Any) -> threading.RLock:
    try:
        lock = _locks.get(kernel)
    except TypeError:
        lock = _locks_by_id.get(id(kernel))
    if lock is not None:
        return lock
    with _registry_lock:
        try:
            lock = _locks.get(kernel)
            if lock is None:
                lock = _locks[kernel] = threading.RLock()
        except TypeError:
            lock = _locks_by_id.get(id(kernel))
            if lock is None:
                lock = _locks_by_id[id(kernel)] = threading.RLock()
    return lock


def _make_guarded_run(original: Callable[..., Any], fast_path: bool) -> Callable[..., Any]:
    """The class-level ``run``: cached keys take no lock, missing keys tune one at a time.

    With ``fast_path`` (verified Triton versions only), a cached key goes straight to the
    launch, taking the steps Triton's own ``run`` takes for a cached key (``best_config``,
    the config's ``pre_hook``, ``fn.run``) minus the ``nargs`` writes that no one reads
    there; so the key is computed once per call, as on stock Triton.
    """
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(self.configs) > 1:
            try:
                key: Any = tuning_key(self, args, kwargs)
                config = self.cache.get(key)
            except Exception:  # cannot tell: the lock is always safe
                key, config = _MISSING, None
            if config is None:
                with _lock_for(self):
                    with _registry_lock:
                        _stats["cold_calls"] += 1
                        if key is not _MISSING and key in self.cache:
                            _stats["reused_after_wait"] += 1
                    return original(self, *args, **kwargs)
            if fast_path:
                self.best_config = config
                meta = config.all_kwargs()
                if config.pre_hook is not None:
                    config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **meta})  # noqa: B905
                return self.fn.run(*args, **kwargs, **meta)
        return original(self, *args, **kwargs)

    run.__name__ = "run"
    run.__qualname__ = "Autotuner.run"
    run.__doc__ = original.__doc__
    run.__wrapped__ = original  # type: ignore[attr-defined]
    return run


# -- version check -----------------------------------------------------------------------

def _file_sha256(path: Optional[str]) -> Optional[str]:
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_triton(version: Optional[str], autotuner_path: Optional[str]) -> Tuple[bool, str, Optional[str]]:
    """(verified, message, sha256 of autotuner.py) for a Triton install."""
    sha = _file_sha256(autotuner_path)
    listed = sorted(VERIFIED)
    if sha is not None and sha in VERIFIED.values():
        same = [v for v, h in VERIFIED.items() if h == sha]
        note = "" if version in same else " (version says %s)" % version
        return True, "triton/runtime/autotuner.py matches the one verified for triton %s%s" % (
            ", ".join(same), note), sha
    if sha is None and version in VERIFIED:
        return True, "triton %s is verified (autotuner.py source not readable to compare)" % version, sha
    if version in VERIFIED:
        why = ("triton %s is listed, but its runtime/autotuner.py differs from the PyPI wheel's "
               "(sha256 %s): a patched or rebuilt Triton" % (version, sha))
    else:
        why = "triton %s is not a version the guard was checked against" % version
    return False, ("dfo autotune guard refused: %s. Verified: %s. Read autotuner.py of this version, "
                   "add it to remote/gpu/autotune_guard.py VERIFIED, or set %s=1 to install anyway."
                   % (why, ", ".join(listed), FORCE_ENV)), sha


def _triton_modules() -> Tuple[Any, Any]:
    try:
        import triton
        from triton.runtime import autotuner
    except Exception as exc:  # ImportError, or a broken install
        raise GuardRefused("dfo autotune guard: triton is not importable (%s: %s)" % (
            type(exc).__name__, exc)) from exc
    return triton, autotuner


def _all_subclasses(cls: type) -> List[type]:
    out: List[type] = []
    todo: List[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in out:
            out.append(sub)
            todo.extend(sub.__subclasses__())
    return out


def autotuner_instances() -> List[Any]:
    """Every live Autotuner (subclasses included), found through the garbage collector."""
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:
        return []
    # type() rather than isinstance(): some objects (deprecated proxies) warn on __class__
    return [o for o in gc.get_objects() if issubclass(type(o), Autotuner)]


# -- public API --------------------------------------------------------------------------

def is_installed() -> bool:
    """Whether the guard is active on the imported Triton (False when triton is absent)."""
    import sys
    mod = sys.modules.get("triton.runtime.autotuner")
    if mod is None:
        return False
    return MARKER in mod.Autotuner.__dict__


def install(force: Optional[bool] = None, scan_existing: bool = True,
            fast_path: Optional[bool] = None) -> Dict[str, Any]:
    """Install the guard (idempotent) and return a small report.

    Raises ``GuardRefused`` when triton is missing or unverified (unless forced: argument, or
    ``DFO_AUTOTUNE_GUARD_FORCE=1``). ``scan_existing`` counts (via gc) the kernels that
    already exist, and drops stale per-call attributes from their ``__dict__``.
    ``fast_path`` (default: on for verified versions only) lets cached calls skip Triton's
    ``run`` (see ``_make_guarded_run``); off, every call goes through the original ``run``.
    """
    triton, autotuner = _triton_modules()
    cls = autotuner.Autotuner
    with _install_lock:
        marker = cls.__dict__.get(MARKER)
        if marker is not None:
            earlier: Dict[str, Any] = dict(marker["report"])
            earlier["already"] = True
            return earlier
        version = getattr(triton, "__version__", None)
        verified, message, sha = check_triton(version, getattr(autotuner, "__file__", None))
        forced = bool(force) if force is not None else os.environ.get(FORCE_ENV, "") not in ("", "0")
        if not verified and not forced:
            raise GuardRefused(message)
        missing = [m for m in _REQUIRED_METHODS if not callable(getattr(cls, m, None))]
        if missing and not forced:
            raise GuardRefused("dfo autotune guard refused: Autotuner lacks %s" % ", ".join(missing))
        subclasses = _all_subclasses(cls)
        shadowed = ["%s.%s" % (s.__qualname__, n) for s in subclasses for n in SLOTS if n in s.__dict__]
        if shadowed and not forced:
            raise GuardRefused("dfo autotune guard refused: subclass attributes would hide the "
                               "per-thread state: %s" % ", ".join(shadowed))
        original_run = cls.__dict__["run"]
        saved = {n: cls.__dict__.get(n, _MISSING) for n in SLOTS}
        for name in SLOTS:
            default, shared = _SLOT_SPECS[name]
            setattr(cls, name, _make_slot(name, default, shared))
        use_fast = verified if fast_path is None else bool(fast_path and verified)
        cls.run = _make_guarded_run(original_run, fast_path=use_fast)
        existing = 0
        if scan_existing:
            for obj in autotuner_instances():
                existing += 1
                for name in SLOTS:
                    obj.__dict__.pop(name, None)
        report: Dict[str, Any] = {
            "installed": True,
            "already": False,
            "triton": version,
            "autotuner_sha256": sha,
            "verified": verified,
            "forced": bool(forced and not verified),
            "check": message,
            "slots": list(SLOTS),
            "fast_path": use_fast,
            "existing_instances": existing if scan_existing else None,
            "subclasses": sorted("%s.%s" % (s.__module__, s.__qualname__) for s in subclasses),
            "subclasses_overriding_run": sorted(
                "%s.%s" % (s.__module__, s.__qualname__) for s in subclasses if "run" in s.__dict__),
            "pid": os.getpid(),
        }
        setattr(cls, MARKER, {"report": report, "run": original_run, "saved": saved})
        return dict(report)


def uninstall() -> bool:
    """Undo ``install()`` (for benchmarks and tests; never while other threads run kernels)."""
    import sys
    mod = sys.modules.get("triton.runtime.autotuner")
    if mod is None:
        return False
    cls = mod.Autotuner
    with _install_lock:
        marker = cls.__dict__.get(MARKER)
        if marker is None:
            return False
        cls.run = marker["run"]
        for name, value in marker["saved"].items():
            if value is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
        delattr(cls, MARKER)
        return True


def stats() -> Dict[str, int]:
    """Counters of the cold path: calls that took a kernel lock, and of those, calls that
    found their key tuned by another thread once they had it."""
    with _registry_lock:
        return dict(_stats)
