"""The GPU models the health gate knows (remote/gpu/gpu_models.json) and what each figure should be
(python3 3.8+, stdlib only).

``achievable(model, figure)`` is the figure a healthy GPU of that model gives: the gate's own measurement
of one (``measured``, with the file and the command) where the table has it, else the vendor's datasheet
figure times the ratio the measured models showed (``ratios``). A model not in the table, or a figure
the table has no source for, gives None: the figure is shown, not judged.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Optional, Tuple

_TABLE: Optional[Dict[str, Any]] = None
# PCIe: GT/s per lane and the line code's payload share, by generation (PCI-SIG)
_PCIE = {1: (2.5, 0.8), 2: (5.0, 0.8), 3: (8.0, 128 / 130.0), 4: (16.0, 128 / 130.0), 5: (32.0, 128 / 130.0),
         6: (64.0, 242 / 256.0)}
FIGURES = {  # figure -> (datasheet field, ratio name, unit)
    "matmul_bf16_tflops": ("bf16_tflops", "matmul_bf16", "TFLOPS"),
    "hbm_copy_tbps": ("memory_tbps", "hbm_copy", "TB/s"),
}


def table() -> Dict[str, Any]:
    global _TABLE
    if _TABLE is None:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_models.json")) as f:
            _TABLE = json.load(f)
    return _TABLE


def lookup(name: Optional[str]) -> Optional[Dict[str, Any]]:
    """The table's entry for a GPU by the name nvidia-smi (or torch) gives it; None when it is not there."""
    if not name:
        return None
    for m in table()["models"]:
        if re.search(m["match"], name.strip()):
            return m
    return None


def pcie_gbps(gen: Optional[float], width: Optional[float]) -> Optional[float]:
    """The raw rate of a PCIe link in one direction, GB/s (Gen5 x16: 63.0)."""
    if not gen or not width or int(gen) not in _PCIE:
        return None
    rate, code = _PCIE[int(gen)]
    return rate * width * code / 8.0


def _measured(model: Optional[Dict[str, Any]], figure: str) -> Optional[Tuple[float, str]]:
    got = ((model or {}).get("measured") or {}).get(figure)
    if not got or not got.get("value"):
        return None
    return float(got["value"]), "measured on a healthy %s, %s" % (model["name"] if model else "?", got["file"])


def achievable(model: Optional[Dict[str, Any]], figure: str) -> Tuple[Optional[float], str]:
    """(the figure a healthy GPU of ``model`` gives, where that number comes from)."""
    if model is None:
        return None, "this GPU model is not in dfo's table (remote/gpu/gpu_models.json)"
    got = _measured(model, figure)
    if got is not None:
        return got
    if figure not in FIGURES:
        return None, "the table has no %s figure for %s" % (figure, model["name"])
    field, ratio_name, unit = FIGURES[figure]
    ds = model["datasheet"].get(field)
    if not ds:
        return None, "%s's datasheet gives no %s figure" % (model["name"], figure)
    ratio = table()["ratios"][ratio_name]["value"]
    return round(ds * ratio, 3), "%s datasheet %g %s x %g" % (model["name"], ds, unit, ratio)


def link_achievable(model: Optional[Dict[str, Any]], figure: str, smi_gen: Optional[float],
                    smi_width: Optional[float]) -> Tuple[Optional[float], str]:
    """Host<->device over PCIe: measured for the model where the table has it, else the link's raw rate
    (the datasheet's generation and width, else what nvidia-smi says the GPU and slot support) x the ratio."""
    got = _measured(model, figure)
    if got is not None:
        return got
    ds = (model or {}).get("datasheet") or {}
    gen, width = ds.get("pcie_gen") or smi_gen, ds.get("pcie_width") or smi_width
    raw = pcie_gbps(gen, width)
    if raw is None or gen is None or width is None:
        return None, "no PCIe generation and width known for this GPU"
    ratio = table()["ratios"]["pcie"]["value"]
    where = "the datasheet" if ds.get("pcie_gen") else "nvidia-smi's maximum"
    return round(raw * ratio, 2), "PCIe Gen%d x%d (%s): %.1f GB/s raw x %g" % (int(gen), int(width), where, raw,
                                                                                  ratio)


def nccl_achievable(model: Optional[Dict[str, Any]], all_nvlink: bool) -> Tuple[Optional[float], str]:
    """All-reduce bus bandwidth over NVLink: the model's NVLink rate in one direction x the ratio; none
    for PCIe (the table has no figure for an all-reduce over PCIe: shown, not judged)."""
    if model is None:
        return None, "this GPU model is not in dfo's table"
    got = _measured(model, "nccl_busbw_gbps")
    if got is not None:
        return got
    nv = model["datasheet"].get("nvlink_gbps")
    if not all_nvlink or not nv:
        return None, "GPUs joined over PCIe: no expected all-reduce figure"
    ratio = table()["ratios"]["nccl_nvlink"]["value"]
    return round(nv / 2.0 * ratio, 2), "%s NVLink %g GB/s (%g one way) x %g, an assumption" % (
        model["name"], nv, nv / 2.0, ratio)
