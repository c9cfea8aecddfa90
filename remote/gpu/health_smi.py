"""What the driver says, read for the health gate (python3 3.8+, stdlib only): ``nvidia-smi -q -x`` per
GPU, ``nvidia-smi topo -m``, ``nvidia-smi nvlink -s`` and the kernel log's XIDs.

Every parser takes text and returns plain dicts, so tests feed them captures made on GPU machines
(tests/data/health/). A value nvidia-smi cannot give (``N/A``, ``[Not Supported]``) is None.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional, Tuple

SMI_TIMEOUT = 20.0
_MISSING = ("n/a", "[n/a]", "not supported", "[not supported]", "unknown error", "[unknown error]", "not found",
            "[insufficient permissions]", "insufficient permissions", "")
# clock event ("throttle") reasons that mean the hardware or its cooling is holding the GPU back; a
# SW power cap is the GPU at its power limit (normal under a full matmul load), judged with the limit itself
BAD_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")


class SmiError(Exception):
    """nvidia-smi is missing, timed out or failed: the message says which."""


def find_tool(name: str, path: Optional[str]) -> Optional[str]:
    """``name`` on ``path`` (the trainer's PATH), else on this process's PATH, else in the driver's usual folders."""
    for p in (path, None, "/usr/bin:/usr/local/nvidia/bin:/usr/local/bin:/bin:/usr/sbin:/sbin"):
        found = shutil.which(name, path=p) if p is not None else shutil.which(name)
        if found:
            return found
    return None


def run_tool(exe: str, args: List[str], timeout: float = SMI_TIMEOUT) -> str:
    try:
        res = subprocess.run([exe] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SmiError("%s %s did not answer within %.0f s" % (os.path.basename(exe), " ".join(args),
                                                                timeout)) from None
    except OSError as exc:
        raise SmiError("%s: %s" % (exe, exc)) from None
    out = res.stdout.decode("utf-8", "replace")
    if res.returncode != 0:
        err = (res.stderr.decode("utf-8", "replace").strip() or out.strip()).splitlines()
        raise SmiError("%s %s exited %d: %s" % (os.path.basename(exe), " ".join(args), res.returncode,
                                               (err[-1] if err else "")[:300]))
    return out


# --------------------------------------------------------------------------- nvidia-smi -q -x


def _text(el: Optional[ET.Element], path: str) -> Optional[str]:
    if el is None:
        return None
    node = el.find(path)
    if node is None or node.text is None:
        return None
    t = node.text.strip()
    return None if t.lower() in _MISSING else t


def _num(text: Optional[str]) -> Optional[float]:
    """The number that starts ``text`` ("700.00 W", "16x", "143771 MiB", "5"); None when there is none."""
    if text is None:
        return None
    m = re.match(r"\s*(-?[0-9]+(?:\.[0-9]+)?)", text)
    return float(m.group(1)) if m else None


def _first(el: ET.Element, paths: Tuple[str, ...]) -> Optional[float]:
    for p in paths:
        v = _num(_text(el, p))
        if v is not None:
            return v
    return None


def _yes(text: Optional[str]) -> Optional[bool]:
    if text is None:
        return None
    return text.strip().lower() in ("yes", "true", "active", "enabled")


def norm_bus(bus: str) -> str:
    """A PCI address as ``dddd:bb:dd`` (domain, bus, device; lower case), whatever its writer:
    nvidia-smi's ``00000000:3B:00.0``, the kernel log's ``0000:3b:00``, torch's numbers."""
    parts = bus.strip().lower().split(":")
    if len(parts) == 2:
        parts = ["0"] + parts
    if len(parts) < 3:
        return bus.strip().lower()
    dom, b, dev = parts[-3], parts[-2], parts[-1].split(".")[0]
    try:
        return "%04x:%02x:%02x" % (int(dom, 16), int(b, 16), int(dev, 16))
    except ValueError:
        return bus.strip().lower()


def _error_counts(node: Optional[ET.Element]) -> Optional[int]:
    """The uncorrectable ECC errors under one of ecc_errors' volatile/aggregate blocks: every
    ``*uncorrectable*`` counter (Hopper and later), or ``double_bit/total`` (older GPUs)."""
    if node is None:
        return None
    total, seen = 0, False
    for child in node.iter():
        tag = child.tag.lower()
        if "uncorrectable" in tag and "threshold" not in tag and "sources" not in tag:
            v = _num(child.text.strip() if child.text else None)
            if v is not None:
                total += int(v)
                seen = True
    v = _num(_text(node, "double_bit/total"))
    if v is not None:
        total += int(v)
        seen = True
    return total if seen else None


def _reasons(gpu: ET.Element) -> Optional[List[str]]:
    """The active clock event reasons (``sw_power_cap``, ``hw_slowdown``...); None when the driver gives none."""
    block = gpu.find("clocks_event_reasons")
    if block is None:
        block = gpu.find("clocks_throttle_reasons")
    if block is None:
        return None
    out = []
    for child in block:
        name = re.sub(r"^clocks?_(?:event|throttle)_reasons?_", "", child.tag)
        if (child.text or "").strip().lower() == "active":
            out.append(name)
    return out


def _processes(gpu: ET.Element) -> List[Dict[str, Any]]:
    out = []
    for p in gpu.findall("processes/process_info"):
        pid = _num(_text(p, "pid"))
        out.append({"pid": int(pid) if pid is not None else None, "type": _text(p, "type"),
                    "name": _text(p, "process_name"), "used_mib": _num(_text(p, "used_memory"))})
    return out


def parse_smi_xml(text: str) -> Dict[str, Any]:
    """``nvidia-smi -q -x`` -> {"driver", "cuda", "gpus": [{index, name, uuid, bus, memory..., pcie, power,
    reasons, ecc, pages, reset, processes, ...}]} (the GPUs in nvidia-smi's index order)."""
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as exc:
        raise SmiError("nvidia-smi -q -x gave no readable XML (%s)" % exc) from None
    gpus = []
    for i, g in enumerate(root.findall("gpu")):
        bus = g.get("id") or _text(g, "pci/pci_bus_id") or ""
        link = g.find("pci/pci_gpu_link_info")
        ecc = g.find("ecc_errors")
        retired = g.find("retired_pages")
        rows = g.find("remapped_rows")
        power = g.find("gpu_power_readings")
        if power is None:
            power = g.find("power_readings")
        gpus.append({
            "index": i,
            "name": _text(g, "product_name"),
            "uuid": _text(g, "uuid"),
            "bus": norm_bus(bus) if bus else None,
            "bus_id": bus or None,
            "architecture": _text(g, "product_architecture"),
            "mig": _text(g, "mig_mode/current_mig"),
            "memory_total_mib": _num(_text(g, "fb_memory_usage/total")),
            "memory_used_mib": _num(_text(g, "fb_memory_usage/used")),
            "memory_reserved_mib": _num(_text(g, "fb_memory_usage/reserved")),
            "util_gpu": _num(_text(g, "utilization/gpu_util")),
            "pstate": _text(g, "performance_state"),
            "temp_c": _num(_text(g, "temperature/gpu_temp")),
            "sm_clock": _num(_text(g, "clocks/sm_clock")),
            "sm_clock_max": _num(_text(g, "max_clocks/sm_clock")),
            "pcie": {
                "gen": _first(link, ("pcie_gen/current_link_gen",)) if link is not None else None,
                "gen_max": _first(link, ("pcie_gen/max_link_gen",)) if link is not None else None,
                "gen_device_max": _first(link, ("pcie_gen/max_device_link_gen",)) if link is not None else None,
                "gen_host_max": _first(link, ("pcie_gen/max_host_link_gen",)) if link is not None else None,
                "width": _first(link, ("link_widths/current_link_width",)) if link is not None else None,
                "width_max": _first(link, ("link_widths/max_link_width",)) if link is not None else None,
            },
            "power": {
                "draw": _first(power, ("average_power_draw", "instant_power_draw", "power_draw"))
                if power is not None else None,
                "limit": _first(power, ("current_power_limit", "enforced_power_limit", "power_limit"))
                if power is not None else None,
                "default": _first(power, ("default_power_limit",)) if power is not None else None,
                "max": _first(power, ("max_power_limit",)) if power is not None else None,
            },
            "reasons": _reasons(g),
            "ecc": {
                "mode": _text(g, "ecc_mode/current_ecc"),
                "volatile_uncorrected": _error_counts(ecc.find("volatile") if ecc is not None else None),
                "aggregate_uncorrected": _error_counts(ecc.find("aggregate") if ecc is not None else None),
            },
            "pages": {
                "retired_sbe": _num(_text(retired, "multiple_single_bit_retirement/retired_count")),
                "retired_dbe": _num(_text(retired, "double_bit_retirement/retired_count")),
                "retire_pending": _yes(_text(retired, "pending_blacklist") or _text(retired, "pending_retirement")),
                "rows_corr": _num(_text(rows, "remapped_row_corr")),
                "rows_unc": _num(_text(rows, "remapped_row_unc")),
                "rows_pending": _yes(_text(rows, "remapped_row_pending")),
                "rows_failure": _yes(_text(rows, "remapped_row_failure")),
            },
            "reset": {
                "required": _yes(_text(g, "gpu_reset_status/reset_required")),
                "drain": _yes(_text(g, "gpu_reset_status/drain_and_reset_recommended")),
                "recovery_action": _text(g, "gpu_recovery_action"),
            },
            "processes": _processes(g),
        })
    return {"driver": _text(root, "driver_version"), "cuda": _text(root, "cuda_version"), "gpus": gpus}


# --------------------------------------------------------------------------- topology and NVLink


def parse_topo(text: str) -> Dict[str, Any]:
    """``nvidia-smi topo -m`` -> {"gpus": ["GPU0", ...], "links": {"0-1": "NV18", ...}} (GPU pairs only)."""
    header: Optional[List[str]] = None
    links: Dict[str, str] = {}
    names: List[str] = []
    for raw in text.splitlines():
        ln = re.sub(r"\x1b\[[0-9;]*m", "", raw).rstrip()
        cells = ln.split()
        if header is None:
            if re.match(r"^\s+GPU\d+", ln):  # the header row: indented, the columns' names
                header = [c for c in cells if re.match(r"^(GPU|NIC)\d+$", c)]
            continue
        if not cells:
            if names:
                break  # the legend follows
            continue
        if not re.match(r"^GPU\d+$", cells[0]):
            continue
        row = cells[0]
        names.append(row)
        for col, val in zip(header, cells[1:1 + len(header)]):
            if col.startswith("GPU") and col != row:
                a, b = sorted((int(row[3:]), int(col[3:])))
                links["%d-%d" % (a, b)] = val
    return {"gpus": names, "links": links}


def parse_nvlink_status(text: str) -> Dict[int, Dict[str, int]]:
    """``nvidia-smi nvlink -s`` -> {gpu index: {"active": n, "inactive": m}}."""
    out: Dict[int, Dict[str, int]] = {}
    cur: Optional[int] = None
    for ln in text.splitlines():
        m = re.match(r"^GPU (\d+):", ln.strip())
        if m:
            cur = int(m.group(1))
            out[cur] = {"active": 0, "inactive": 0}
            continue
        m = re.match(r"^Link \d+:\s*(.*)$", ln.strip())
        if m and cur is not None:
            out[cur]["inactive" if "inactive" in m.group(1).lower() else "active"] += 1
    return out


# --------------------------------------------------------------------------- the kernel log

_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),?\s*(.*)$")
_OFF_BUS = re.compile(r"NVRM: The NVIDIA GPU ([0-9a-fA-F:.]+)")
# XIDs that say the GPU itself (its memory, its links, its firmware) failed, after NVIDIA's Xid catalogue
# (docs.nvidia.com/deploy/xid-errors): the GPU wants a reset or a drain. Others (13, 31, 43, 45, 109...)
# are most often a program's fault: shown, not failed.
CRITICAL_XIDS = frozenset((48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140, 143, 145, 149, 150, 154,
                           155))


def parse_xids(text: str) -> List[Dict[str, Any]]:
    """Every XID line of a kernel log (dmesg, ``dmesg --ctime``, ``journalctl -k``): [{"bus", "xid", "line"}];
    the driver's "fallen off the bus" message without an XID (three lines) counts as XID 79."""
    out = []
    lines = text.splitlines()
    for k, ln in enumerate(lines):
        m = _XID.search(ln)
        if m:
            out.append({"bus": norm_bus(m.group(1)), "xid": int(m.group(2)), "line": ln.strip()[-300:]})
            continue
        m = _OFF_BUS.search(ln)
        if m and "fallen off the bus" in " ".join(lines[k:k + 4]):
            out.append({"bus": norm_bus(m.group(1)), "xid": 79, "line": ln.strip()[-300:]})
    return out


def read_kernel_log(path: Optional[str]) -> Tuple[Optional[str], str, Optional[str]]:
    """(text, where it came from, why it could not be read): dmesg, else journalctl -k, else /var/log/kern.log."""
    why = []
    for name, args in (("dmesg", []), ("journalctl", ["-k", "-q", "--no-pager", "-o", "short"])):
        exe = find_tool(name, path)
        if exe is None:
            why.append("no %s" % name)
            continue
        try:
            text = run_tool(exe, args, timeout=10.0)
        except SmiError as exc:
            why.append(str(exc))
            continue
        if text.strip() or name == "dmesg":
            return text, name, None
        why.append("%s -k printed nothing" % name)
    try:
        with open("/var/log/kern.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (8 << 20)))
            return f.read().decode("utf-8", "replace"), "/var/log/kern.log", None
    except OSError as exc:
        why.append("/var/log/kern.log: %s" % exc.strerror)
    return None, "", "; ".join(why)
