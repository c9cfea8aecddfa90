"""Which of a node's GPUs a queued run may have (python3 3.8+, stdlib only): ``dfo submit``'s packing.

The node's GPUs are numbered 0..N-1 as nvidia-smi numbers them (PCI bus order: a run started from the
queue gets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` beside ``CUDA_VISIBLE_DEVICES``, so CUDA counts the same way).
N is the inventory's ``gpus:`` for the host when the submit said it, else nvidia-smi's count, else 0.

A GPU is not free when
* a running dfo run holds it: a run started from the queue holds the GPUs in its meta.json ``gpus``; a run
  started by ``dfo launch`` (no ``gpus`` there) may use every GPU it sees, so it holds them all;
* nvidia-smi (where there is one) shows a compute process on it that is not on a GPU a dfo run holds:
  another user's job, a notebook, a process left over from an ended run. Its pid need not be visible
  here (a container shows the host's pids, or none): any process on a GPU no dfo run holds keeps it busy.
"""
from __future__ import annotations

import subprocess

from remote.lib.fsutil import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

SMI_TIMEOUT_S = 10.0


def _smi(args: List[str]) -> Optional[List[List[str]]]:
    """nvidia-smi's CSV rows (lists of stripped fields), or None: no nvidia-smi, it failed or hung."""
    exe = which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe] + args + ["--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    rows = []
    for line in res.stdout.decode("utf-8", "replace").splitlines():
        if line.strip():
            rows.append([f.strip() for f in line.split(",")])
    return rows


def smi_view() -> Tuple[Optional[int], Set[int]]:
    """(GPU count or None, indices with a compute process) as nvidia-smi tells them; (None, set()) without it."""
    gpus = _smi(["--query-gpu=index,uuid"])
    if gpus is None:
        return None, set()
    by_uuid: Dict[str, int] = {}
    for row in gpus:
        if len(row) >= 2 and row[0].isdigit():
            by_uuid[row[1]] = int(row[0])
    busy: Set[int] = set()
    for row in _smi(["--query-compute-apps=gpu_uuid,pid"]) or []:
        if row and row[0] in by_uuid:
            busy.add(by_uuid[row[0]])
    return len(by_uuid), busy


def held_by(running_metas: Iterable[Dict[str, Any]], total: int) -> Set[int]:
    """The GPU indices the running dfo runs hold (see the module's docstring)."""
    held: Set[int] = set()
    for meta in running_metas:
        gpus = meta.get("gpus") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or "gpus" not in meta:
            return set(range(total))  # a run from dfo launch: it sees every GPU
        if isinstance(gpus, list):
            held.update(g for g in gpus if isinstance(g, int) and not isinstance(g, bool))
    return held


def free_gpus(total: int, held: Set[int], busy: Set[int]) -> List[int]:
    """The free GPU indices, lowest first."""
    return [i for i in range(total) if i not in held and i not in busy]


def visible_env(gpus: List[int]) -> Dict[str, str]:
    """The trainer's variables for these GPUs (an empty list: no GPU at all)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
