"""Failure signatures: from the last lines of a run's log (and how it ended) to what to do next.

The table lives in orchestrator/data/signatures.json (name, title, patterns, optional context,
optional end-record match, meaning, action). ``diagnose`` returns every signature that matches,
most specific first; launch, tail and status print them under a failed run.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "signatures.json"
MAX_LINE = 300


@dataclass(frozen=True)
class Diagnosis:
    name: str
    line: str
    meaning: str
    action: str
    title: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Signature:
    name: str
    title: str
    patterns: tuple[re.Pattern[str], ...]
    meaning: str
    action: str
    context: re.Pattern[str] | None = None
    end: dict[str, tuple[Any, ...]] = field(default_factory=dict)


@lru_cache(maxsize=1)
def signatures() -> tuple[Signature, ...]:
    doc = json.loads(DATA.read_text())
    out = []
    for s in doc["signatures"]:
        out.append(Signature(
            name=s["name"], title=s.get("title", s["name"]),
            patterns=tuple(re.compile(p) for p in s.get("patterns", [])),
            meaning=s["meaning"], action=s["action"],
            context=re.compile(s["context"]) if s.get("context") else None,
            end={k: tuple(v) for k, v in (s.get("end") or {}).items()},
        ))
    return tuple(out)


def _end_line(sig: Signature, end: dict[str, Any]) -> str | None:
    """A line describing how the run ended, when the end record matches ``sig.end``."""
    if not sig.end or end.get("stopped"):
        return None
    for key, values in sig.end.items():
        if end.get(key) in values:
            if key == "state":
                return f"run state: {end[key]}"
            how = f"signal {end['signal']}" if end.get("signal") else f"exit code {end.get('exit_code')}"
            kernel = [k for k in end.get("kernel") or [] if k]
            words = f"; kernel ({end.get('kernel_source')}): {kernel[-1]}" if kernel else ""
            oom = end.get("cgroup_oom_kills")
            if oom:
                words += f"; cgroup memory.events oom_kill +{oom}"
            return f"ended by {how}{words}"
    return None


def _clip(line: str) -> str:
    line = line.rstrip()
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def diagnose(log_tail: list[str], end: dict[str, Any] | None) -> list[Diagnosis]:
    """Signatures that match the log's last lines and the end record (end.json plus ``state``)."""
    found: list[Diagnosis] = []
    end = end or {}
    for sig in signatures():
        if sig.context is not None and not any(sig.context.search(ln) for ln in log_tail):
            continue
        hit: str | None = None
        for pattern in sig.patterns:
            hit = next((ln for ln in reversed(log_tail) if pattern.search(ln)), None)
            if hit is not None:
                break
        from_end = _end_line(sig, end)
        if hit is None and from_end is None:
            continue
        found.append(Diagnosis(sig.name, _clip(from_end or hit or ""), sig.meaning, sig.action, sig.title))
    return found


def render(diagnoses: list[Diagnosis]) -> list[str]:
    """Plain-text lines (no markup) for a terminal."""
    out: list[str] = []
    for d in diagnoses:
        out += [f"diagnosis: {d.title} [{d.name}]", f"  line:    {d.line}", f"  meaning: {d.meaning}",
                f"  do:      {d.action}"]
    return out
