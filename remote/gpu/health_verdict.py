"""The health gate's verdicts (python3 3.8+, stdlib only): each figure beside what it should be.

A check is ``{"gpu": index|None, "check": name, "verdict": "pass"|"fail"|"warn"|"info"|"skip", "value",
"unit", "expected", "threshold", "source", "message"}``; ``fail`` stops a launch, ``warn`` is said and
passes, ``info`` is a figure with nothing to hold it to (a model not in the table), ``skip`` a check
that did not run (and why). Pure functions of what nvidia-smi, the kernel log and the measurements
gave, so tests feed them captures.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from remote.gpu.health_smi import BAD_REASONS, CRITICAL_XIDS
from remote.gpu.health_table import achievable, link_achievable, lookup, nccl_achievable
from remote.lib.fsutil import human_bytes

MIB = 1 << 20

Check = Dict[str, Any]
BUSY_UTIL_PCT = 10.0  # GPU utilisation before the gate's own load above this: someone is using it


def check(gpu: Optional[int], name: str, verdict: str, message: str, value: Optional[float] = None,
          unit: Optional[str] = None, expected: Optional[float] = None, threshold: Optional[float] = None,
          source: Optional[str] = None, bound: str = "min") -> Check:
    """``threshold``: the least (``bound`` "min") or the most ("max") a passing value may be."""
    return {"gpu": gpu, "check": name, "verdict": verdict, "value": value, "unit": unit, "expected": expected,
            "threshold": threshold, "bound": bound, "source": source, "message": message}


def label(g: Dict[str, Any]) -> str:
    return "GPU %s (%s)" % (g.get("index"), g.get("name") or "?")


def _fmt(v: float) -> str:
    if v == int(v) and abs(v) < 1e6:
        return "%d" % v
    return ("%.0f" % v) if abs(v) >= 100 else ("%.1f" % v) if abs(v) >= 10 else ("%.2f" % v)


def judge(g: Dict[str, Any], name: str, what: str, value: Optional[float], unit: str, expected: Optional[float],
          source: str, min_fraction: float) -> Check:
    """A measured figure against the achievable one: fail below ``min_fraction`` of it; info without one."""
    idx = g.get("index")
    if value is None:
        return check(idx, name, "skip", "%s: %s not measured" % (label(g), what), unit=unit, expected=expected,
                     source=source)
    if expected is None:
        return check(idx, name, "info", "%s: %s %s %s; not judged: %s" % (label(g), what, _fmt(value), unit, source),
                     value=value, unit=unit, source=source)
    floor = expected * min_fraction
    ok = value >= floor
    return check(idx, name, "pass" if ok else "fail",
                 "%s: %s %s %s, expected at least %s %s (%g x %s, %s)" % (
                     label(g), what, _fmt(value), unit, _fmt(floor), unit, min_fraction, _fmt(expected), source),
                 value=value, unit=unit, expected=expected, threshold=floor, source=source)


# --------------------------------------------------------------------------- before any load


def gpu_count(n_smi: int, n_torch: Optional[int], expect: Optional[int], visible: Optional[str]) -> List[Check]:
    out = []
    if expect is not None:
        ok = n_smi >= expect
        out.append(check(None, "gpu_count", "pass" if ok else "fail",
                         "nvidia-smi lists %d GPU(s); the inventory says %d" % (n_smi, expect),
                         value=n_smi, expected=expect, source="inventory: gpus"))
    if n_torch is not None:
        ok = n_torch >= n_smi
        why = "" if ok else (" (CUDA_VISIBLE_DEVICES=%r hides the others)" % visible if visible is not None else
                             " (no CUDA_VISIBLE_DEVICES: the driver or the container hides them)")
        out.append(check(None, "gpus_visible", "pass" if ok else "fail",
                         "torch sees %d of the %d GPU(s) nvidia-smi lists%s" % (n_torch, n_smi, why),
                         value=n_torch, expected=n_smi, source="nvidia-smi"))
    return out


def before_load(g: Dict[str, Any], max_memory_used: float) -> List[Check]:
    """Someone else on the GPU, errors, reset state, power limit: from nvidia-smi before the gate loads it."""
    idx, out = g["index"], []
    procs = g.get("processes") or []
    others = [p for p in procs if p.get("ours") is None]
    job = [p for p in procs if p.get("ours") == "job"]

    def who(p: Dict[str, Any]) -> str:
        return "pid %s (%s, user %s, %s)" % (p.get("pid"), p.get("name") or "?", p.get("user") or "?",
                                             human_bytes(p["used_mib"] * MIB) if p.get("used_mib") is not None
                                             else "memory unknown")
    if others:
        out.append(check(idx, "processes", "fail", "%s: %d compute process(es) that are not this job's: %s" % (
            label(g), len(others), "; ".join(who(p) for p in others[:5])), value=len(others), expected=0))
    else:
        out.append(check(idx, "processes", "pass", "%s: no other compute process%s" % (
            label(g), (" (this job's: %s)" % ", ".join(who(p) for p in job)) if job else ""), value=0, expected=0))
    total, used = g.get("memory_total_mib"), g.get("memory_used_mib")
    if total and used is not None:
        used_other = max(0.0, used - sum(p.get("used_mib") or 0 for p in job))
        limit = max_memory_used * total
        out.append(check(idx, "memory_in_use", "pass" if used_other <= limit else "fail",
                         "%s: %s of %s in use before the gate, at most %s allowed (%g of it)" % (
                             label(g), human_bytes(used_other * MIB), human_bytes(total * MIB),
                             human_bytes(limit * MIB), max_memory_used),
                         value=used_other * MIB, unit="bytes", expected=0, threshold=limit * MIB, bound="max"))
    util = g.get("util_gpu")
    if util is not None:
        busy = util > BUSY_UTIL_PCT and not job
        reads = g.get("util_readings")
        how = " (the lower of %s, 1 s apart)" % " and ".join("%s%%" % _fmt(r) for r in reads) if reads else ""
        out.append(check(idx, "busy_before", "fail" if busy else "pass",
                         "%s: %s%% busy before the gate's own load%s (over %g%%: someone is using it)" % (
                             label(g), _fmt(util), how, BUSY_UTIL_PCT), value=util, unit="%",
                         threshold=BUSY_UTIL_PCT, bound="max"))
    out.extend(errors(g))
    out.extend(power_limit(g))
    return out


def errors(g: Dict[str, Any]) -> List[Check]:
    idx, out = g["index"], []
    ecc = g.get("ecc") or {}
    vol, agg = ecc.get("volatile_uncorrected"), ecc.get("aggregate_uncorrected")
    if ecc.get("mode") and ecc["mode"].lower() == "disabled":
        out.append(check(idx, "ecc", "warn", "%s: ECC is off: memory errors go unseen" % label(g)))
    elif vol is None:
        out.append(check(idx, "ecc", "info", "%s: the driver gives no ECC counts" % label(g)))
    elif vol > 0:
        out.append(check(idx, "ecc", "fail", "%s: %d uncorrected ECC error(s) since the driver loaded" % (
            label(g), vol), value=vol, expected=0))
    else:
        out.append(check(idx, "ecc", "warn" if agg else "pass",
                         "%s: no uncorrected ECC error since the driver loaded%s" % (
                             label(g), (" (%d in the GPU's lifetime)" % agg) if agg else ""), value=0, expected=0))
    pg = g.get("pages") or {}
    bad = []
    if pg.get("retire_pending"):
        bad.append("a page retirement is pending (needs a reset)")
    if pg.get("rows_pending"):
        bad.append("a row remap is pending (needs a reset)")
    if pg.get("rows_failure"):
        bad.append("a row remap failed")
    if bad:
        out.append(check(idx, "memory_pages", "fail", "%s: %s" % (label(g), "; ".join(bad))))
    elif any(pg.get(k) for k in ("retired_dbe", "rows_unc")):
        out.append(check(idx, "memory_pages", "warn", "%s: %s uncorrectable row(s) remapped, %s page(s) retired "
                         "for double-bit errors (done: the GPU is usable)" % (
                             label(g), _fmt(pg.get("rows_unc") or 0), _fmt(pg.get("retired_dbe") or 0))))
    else:
        out.append(check(idx, "memory_pages", "pass", "%s: no pending page retirement or row remap" % label(g)))
    rs = g.get("reset") or {}
    action = rs.get("recovery_action")
    if rs.get("required") or rs.get("drain") or (action and action.lower() not in ("none", "n/a")):
        out.append(check(idx, "reset_state", "fail", "%s: the driver asks for a reset (reset required: %s, drain "
                         "and reset: %s, recovery action: %s)" % (label(g), rs.get("required"), rs.get("drain"),
                                                                   action)))
    else:
        out.append(check(idx, "reset_state", "pass", "%s: no reset or recovery pending" % label(g)))
    return out


def power_limit(g: Dict[str, Any]) -> List[Check]:
    p = g.get("power") or {}
    limit, default = p.get("limit"), p.get("default")
    if not limit or not default:
        return [check(g["index"], "power_limit", "info", "%s: the driver gives no power limits" % label(g))]
    ok = limit >= 0.95 * default
    return [check(g["index"], "power_limit", "pass" if ok else "fail",
                  "%s: power limit %s W, default %s W%s" % (label(g), _fmt(limit), _fmt(default),
                                                            "" if ok else ": lowered"),
                  value=limit, unit="W", expected=default, threshold=0.95 * default)]


def xids(gpus: List[Dict[str, Any]], found: Optional[List[Dict[str, Any]]], source: str,
         why: Optional[str]) -> List[Check]:
    """XIDs of the kernel log, per GPU (by PCI address): a critical one fails, another warns."""
    out = []
    for g in gpus:
        if found is None:
            out.append(check(g["index"], "xid", "skip", "%s: kernel log not readable (%s); the driver's reset "
                             "state stands in for it" % (label(g), why)))
            continue
        mine = [x for x in found if x["bus"] == g.get("bus")]
        crit = sorted({x["xid"] for x in mine if x["xid"] in CRITICAL_XIDS})
        other = sorted({x["xid"] for x in mine if x["xid"] not in CRITICAL_XIDS})
        if crit:
            last = [x for x in mine if x["xid"] in crit][-1]["line"]
            out.append(check(g["index"], "xid", "fail", "%s: XID %s in the kernel log (%s): %s" % (
                label(g), ", ".join(str(x) for x in crit), source, last), value=len(mine), expected=0))
        elif other:
            out.append(check(g["index"], "xid", "warn", "%s: XID %s in the kernel log (%s; most often a program's "
                             "fault, not the GPU's)" % (label(g), ", ".join(str(x) for x in other), source),
                             value=len(mine), expected=0))
        else:
            out.append(check(g["index"], "xid", "pass", "%s: no XID in the kernel log (%s)" % (label(g), source),
                             value=0, expected=0))
    return out


# --------------------------------------------------------------------------- under load


def under_load(g: Dict[str, Any], loaded: Optional[Dict[str, Any]]) -> List[Check]:
    """Clock event reasons and the PCIe link, read while the gate's matmuls ran."""
    idx = g["index"]
    if loaded is None:
        return [check(idx, "throttle", "skip", "%s: no nvidia-smi reading under load" % label(g)),
                check(idx, "pcie_link", "skip", "%s: no nvidia-smi reading under load" % label(g))]
    out = []
    reasons = loaded.get("reasons")
    if reasons is None:
        out.append(check(idx, "throttle", "info", "%s: the driver gives no clock event reasons" % label(g)))
    else:
        bad = [r for r in reasons if r in BAD_REASONS]
        note = " (also: %s)" % ", ".join(r for r in reasons if r not in BAD_REASONS) if len(reasons) > len(bad) else ""
        out.append(check(idx, "throttle", "fail" if bad else "pass", "%s: under load, %s%s; SM clock %s of %s MHz" % (
            label(g), ("held back by " + ", ".join(bad)) if bad else "no hardware or thermal slowdown", note,
            _fmt(loaded["sm_clock"]) if loaded.get("sm_clock") else "?",
            _fmt(loaded["sm_clock_max"]) if loaded.get("sm_clock_max") else "?")))
    pc = loaded.get("pcie") or {}
    model = lookup(g.get("name"))
    ds = (model or {}).get("datasheet") or {}
    want_gen = ds.get("pcie_gen") or pc.get("gen_device_max") or pc.get("gen_max")
    want_width = ds.get("pcie_width") or pc.get("width_max")
    gen, width = pc.get("gen"), pc.get("width")
    if gen is None or width is None:
        out.append(check(idx, "pcie_link", "info", "%s: the driver gives no PCIe link state" % label(g)))
    else:
        short = []
        if want_gen and gen < want_gen:
            short.append("Gen%d where Gen%d is expected" % (gen, want_gen))
        if want_width and width < want_width:
            short.append("x%d where x%d is expected" % (width, want_width))
        src = "the datasheet" if ds.get("pcie_gen") else "nvidia-smi's maximum"
        host = pc.get("gen_host_max")
        hint = " (the slot tops out at Gen%d)" % host if host and want_gen and host < want_gen else ""
        out.append(check(idx, "pcie_link", "fail" if short else "pass", "%s: PCIe Gen%d x%d under load%s%s" % (
            label(g), gen, width, (": " + ", ".join(short) + " (" + src + ")") if short else "", hint),
            value=gen, expected=want_gen, source=src))
    return out


def measured(g: Dict[str, Any], m: Dict[str, Any], min_fraction: float, smi_pcie: Dict[str, Any]) -> List[Check]:
    """bf16 matmul, HBM copy and host<->device bandwidth against the achievable figures of the model."""
    model = lookup(g.get("name"))
    out = []
    if model is None:
        out.append(check(g["index"], "model", "info", "%s: not in dfo's table of GPU models: its figures are shown, "
                         "not judged (the checks that need no expected figure still hold)" % label(g)))
    for fig, what, unit in (("matmul_bf16_tflops", "bf16 matmul", "TFLOPS"), ("hbm_copy_tbps", "memory copy", "TB/s")):
        exp, src = achievable(model, fig)
        out.append(judge(g, fig, what, m.get(fig), unit, exp, src, min_fraction))
    for fig, what in (("h2d_gbps", "host-to-device (pinned)"), ("d2h_gbps", "device-to-host (pinned)")):
        exp, src = link_achievable(model, fig, smi_pcie.get("gen_device_max") or smi_pcie.get("gen_max"),
                                   smi_pcie.get("width_max"))
        out.append(judge(g, fig, what, m.get(fig), "GB/s", exp, src, min_fraction))
    if m.get("error"):
        out.append(check(g["index"], "measure", "fail", "%s: the measurement failed: %s" % (label(g), m["error"])))
    return out


# --------------------------------------------------------------------------- between GPUs


def between(gpus: List[Dict[str, Any]], topo: Optional[Dict[str, Any]], nvlink: Optional[Dict[int, Dict[str, int]]],
            p2p: Optional[List[List[bool]]], nccl: Optional[Dict[str, Any]], min_fraction: float) -> List[Check]:
    """P2P matrix, topology (NVLink or PCIe), NVLink links up, NCCL all-reduce bus bandwidth."""
    if len(gpus) < 2:
        return [check(None, "between_gpus", "skip", "one GPU: no P2P, NVLink or all-reduce to measure")]
    out = []
    model = lookup(gpus[0].get("name"))
    has_nvlink = bool(model and model["datasheet"].get("nvlink_gbps") and "pcie" not in model["key"])
    links = (topo or {}).get("links") or {}
    not_nv = sorted(k for k, v in links.items() if not v.upper().startswith("NV"))
    all_nv = bool(links) and not not_nv
    if not links:
        out.append(check(None, "topology", "skip", "nvidia-smi topo -m gave no GPU pairs"))
    else:
        kinds = ", ".join(sorted(set(links.values())))
        bad = has_nvlink and bool(not_nv)
        pairs = ", ".join("GPU " + k.replace("-", "-GPU ") for k in not_nv)
        why = (": %s has NVLink, but %s go over PCIe (NVLink down?)" % (model["name"], pairs)) if bad and model else ""
        out.append(check(None, "topology", "fail" if bad else "pass" if all_nv or not has_nvlink else "info",
                         "GPU pairs joined by %s%s" % (kinds, why), source="nvidia-smi topo -m"))
    if nvlink and has_nvlink:
        down = {i: c["inactive"] for i, c in nvlink.items() if c["inactive"]}
        out.append(check(None, "nvlink", "fail" if down else "pass", "NVLink: %s" % (
            ", ".join("GPU %d has %d inactive link(s)" % (i, n) for i, n in sorted(down.items())) if down else
            "every link of every GPU active"), source="nvidia-smi nvlink -s"))
    if p2p is not None:
        no = ["%d-%d" % (i, j) for i, row in enumerate(p2p) for j, ok in enumerate(row) if i < j and not ok]
        out.append(check(None, "p2p", "fail" if no and has_nvlink else "warn" if no else "pass",
                         "peer access: %s" % (("none between GPU " + ", ".join(no)) if no else "every pair")))
    if nccl is None or nccl.get("busbw_gbps") is None:
        out.append(check(None, "nccl_allreduce", "skip" if nccl is None else "fail",
                         "NCCL all-reduce: %s" % ("not run" if nccl is None else nccl.get("error") or "no figure")))
    else:
        exp, src = nccl_achievable(model, all_nv)
        fake = {"index": "all", "name": "%d x %s" % (len(gpus), gpus[0].get("name"))}
        c = judge(fake, "nccl_allreduce", "NCCL all-reduce bus bandwidth (%s, %d ranks)" % (
            human_bytes(nccl.get("bytes", 0)), nccl.get("ranks", 0)), nccl["busbw_gbps"], "GB/s", exp, src,
            min_fraction)
        c["gpu"] = None
        out.append(c)
    return out
