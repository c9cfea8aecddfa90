"""GPU preflight for ``dfo verify-env --gpu``: ``python3 -m remote.gpu.preflight``.

Run it with the interpreter the trainer will use (the job's venv python). For each GPU, one
after another: torch sees it and runs a small op on it; its compute capability is in the
torch build's arch list; a small Triton kernel compiles, runs and gives the right answer;
when FLA (module ``fla``) is importable, ``chunk_gated_delta_rule`` (Gated DeltaNet) runs
forward and backward and matches a plain PyTorch reference. Known-bad combinations
(``remote/env/known_bad.json``) that match are reported as problems.

Request (stdin JSON, every key optional)::

    {"gpus": [0, 1], "fla": true, "fwd_tol": 0.02, "bwd_tol": 0.05}

Result data::

    {"gpus": [{"index", "name", "capability": "9.0", "arch": "sm_90", "arch_in_build",
               "triton_ok", "fla_ok": bool|null, "seconds",
               "checks": [{"name", "ok", "message", "seconds"}]}],
     "torch", "triton", "fla", "cuda", "arch_list", "triton_cache": {"path", "bytes"},
     "problems": [{"kind", "package", "expected", "found", "message"}]}

Top level: python3 3.8+ stdlib only; torch, triton and fla are imported inside functions,
and a node without torch gets a "torch not importable" problem, not a crash.
"""
from __future__ import annotations

import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from remote._proto import emit_event, main
from remote.env.known_bad import arch_name, arch_support, match_entries
from remote.lib.triton_cache import cache_dir, dir_size

FWD_TOL = 0.02  # relative RMS error, bf16 inputs against an fp32 reference
BWD_TOL = 0.05


def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # python < 3.8
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None
    except Exception:
        return None


def triton_cache_info() -> Dict[str, Any]:
    """Where Triton keeps compiled kernels, and their size."""
    path = cache_dir()
    return {"path": path, "bytes": dir_size(path)[0]}


def _problem(kind: str, message: str, package: Optional[str] = None, expected: Optional[str] = None,
             found: Optional[str] = None) -> Dict[str, Any]:
    return {"kind": kind, "package": package, "expected": expected, "found": found, "message": message}


def _run_check(name: str, fn: Callable[[], Tuple[bool, str]]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    try:
        ok, message = fn()
    except Exception as exc:  # the check failed; the next one still runs
        ok, message = False, "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0][:500]
                                         if str(exc).strip() else "")
    return {"name": name, "ok": bool(ok), "message": message, "seconds": round(time.perf_counter() - t0, 3)}


def _rel_rms(a: Any, b: Any) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def gdn_reference(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float) -> Any:
    """Gated delta rule, one step at a time, in float32 (differentiable).

    Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g (log decay), beta [B, T, H]. Per head,
    with state S [K, V]: S = exp(g_t) S; S = S + beta_t k_t (v_t - S^T k_t)^T; o_t = scale S^T q_t.
    """
    import torch

    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        delta = (v[:, t] - pred) * beta[:, t][..., None]
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, dim=1)


def _gdn_inputs(device: Any, B: int = 1, T: int = 128, H: int = 8, K: int = 128, V: int = 128) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen)

    cpu = {
        "q": rnd(B, T, H, K),
        "k": F.normalize(rnd(B, T, H, K), p=2, dim=-1),
        "v": rnd(B, T, H, V),
        "g": F.logsigmoid(torch.rand(B, T, H, generator=gen) + 2.0),
        "beta": torch.rand(B, T, H, generator=gen).sigmoid(),
        "do": rnd(B, T, H, V),
    }
    return {n: t.to(device=device, dtype=torch.bfloat16) for n, t in cpu.items()}


def check_fla_gdn(index: int, backward: bool, fwd_tol: float, bwd_tol: float) -> List[Dict[str, Any]]:
    """Forward (and backward) of FLA's chunk_gated_delta_rule on GPU ``index``."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    device = torch.device("cuda", index)
    checks = []
    state: Dict[str, Any] = {}

    def forward() -> Tuple[bool, str]:
        x = _gdn_inputs(device)
        leaves = {n: x[n].clone().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")}
        scale = x["q"].shape[-1] ** -0.5
        with torch.cuda.device(device):
            o, _ = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                          scale=scale)
            torch.cuda.synchronize(device)
        ref_leaves = {n: x[n].float().requires_grad_(backward) for n in leaves}
        ref = gdn_reference(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"],
                            ref_leaves["beta"], scale)
        state.update(o=o, ref=ref, leaves=leaves, ref_leaves=ref_leaves, do=x["do"])
        err = _rel_rms(o, ref)
        shape = "x".join(str(s) for s in x["q"].shape)
        return err <= fwd_tol, "relative RMS error %.2e (tolerance %.0e), q %s bf16" % (err, fwd_tol, shape)

    checks.append(_run_check("fla_gdn_forward", forward))
    if not backward or "o" not in state:
        return checks

    def backward_check() -> Tuple[bool, str]:
        with torch.cuda.device(device):
            (state["o"].float() * state["do"].float()).sum().backward()
            torch.cuda.synchronize(device)
        (state["ref"] * state["do"].float()).sum().backward()
        errs = {n: _rel_rms(state["leaves"][n].grad, state["ref_leaves"][n].grad) for n in state["leaves"]}
        worst = max(errs, key=lambda n: errs[n])
        text = ", ".join("d%s %.2e" % (n, e) for n, e in errs.items())
        return errs[worst] <= bwd_tol, "relative RMS errors %s (tolerance %.0e)" % (text, bwd_tol)

    checks.append(_run_check("fla_gdn_backward", backward_check))
    return checks


def _triton_check(index: int) -> Tuple[bool, str]:
    import torch

    from remote.gpu._kernels import scaled_add

    n = 100_003
    x, y = torch.randn(n), torch.randn(n)
    with torch.cuda.device(index):
        out = scaled_add(x.to(f"cuda:{index}"), y.to(f"cuda:{index}"), 2.5)
        torch.cuda.synchronize(index)
    err = float((out.cpu() - (x * 2.5 + y)).abs().max())
    return err <= 1e-5, "scaled_add over %d floats, max abs error %.1e" % (n, err)


def _torch_check(index: int) -> Tuple[bool, str]:
    import torch

    a = torch.arange(1 << 20, dtype=torch.float32)
    got = float((a.to(f"cuda:{index}") * 2).sum().item())
    want = float((a * 2).sum().item())
    return got == want, "a small op ran on cuda:%d (sum %s)" % (index, "matches" if got == want else "differs")


def check_gpu(index: int, arch_list: List[str], fla: bool, fwd_tol: float, bwd_tol: float) -> Dict[str, Any]:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    capability = "%d.%d" % (major, minor)
    in_build, how = arch_support(capability, arch_list)
    gpu: Dict[str, Any] = {
        "index": index,
        "name": torch.cuda.get_device_name(index),
        "capability": capability,
        "arch": arch_name(capability),
        "arch_in_build": in_build,
        "triton_ok": False,
        "fla_ok": None,
        "seconds": 0.0,
        "checks": [],
    }
    checks = gpu["checks"]
    checks.append({"name": "arch_in_build", "ok": in_build, "seconds": 0.0,
                   "message": how if in_build else "WARNING: %s; torch has no kernels for this GPU" % how})
    for name, fn in (("torch_op", lambda: _torch_check(index)), ("triton_kernel", lambda: _triton_check(index))):
        checks.append(_run_check(name, fn))
        emit_event("check", gpu=index, name=name, ok=checks[-1]["ok"], seconds=checks[-1]["seconds"])
    gpu["triton_ok"] = checks[-1]["ok"]
    if fla:
        fla_checks = check_fla_gdn(index, True, fwd_tol, bwd_tol)
        checks.extend(fla_checks)
        for c in fla_checks:
            emit_event("check", gpu=index, name=c["name"], ok=c["ok"], seconds=c["seconds"])
        gpu["fla_ok"] = all(c["ok"] for c in fla_checks) and len(fla_checks) == 2
    gpu["seconds"] = round(sum(c["seconds"] for c in checks), 3)
    return gpu


def _smi_capabilities() -> List[str]:
    """Compute capabilities from nvidia-smi (used only when torch cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30, check=True)
    except Exception:
        return []
    return [line.strip() for line in out.stdout.decode().splitlines() if line.strip()[:1].isdigit()]


def run_preflight(request: Dict[str, Any]) -> Dict[str, Any]:
    packages = {name: _dist_version(name) for name in
                ("torch", "triton", "fla-core", "flash-linear-attention", "tilelang")}
    data: Dict[str, Any] = {
        "gpus": [], "torch": packages["torch"], "triton": packages["triton"],
        "fla": packages["fla-core"] or packages["flash-linear-attention"], "cuda": None,
        "arch_list": [], "triton_cache": {}, "problems": [],
    }
    try:
        return _run_preflight(request, packages, data)
    finally:
        data["triton_cache"] = triton_cache_info()  # at the end: what the checks compiled is in it


def _run_preflight(request: Dict[str, Any], packages: Dict[str, Optional[str]],
                   data: Dict[str, Any]) -> Dict[str, Any]:
    problems: List[Dict[str, Any]] = data["problems"]
    try:
        import torch
    except Exception as exc:
        problems.append(_problem("torch_missing", "torch not importable: %s: %s" % (type(exc).__name__, exc),
                                 package="torch"))
        _add_known_bad(problems, packages, _smi_capabilities(), None)
        return data
    data["torch"] = torch.__version__
    data["cuda"] = torch.version.cuda
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        problems.append(_problem("no_gpu", "torch %s sees no CUDA GPU (torch.cuda.is_available() is False)"
                                 % torch.__version__, package="torch", found=torch.__version__))
        _add_known_bad(problems, packages, _smi_capabilities(), None)
        return data
    data["arch_list"] = list(torch.cuda.get_arch_list())
    fla = bool(request.get("fla", True))
    if fla:
        try:
            import fla as _fla  # noqa: F401  (import errors are a problem, not a crash)
        except ImportError as exc:
            fla = False
            if packages["fla-core"] or packages["flash-linear-attention"]:
                problems.append(_problem("import_failed", "fla is installed but does not import: %s" % exc,
                                         package="fla-core", found=data["fla"]))
    indices = request.get("gpus") or list(range(torch.cuda.device_count()))
    fwd_tol = float(request.get("fwd_tol", FWD_TOL))
    bwd_tol = float(request.get("bwd_tol", BWD_TOL))
    refused_640 = None
    for index in indices:
        gpu = check_gpu(int(index), data["arch_list"], fla, fwd_tol, bwd_tol)
        data["gpus"].append(gpu)
        for c in gpu["checks"]:
            if c["ok"] or c["name"] == "arch_in_build":
                continue
            if c["name"] == "fla_gdn_backward" and "#640" in c["message"]:
                refused_640 = c["message"]
                continue
            package = {"torch_op": "torch", "triton_kernel": "triton"}.get(c["name"], "fla-core")
            problems.append(_problem("gpu_check", "GPU %d (%s): %s failed: %s" % (
                gpu["index"], gpu["name"], c["name"], c["message"]), package=package,
                found=packages.get(package)))
    matched = _add_known_bad(problems, packages, [g["capability"] for g in data["gpus"]], data["arch_list"])
    if refused_640 is not None and not any(e["id"].startswith("fla-640") for e in matched):
        problems.append(_problem("known_bad", "FLA refused the Gated DeltaNet backward (FLA #640), which no "
                                 "known-bad entry predicted for these versions: %s" % refused_640,
                                 package="triton", expected=">=3.7.1", found=packages["triton"]))
    return data


def _add_known_bad(problems: List[Dict[str, Any]], packages: Dict[str, Optional[str]],
                   capabilities: List[str], arch_list: Optional[List[str]]) -> List[Dict[str, Any]]:
    pairs = match_entries(packages, capabilities, arch_list)
    problems.extend(p for _e, p in pairs)
    return [e for e, _p in pairs]


def handler(request: Dict[str, Any]) -> Dict[str, Any]:
    return run_preflight(request or {})


if __name__ == "__main__":
    main(handler)
