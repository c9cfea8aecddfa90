"""Unit tests of pure logic, no GPU: known-bad matching, version comparison, the autotune
guard's install/idempotence/refusal (against a stub ``triton`` and, where triton is
importable, against Triton's real ``Autotuner`` class driven by a fake launcher), the
sitecustomize hook and its chaining, and the preflight's no-torch path.

The race itself on a GPU is in tests/test_gpu.py and bench/gpu/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from remote.env import known_bad as kb
from remote.gpu import autotune_guard as guard
from remote.gpu.warmup import tuned_between

ROOT = Path(__file__).resolve().parents[1]
SITE_DIR = ROOT / "remote" / "gpu" / "sitecustomize_guard"


# -- versions ----------------------------------------------------------------------------

@pytest.mark.parametrize("a,b,want", [
    ("3.6.0", "3.7.1", -1), ("3.7.1", "3.7.1", 0), ("3.7", "3.7.0", 0), ("3.10.0", "3.9.9", 1),
    ("3.7.1rc1", "3.7.1", -1), ("3.7.1a1", "3.7.1b1", -1), ("3.7.1.dev1", "3.7.1a1", -1),
    ("3.7.1.post1", "3.7.1", 1), ("2.11.0+cu130", "2.11.0", 0), ("1!0.1", "2.0", 1),
])
def test_compare_versions(a: str, b: str, want: int) -> None:
    assert kb.compare_versions(a, b) == want


@pytest.mark.parametrize("version,spec,want", [
    ("3.6.0", ">=3.4.0,<3.7.1", True), ("3.7.1", ">=3.4.0,<3.7.1", False), ("3.3.1", ">=3.4.0,<3.7.1", False),
    ("3.7.1rc1", "<3.7.1", True),  # pre-releases are included on purpose
    ("2.7.0+cu126", "<2.7.0", False), ("2.6.0+cu124", "<2.7.0", True), ("0.6.0", "", True),
    ("3.7.5", "~=3.7.0", True), ("3.8.0", "~=3.7.0", False), ("3.7.2", "==3.7.*", True),
    ("3.8.0", "!=3.7.*", True), ("2.11.0+cu130", "==2.11.0", True), ("2.11.0+cu130", "==2.11.0+cu128", False),
])
def test_version_matches(version: str, spec: str, want: bool) -> None:
    assert kb.version_matches(version, spec) is want


def test_bad_version_text_raises() -> None:
    with pytest.raises(ValueError):
        kb.Version("not-a-version")


@pytest.mark.parametrize("cap,archs,want", [
    ("9.0", ["sm_80", "sm_90"], True), ("8.6", ["sm_80"], True), ("12.0", ["sm_80", "sm_90"], False),
    ("12.0", ["sm_90", "compute_90"], True), ("10.0", ["sm_90a"], False), ("9.0", ["sm_90a"], True),
    ("12.0", ["sm_100", "sm_120"], True), ("8.0", ["sm_86"], False), ("9.0", [], False),
])
def test_arch_support(cap: str, archs: list[str], want: bool) -> None:
    assert kb.arch_support(cap, archs)[0] is want


# -- known-bad entries -------------------------------------------------------------------

H200 = {"torch": "2.11.0+cu130", "triton": "3.6.0", "fla_core": "0.6.0", "flash-linear-attention": "0.6.0"}


def _ids(packages: dict[str, str | None], caps: list[str], archs: list[str] | None) -> list[str]:
    return [e["id"] for e, _p in kb.match_entries(packages, caps, archs)]


def test_fla_640_matches_hopper_with_triton_3_6() -> None:
    problems = kb.match_known_bad(H200, ["9.0"], ["sm_90", "sm_100"])
    assert len(problems) == 1
    p = problems[0]
    assert set(p) == {"kind", "package", "expected", "found", "message"}
    assert (p["kind"], p["package"], p["expected"], p["found"]) == ("known_bad", "triton", ">=3.7.1", "3.6.0")
    assert "#640" in p["message"] and "sm_90" in p["message"]


@pytest.mark.parametrize("change,caps", [
    ({"triton": "3.7.1"}, ["9.0"]),          # fixed Triton
    ({"tilelang": "0.1.9"}, ["9.0"]),        # FLA uses its TileLang backend instead
    ({}, ["8.0"]),                           # not Hopper
    ({"triton": "3.3.1"}, ["9.0"]),          # before the regression
    ({"fla_core": None, "flash-linear-attention": None}, ["9.0"]),  # no FLA
    ({}, []),                                # GPUs unknown: a GPU entry cannot match
])
def test_fla_640_does_not_match(change: dict[str, str | None], caps: list[str]) -> None:
    assert _ids({**H200, **change}, caps, None) == []


def test_fla_640_old_fla_refuses_any_new_triton() -> None:
    assert _ids({"triton": "3.8.0", "fla-core": "0.5.1"}, ["9.0"], None) == ["fla-640-hopper-gdn-backward-old-fla"]
    assert _ids({"triton": "3.8.0", "fla-core": "0.5.2"}, ["9.0"], None) == []


def test_torch_build_without_the_gpu_arch() -> None:
    old = {"torch": "2.6.0+cu124"}
    archs = ["sm_50", "sm_80", "sm_90"]
    assert _ids(old, ["12.0"], archs) == ["torch-build-lacks-gpu-arch"]
    p = kb.match_known_bad(old, ["9.0", "12.0"], archs)[0]
    assert "sm_120" in p["message"] and "sm_90 " not in p["message"].split("arch list")[0]
    assert _ids(old, ["12.0"], archs + ["sm_120"]) == []
    # without an arch list, the static rule on the torch version applies instead
    assert _ids(old, ["12.0"], None) == ["torch-predates-blackwell"]
    assert _ids({"torch": "2.7.0+cu128"}, ["12.0"], None) == []


def test_every_entry_is_complete() -> None:
    for e in kb.load_entries():
        for field in ("id", "source", "gpu", "packages", "breaks", "fix", "report"):
            assert field in e, (e.get("id"), field)
        for spec in e["packages"].values():
            for clause in filter(None, (c.strip() for c in spec.split(","))):
                kb.version_matches("1.0", clause)  # every clause parses


# -- the guard against a stub triton (no triton needed) ----------------------------------

def _stub_triton(monkeypatch: pytest.MonkeyPatch, version: str = "3.6.0") -> type:
    """Inject a minimal ``triton.runtime.autotuner`` (same attribute names) into sys.modules."""
    class Autotuner:
        def __init__(self) -> None:
            self.configs = [1]
            self.cache: dict[Any, Any] = {}
            self.nargs = None  # an instance attribute, as Triton leaves after a call

        def run(self, *args: Any, **kwargs: Any) -> str:
            self.nargs = dict(enumerate(args))
            seen = self.nargs
            self.nargs = None
            return f"ran {seen}"

        def _bench(self) -> None: ...
        def prune_configs(self) -> None: ...
        def warmup(self) -> None: ...
        def check_disk_cache(self) -> None: ...

    triton = types.ModuleType("triton")
    triton.__version__ = version  # type: ignore[attr-defined]
    runtime = types.ModuleType("triton.runtime")
    autotuner = types.ModuleType("triton.runtime.autotuner")
    autotuner.Autotuner = Autotuner  # type: ignore[attr-defined]
    runtime.autotuner = autotuner  # type: ignore[attr-defined]
    triton.runtime = runtime  # type: ignore[attr-defined]
    for name, mod in (("triton", triton), ("triton.runtime", runtime), ("triton.runtime.autotuner", autotuner)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv(guard.FORCE_ENV, raising=False)
    return Autotuner


def test_install_is_idempotent_and_covers_existing_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    Autotuner = _stub_triton(monkeypatch)
    before = Autotuner()
    before.nargs = {"stale": 1}  # lands in the instance __dict__ before install
    assert not guard.is_installed()
    first = guard.install()
    try:
        assert first["installed"] and not first["already"] and first["verified"]
        assert first["triton"] == "3.6.0" and first["existing_instances"] >= 1
        assert guard.is_installed()
        run_after_first = Autotuner.__dict__["run"]
        second = guard.install()
        assert second["already"] is True
        assert Autotuner.__dict__["run"] is run_after_first  # not wrapped twice
        for name in guard.SLOTS:
            assert isinstance(Autotuner.__dict__[name], property)
        assert "nargs" not in before.__dict__  # stale per-call state dropped
        assert before.nargs is None
    finally:
        assert guard.uninstall()
    assert not guard.is_installed()
    assert "nargs" not in Autotuner.__dict__ and not guard.uninstall()


def test_per_thread_state(monkeypatch: pytest.MonkeyPatch) -> None:
    Autotuner = _stub_triton(monkeypatch)
    guard.install()
    try:
        k = Autotuner()
        k.nargs = {"x": "main"}
        k.configs_timings = {"c": 1.0}
        seen: dict[str, Any] = {}

        def other() -> None:
            seen["nargs"] = k.nargs
            seen["restore"] = k.restore_copies
            seen["timings"] = k.configs_timings  # published value, for readers that never tuned
            k.nargs = {"x": "other"}
            k.configs_timings = {"c": 2.0}
            seen["own_timings"] = k.configs_timings

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == {"nargs": None, "restore": {}, "timings": {"c": 1.0}, "own_timings": {"c": 2.0}}
        assert k.nargs == {"x": "main"}  # the other thread's write did not reach this one
        assert k.configs_timings == {"c": 1.0}
        with pytest.raises(AttributeError):
            _ = Autotuner().bench_time  # never set by anyone: like an attribute Triton never set
    finally:
        guard.uninstall()


def test_refuses_unverified_version_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_triton(monkeypatch, version="3.5.0")
    with pytest.raises(guard.GuardRefused) as err:
        guard.install()
    msg = str(err.value)
    assert "3.5.0" in msg and "3.6.0" in msg and guard.FORCE_ENV in msg
    assert not guard.is_installed()
    monkeypatch.setenv(guard.FORCE_ENV, "1")
    try:
        report = guard.install()
        assert report["forced"] and not report["verified"] and report["fast_path"] is False
    finally:
        guard.uninstall()


def test_refuses_a_patched_autotuner_file(tmp_path: Path) -> None:
    patched = tmp_path / "autotuner.py"
    patched.write_text("# patched\n")
    ok, msg, sha = guard.check_triton("3.6.0", str(patched))
    assert not ok and "differs" in msg and sha is not None
    assert guard.check_triton("3.6.0", None)[0] is True


def test_refuses_subclass_that_would_hide_state(monkeypatch: pytest.MonkeyPatch) -> None:
    Autotuner = _stub_triton(monkeypatch)
    # keep a reference: an unreferenced class is freed by the cyclic GC at any moment, and
    # install() finds subclasses through the weak __subclasses__() list
    shadowing = type("Shadowing", (Autotuner,), {"nargs": None})
    with pytest.raises(guard.GuardRefused, match="Shadowing.nargs"):
        guard.install()
    assert shadowing in Autotuner.__subclasses__()


def test_missing_triton_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(guard.GuardRefused, match="not importable"):
        guard.install()


# -- the guard against Triton's real Autotuner class (triton importable; no GPU) ----------

class _FakeJit:
    """Stands in for a JITFunction: Autotuner only calls ``run`` and reads ``arg_names``/``fn``."""

    arg_names = ["x", "N"]

    def __init__(self) -> None:
        def kern(x: Any, N: Any, BLOCK: Any) -> None: ...
        self.fn = kern
        self.launches: list[tuple[Any, ...]] = []

    def run(self, *args: Any, grid: Any = None, warmup: bool = False, **kw: Any) -> Any:
        self.launches.append((args, kw.get("BLOCK")))
        return kw.get("BLOCK")


class _Tensorish:
    def __init__(self) -> None:
        self.dtype = "fp32"
        self.owner = threading.get_ident()


@pytest.fixture
def real_triton() -> Any:
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    guard.uninstall()
    yield autotuner
    guard.uninstall()


def _race_once(autotuner: Any) -> tuple[list[str], int]:
    """Thread A tunes N=8192 while thread B makes one cached N=4096 call (the crash scenario)."""
    a_in, b_done = threading.Event(), threading.Event()
    foreign: list[int] = []

    def do_bench(call: Any, quantiles: Any = None) -> list[float]:
        call()
        if threading.current_thread().name == "A" and not a_in.is_set():
            a_in.set()
            b_done.wait(5)
        return [1.0, 1.0, 1.0]

    def pre_hook(nargs: dict[str, Any], reset_only: bool = False) -> None:
        if nargs["x"].owner != threading.get_ident():
            foreign.append(1)

    Config = autotuner.Config
    k = autotuner.Autotuner(_FakeJit(), _FakeJit.arg_names, [Config({"BLOCK": b}) for b in (64, 128, 256)],
                            ["N"], None, None, pre_hook=pre_hook, do_bench=do_bench)
    k.run(_Tensorish(), 4096, grid=(1,), warmup=False)
    errors: list[str] = []

    def a() -> None:
        try:
            k.run(_Tensorish(), 8192, grid=(1,), warmup=False)
        except Exception as exc:
            errors.append(repr(exc))

    def b() -> None:
        a_in.wait(5)
        k.run(_Tensorish(), 4096, grid=(1,), warmup=False)
        b_done.set()

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return errors, len(foreign)


def test_real_autotuner_races_without_guard_and_not_with_it(real_triton: Any) -> None:
    errors, _ = _race_once(real_triton)
    assert errors and "NoneType" in errors[0]  # stock Triton: the reported TypeError
    guard.install(force=True)  # force: a test environment may hold another Triton than 3.6-3.9
    for _ in range(20):
        errors, foreign = _race_once(real_triton)
        assert errors == [] and foreign == 0


def test_per_thread_state_alone_fixes_the_race(real_triton: Any) -> None:
    """Without the guard's own launch path every call goes through Triton's run(), which
    writes nargs even when cached: only the per-thread descriptors keep A's nargs intact."""
    report = guard.install(force=True, fast_path=False)
    assert report["fast_path"] is False
    for _ in range(20):
        errors, foreign = _race_once(real_triton)
        assert errors == [] and foreign == 0


def test_single_flight_tuning(real_triton: Any) -> None:
    """Two threads call the same cold key at once: one benchmarks, the other waits and reuses."""
    benches: list[str] = []

    def do_bench(call: Any, quantiles: Any = None) -> list[float]:
        benches.append(threading.current_thread().name)
        call()
        threading.Event().wait(0.01)  # a GIL-free pause, as a GPU benchmark has
        return [1.0, 1.0, 1.0]

    cfgs = [real_triton.Config({"BLOCK": b}) for b in (64, 128, 256)]
    k = real_triton.Autotuner(_FakeJit(), _FakeJit.arg_names, cfgs, ["N"], None, None, do_bench=do_bench)
    guard.install(force=True)
    before = guard.stats()
    barrier = threading.Barrier(2)
    errors: list[str] = []

    def body() -> None:
        try:
            barrier.wait(5)
            k.run(_Tensorish(), 4096, grid=(1,), warmup=False)
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=body, name=f"T{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    after = guard.stats()
    assert errors == []
    assert len(benches) == len(cfgs) and len(set(benches)) == 1  # tuned once, by one thread
    assert after["cold_calls"] - before["cold_calls"] == 2
    assert after["reused_after_wait"] - before["reused_after_wait"] == 1


def test_tuning_key_matches_triton_and_cached_calls_skip_the_lock(real_triton: Any) -> None:
    Config = real_triton.Config
    seen_pre: list[dict[str, Any]] = []
    cfgs = [Config({"BLOCK": b}, pre_hook=seen_pre.append) for b in (64, 128)]
    k = real_triton.Autotuner(_FakeJit(), _FakeJit.arg_names, cfgs, ["N"], None, None,
                              do_bench=lambda call, quantiles=None: (call(), [1.0] * 3)[1])
    x = _Tensorish()
    k.run(x, 4096, grid=(1,), warmup=False)  # Triton computes and stores the key itself
    assert list(k.cache) == [guard.tuning_key(k, (x, 4096), {"grid": (1,), "warmup": False})]
    report = guard.install(force=True)
    before = guard.stats()["cold_calls"]
    seen_pre.clear()
    assert k.run(x, 4096, grid=(1,), warmup=False) in (64, 128)
    assert guard.stats()["cold_calls"] == before  # cached: no lock taken
    if report["fast_path"]:
        assert seen_pre and seen_pre[-1]["x"] is x and seen_pre[-1]["N"] == 4096  # config.pre_hook got full args
    k.run(x, 8192, grid=(1,), warmup=False)
    assert guard.stats()["cold_calls"] == before + 1


def test_subclass_calling_super_is_covered(real_triton: Any) -> None:
    """Like FLA's CachedAutotuner: built by its own decorator, its run() calls super().run()."""
    class Cached(real_triton.Autotuner):
        def run(self, *args: Any, **kwargs: Any) -> Any:
            return super().run(*args, **kwargs)

    k = Cached(_FakeJit(), _FakeJit.arg_names, [real_triton.Config({"BLOCK": b}) for b in (64, 128)],
               ["N"], None, ["x"], do_bench=lambda call, quantiles=None: (call(), [1.0] * 3)[1])
    report = guard.install(force=True)
    assert any(s.endswith("Cached") for s in report["subclasses_overriding_run"])
    before = guard.stats()["cold_calls"]

    class Restorable(_Tensorish):
        def clone(self) -> Any:
            return ("copy-of", threading.get_ident())

        def copy_(self, other: Any) -> None:
            assert other == ("copy-of", threading.get_ident())  # never another thread's copy

    k.run(Restorable(), 4096, grid=(1,), warmup=False)
    assert guard.stats()["cold_calls"] == before + 1
    assert isinstance(type(k).__mro__[1].__dict__["restore_copies"], property)


# -- sitecustomize ------------------------------------------------------------------------

def _fake_triton_pkg(root: Path, version: str = "3.6.0") -> None:
    pkg = root / "triton"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\nfrom .runtime import autotuner\n")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "autotuner.py").write_text(textwrap.dedent("""
        class Autotuner:
            def run(self, *a, **k): return None
            def _bench(self): pass
            def prune_configs(self): pass
            def warmup(self): pass
            def check_disk_cache(self): pass
    """))


def _python(code: str, tmp_path: Path, extra_path: list[Path], **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DFO_AUTOTUNE_GUARD")}
    e["PYTHONPATH"] = os.pathsep.join(str(p) for p in [SITE_DIR, *extra_path])
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=60)


def test_sitecustomize_chains_and_installs_lazily(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    fake = tmp_path / "fake"
    _fake_triton_pkg(fake)
    log = tmp_path / "guard.jsonl"
    code = textwrap.dedent("""
        import os, sys, json
        out = {"chained": os.environ.get("OTHER_SITECUSTOMIZE_RAN"),
               "armed": any(type(f).__name__ == "_Finder" for f in sys.meta_path),
               "triton_before": "triton" in sys.modules}
        import triton
        from triton.runtime.autotuner import Autotuner
        out["marker"] = "_dfo_autotune_guard" in Autotuner.__dict__
        out["nargs_is_property"] = isinstance(Autotuner.__dict__.get("nargs"), property)
        out["finder_left"] = any(type(f).__name__ == "_Finder" for f in sys.meta_path)
        out["loader"] = type(triton.__spec__.loader).__name__
        print(json.dumps(out))
    """)
    # FORCE: this fake autotuner.py is not the file the guard verified (a real one is, on the GPU run)
    r = _python(code, tmp_path, [other, fake], DFO_AUTOTUNE_GUARD_LOG=str(log), DFO_AUTOTUNE_GUARD_FORCE="1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"chained": "1", "armed": True, "triton_before": False, "marker": True,
                   "nargs_is_property": True, "finder_left": False, "loader": "SourceFileLoader"}
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["installed"] is True and lines[0]["triton"] == "3.6.0"
    assert lines[0]["forced"] is True and lines[0]["verified"] is False
    assert isinstance(lines[0]["pid"], int)


def test_sitecustomize_costs_nothing_without_triton(tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    r = _python("import json, sys; print('_dfo_autotune_guard' in sys.modules)", tmp_path, [],
                DFO_AUTOTUNE_GUARD_LOG=str(log))
    assert r.returncode == 0 and r.stdout.strip() == "False" and not log.exists()


def test_sitecustomize_off_switch(tmp_path: Path) -> None:
    r = _python("import sys; print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))", tmp_path, [],
                DFO_AUTOTUNE_GUARD="0")
    assert r.returncode == 0 and r.stdout.strip() == "False"


def test_sitecustomize_refusal_is_logged_not_fatal_unless_strict(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    _fake_triton_pkg(fake, version="3.5.0")
    log = tmp_path / "guard.jsonl"
    code = "import triton; print('still running')"
    r = _python(code, tmp_path, [fake], DFO_AUTOTUNE_GUARD_LOG=str(log))
    assert r.returncode == 0 and "still running" in r.stdout
    assert "NOT installed" in r.stderr and "3.5.0" in r.stderr
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["installed"] is False and "3.5.0" in rec["error"]
    strict = _python(code, tmp_path, [fake], DFO_AUTOTUNE_GUARD_STRICT="1")
    assert strict.returncode != 0 and "GuardRefused" in strict.stderr


# -- warmup diff and preflight without torch -----------------------------------------------

def test_warmup_diff_names_new_keys() -> None:
    k1 = types.SimpleNamespace(base_fn=types.SimpleNamespace(__name__="kern_a"))
    k2 = types.SimpleNamespace(base_fn=types.SimpleNamespace(__name__="kern_b"))
    before = {1: (k1, {(4096, "torch.float32")})}
    after = {1: (k1, {(4096, "torch.float32"), (8192, "torch.float32")}), 2: (k2, {(1,)})}
    assert tuned_between(before, after) == {"kern_a": ["(8192, 'torch.float32')"], "kern_b": ["(1,)"]}
    assert tuned_between(after, after) == {}


def test_preflight_without_torch_reports_a_problem(tmp_path: Path) -> None:
    blocker = tmp_path / "block" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('simulated: no torch here')\n")
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "block"), str(ROOT)])
    r = subprocess.run([sys.executable, "-m", "remote.gpu.preflight"], input="{}", cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("@@DFO-RESULT@@ ")][-1]
    result = json.loads(line.split(" ", 1)[1])
    assert result["ok"] is True
    data = result["data"]
    assert data["gpus"] == [] and data["triton_cache"]["path"]
    assert [p["kind"] for p in data["problems"]][0] == "torch_missing"
    assert "simulated" in data["problems"][0]["message"]


def test_gdn_reference_matches_a_hand_computation() -> None:
    torch = pytest.importorskip("torch")
    from remote.gpu.preflight import gdn_reference

    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 3, 2, 2, 3
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g, beta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    got = gdn_reference(q, k, v, g, beta, scale=0.5)
    for h in range(H):
        S = [[0.0] * V for _ in range(K)]
        for t in range(T):
            decay = float(g[0, t, h].exp())
            S = [[S[i][j] * decay for j in range(V)] for i in range(K)]
            kt = [float(k[0, t, h, i]) for i in range(K)]
            pred = [sum(kt[i] * S[i][j] for i in range(K)) for j in range(V)]
            delta = [(float(v[0, t, h, j]) - pred[j]) * float(beta[0, t, h]) for j in range(V)]
            S = [[S[i][j] + kt[i] * delta[j] for j in range(V)] for i in range(K)]
            want = [0.5 * sum(float(q[0, t, h, i]) * S[i][j] for i in range(K)) for j in range(V)]
            assert got[0, t, h].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
