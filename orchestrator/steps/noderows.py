"""The one place where the laptop reads a run's metrics rows from a node (node data: docs/security.md).

Every row that top, status, plot and report show comes through here: the ``metrics`` op's rows
(steps/metrics.py ``fetch``), status's last sample (``RunInfo.metrics``), a pulled metrics.jsonl and the
copy beside outputs.dest (``--from-s3``). What comes out has the shapes docs/metrics.md describes and
nothing else, so no view can fail on it:

* a row is an object with ``kind`` ``sys`` or ``train`` and a finite number ``t``; anything else is
  dropped (a line that is not JSON, a list, a ``t`` of ``"x"`` or ``1e999``);
* a sample's figures (each GPU's, the host's) are finite numbers, never a bool: a string, ``NaN`` or
  ``Infinity`` is left out, as the sampler leaves out a figure the GPU does not report; an entry of
  ``gpus`` that is not an object, or has no index ``i``, is dropped; a GPU's text fields (name, uuid,
  bus, throttle) stay text; ``xid`` is a list of ``{bus, xid, line}`` or null;
* a training figure is a number; one the trainer itself logged as ``nan``, ``inf`` or ``-inf`` (a
  diverged run) is kept as that float, so that it is shown as what it is (``nan`` in a table, a marked
  point in a plot) and printed as ``null`` by dfo's JSON (cli_common.json_text). ``step`` is finite or
  null (the figures logged before any step), ``total`` finite and above 0 or left out.

Nothing here raises on any input. Sizes are bounded too: 64 GPUs a row, 64 figures an object, 256
characters a text field, 64 XIDs a row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

MAX_GPUS = 64
MAX_KEYS = 64
MAX_TEXT = 256
MAX_XIDS = 64
GPU_TEXT = ("uuid", "name", "bus", "throttle")  # the sampler's text fields of a GPU (remote/runs/metrics.py)
_BIG = float(2**63)  # an int past this is no figure (and float() of a JSON integer of 400 digits fails)
KIND = b'"kind"'  # every row the sampler writes has it: a line without it is skipped unparsed


def finite(v: object) -> int | float | None:
    """``v`` when it is a finite number (int or float, not bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return v if -_BIG < v < _BIG else None


def figure(v: object) -> int | float | None:
    """A training figure: a finite number, or a float NaN / +-inf as the trainer logged it; else None."""
    if isinstance(v, float) and not math.isfinite(v):
        return v
    return finite(v)


def _text(v: object) -> str | None:
    return v[:MAX_TEXT] if isinstance(v, str) else None


def numbers(d: object) -> dict[str, int | float]:
    """The finite numbers of an object (a sample's ``host``, the figures of a GPU), keyed by text."""
    out: dict[str, int | float] = {}
    if not isinstance(d, dict):
        return out
    for k, v in d.items():
        n = finite(v)
        if n is not None and isinstance(k, str) and len(out) < MAX_KEYS:
            out[k[:MAX_TEXT]] = n
    return out


def gpu(g: object) -> dict[str, Any] | None:
    """One GPU of a sample: its finite figures and its text fields; None for an entry that is not an object
    or has no index ``i`` (the sampler writes no GPU without one)."""
    if not isinstance(g, dict) or finite(g.get("i")) is None:
        return None
    out: dict[str, Any] = {}
    for k, v in g.items():
        if not isinstance(k, str) or len(out) >= MAX_KEYS:
            continue
        val = _text(v) if k in GPU_TEXT else finite(v)
        if val is not None:
            out[k[:MAX_TEXT]] = val
    return out


def xids(x: object) -> list[dict[str, Any]] | None:
    """A sample's new XID errors: ``[{bus, xid, line}]``; None where the node could not read them."""
    if not isinstance(x, list):
        return None
    out = []
    for e in x[:MAX_XIDS]:
        if isinstance(e, dict) and finite(e.get("xid")) is not None:
            out.append({"bus": _text(e.get("bus")) or "?", "xid": finite(e.get("xid")),
                        "line": _text(e.get("line")) or ""})
    return out


def row(r: object) -> dict[str, Any] | None:
    """One row of metrics.jsonl, cleaned (the module's docstring); None for a row no view can use."""
    if not isinstance(r, dict):
        return None
    kind, t = r.get("kind"), finite(r.get("t"))
    if t is None or kind not in ("sys", "train"):
        return None
    if kind == "sys":
        out: dict[str, Any] = {"t": t, "kind": "sys"}
        gpus = r.get("gpus")
        out["gpus"] = [g for g in map(gpu, gpus[:MAX_GPUS] if isinstance(gpus, list) else []) if g is not None]
        out["host"] = numbers(r.get("host"))
        if "xid" in r:
            out["xid"] = xids(r.get("xid"))
        return out
    out = {"t": t, "kind": "train"}
    for k, v in r.items():
        if not isinstance(k, str) or k in ("t", "kind") or len(out) >= MAX_KEYS + 2:
            continue
        val = finite(v) if k in ("step", "total") else figure(v)
        if val is not None and not (k == "total" and val <= 0):
            out[k[:MAX_TEXT]] = val
    if "step" not in out and "step" in r:
        out["step"] = None  # a step the node gave but no view can place: the row is still the step's figures
    return out


def rows(data: object) -> list[dict[str, Any]]:
    """The usable rows of a list the node sent (the ``metrics`` op's ``rows``), in order."""
    if not isinstance(data, list):
        return []
    return [x for x in map(row, data) if x is not None]


def last(metrics: object) -> dict[str, Any] | None:
    """status's last sample ``{"sys": row, "train": row}`` cleaned; None when neither is usable."""
    if not isinstance(metrics, dict):
        return None
    s, t = row(metrics.get("sys")), row(metrics.get("train"))
    s = s if s is not None and s["kind"] == "sys" else None
    t = t if t is not None and t["kind"] == "train" else None
    return None if s is None and t is None else {"sys": s, "train": t}


def parse_line(line: bytes | str) -> dict[str, Any] | None:
    """One line of metrics.jsonl as a cleaned row, or None."""
    if isinstance(line, bytes) and KIND not in line or isinstance(line, str) and '"kind"' not in line:
        return None
    try:
        return row(json.loads(line))
    except (ValueError, RecursionError):
        return None


def thin(items: list[Any], n: int) -> list[Any]:
    """At most ``n`` items, evenly picked, the last always kept: the node's own rule (remote/runs/metrics.py
    ``thin``, which the ``metrics`` op applies), so a file read here is thinned as the node would thin it."""
    from remote.runs.metrics import thin as node_thin

    picked: list[Any] = node_thin(items, max(1, n))
    return picked


def read_lines(lines: Iterable[bytes], max_rows: int = 20000, since: float = 0) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl given as a stream of lines: each line parsed and cleaned as it comes,
    only the raw lines of usable rows kept (at most the bytes read), those after ``since`` (as the
    ``metrics`` op), then thinned to ``max_rows`` as the node thins, and only the rows picked parsed again.
    Memory: the usable lines' bytes, never a dict per line."""
    kept: list[bytes] = []
    for ln in lines:
        if KIND in ln:  # the cheap test first: a line of filler costs no parse (split_lines(must=KIND): none)
            r = parse_line(ln)
            if r is not None and r["t"] > since:
                kept.append(ln)
    out = []
    for ln in thin(kept, max_rows):
        r = parse_line(ln)
        if r is not None:
            out.append(r)
    return out


def split_lines(chunks: Iterable[bytes], skip_first: bool = False, max_line: int = 1 << 20,
                must: bytes | None = None) -> Iterator[bytes]:
    """Lines (without their newline) of a stream of byte chunks; ``skip_first``: the first line is a tail
    of one cut by a ranged read, and dropped. A line longer than ``max_line`` is dropped whole, and no more
    than ``max_line`` bytes of one are ever held. ``must``: only lines that hold these bytes matter (the
    caller drops the others), so a run of lines without them is passed over whole, unsplit."""
    carry = b""
    dropping = False  # within a line past max_line: its bytes are dropped up to its newline
    for chunk in chunks:
        data = carry + chunk if carry else chunk
        nl = data.rfind(b"\n")
        if nl < 0:
            carry = b"" if dropping else data
        else:
            whole = data[:nl]
            lines = whole.split(b"\n") if must is None or must in whole else [b""]
            carry = data[nl + 1:]
            if dropping or skip_first:
                lines = lines[1:]
                dropping = skip_first = False
            for ln in lines:
                if len(ln) <= max_line:
                    yield ln
        if len(carry) > max_line:
            carry, dropping, skip_first = b"", True, False  # a first line that is dropped is dropped once
    if carry and not dropping and not skip_first:
        yield carry


def read_chunks(chunks: Iterable[bytes], max_rows: int = 20000, since: float = 0,
                skip_first: bool = False) -> list[dict[str, Any]]:
    """``read_lines`` of a metrics.jsonl given as a stream of byte chunks (a file, an S3 body)."""
    return read_lines(split_lines(chunks, skip_first=skip_first, must=KIND), max_rows, since)
