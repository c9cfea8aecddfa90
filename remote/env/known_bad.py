"""Known-bad combinations of GPU arch and package versions (python3 3.8+, stdlib + vendored packaging).

The data lives in ``known_bad.json`` beside this file. ``match_known_bad`` is what
``dfo verify-env`` calls, with or without ``--gpu``::

    match_known_bad({"torch": "2.11.0+cu130", "triton": "3.6.0", "fla-core": "0.6.0"},
                    ["9.0"], ["sm_80", "sm_90", "sm_100", "sm_120"])

Versions are compared with ``packaging`` (vendored in remote/_vendor), local labels
(``+cu130``) ignored, with one deliberate difference from PEP 440 specifiers: pre-releases
are always included in ranges, and ``<V``/``>V`` are plain version order (so ``<3.7.1``
includes 3.7.1rc1): a known-bad range should rather warn once too often than miss a nightly build.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from remote._vendor.packaging.specifiers import Specifier, SpecifierSet
from remote._vendor.packaging.utils import canonicalize_name
from remote._vendor.packaging.version import Version

__all__ = ["Version", "arch_name", "arch_support", "compare_versions", "load_entries", "match_entries",
           "match_known_bad", "version_matches"]

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "known_bad.json")


def _public(text: str) -> Version:
    return Version(Version(text).public)


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as version ``a`` sorts before, with or after ``b`` (local labels ignored)."""
    va, vb = _public(a), _public(b)
    return (va > vb) - (va < vb)


def _match_one(version: Version, clause: Specifier) -> bool:
    if clause.operator in ("<", ">"):  # plain order: PEP 440 would leave out 3.7.1rc1 from <3.7.1
        public, want = Version(version.public), Version(clause.version)
        return public < want if clause.operator == "<" else public > want
    return clause.contains(version, prereleases=True)


def version_matches(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every comma-separated clause of ``spec`` ("" = any).

    Raises ValueError (InvalidVersion, InvalidSpecifier) for text that does not parse."""
    parsed = Version(version)
    return all(_match_one(parsed, clause) for clause in SpecifierSet(spec))


# -- GPU arch ---------------------------------------------------------------------------

def _parse_capability(cap: str) -> Tuple[int, int]:
    major, _, minor = str(cap).strip().partition(".")
    return int(major), int(minor or 0)


def _parse_arch(arch: str) -> Optional[Tuple[str, int, int, str]]:
    m = re.match(r"^(sm|compute)_(\d+)([a-z]?)$", arch.strip())
    if m is None:
        return None
    digits = m.group(2)
    return m.group(1), int(digits[:-1]), int(digits[-1]), m.group(3)


def arch_name(capability: str) -> str:
    major, minor = _parse_capability(capability)
    return "sm_%d%d" % (major, minor)


def arch_support(capability: str, arch_list: List[str]) -> Tuple[bool, str]:
    """Whether a torch build with ``arch_list`` has code for a GPU of ``capability``.

    Exact SASS, SASS of an older minor of the same major (binary compatible), or PTX at or
    below the capability (JIT-compiled by the driver at first use) count as supported.
    Arch-specific targets (``sm_90a``) run only on that exact arch.
    """
    major, minor = _parse_capability(capability)
    exact = "sm_%d%d" % (major, minor)
    parsed = [p for p in (_parse_arch(a) for a in arch_list) if p is not None]
    for kind, amaj, amin, suffix in parsed:
        if kind == "sm" and (amaj, amin) == (major, minor):
            return True, "the build has %s%s" % (exact, suffix)
    for kind, amaj, amin, suffix in parsed:
        if kind == "sm" and not suffix and amaj == major and amin < minor:
            return True, "the build has sm_%d%d, binary compatible with %s" % (amaj, amin, exact)
    ptx = [(amaj, amin) for kind, amaj, amin, suffix in parsed
           if kind == "compute" and not suffix and (amaj, amin) <= (major, minor)]
    if ptx:
        best = max(ptx)
        return True, "only PTX compute_%d%d: the driver JIT-compiles it for %s (slow first start)" % (
            best[0], best[1], exact)
    return False, "the torch build has no code for %s (arch list: %s)" % (
        exact, " ".join(arch_list) if arch_list else "empty")


# -- known-bad evaluation ----------------------------------------------------------------

def load_entries(path: Optional[str] = None) -> List[Dict[str, Any]]:
    with open(path or _DATA, "r", encoding="utf-8") as f:
        return list(json.load(f)["entries"])


def _gpu_matches(cond: Dict[str, Any], capabilities: List[str]) -> List[str]:
    """The capabilities that satisfy ``cond`` (all of them for an empty condition)."""
    hits = []
    for cap in capabilities:
        major, minor = _parse_capability(cap)
        if "capability_major" in cond and major not in cond["capability_major"]:
            continue
        if "capability" in cond and "%d.%d" % (major, minor) not in cond["capability"]:
            continue
        hits.append("%d.%d" % (major, minor))
    return hits


def match_entries(
    packages: Dict[str, Optional[str]],
    capabilities: List[str],
    arch_list: Optional[List[str]],
    entries: Optional[List[Dict[str, Any]]] = None,
) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """Like ``match_known_bad`` but returns ``(entry, problem)`` pairs."""
    pkgs = {canonicalize_name(k): v for k, v in packages.items()}
    out = []
    for entry in entries if entries is not None else load_entries():
        caps = _gpu_matches(entry.get("gpu") or {}, capabilities)
        if not caps:
            continue
        if entry.get("only_without_arch_list") and arch_list is not None:
            continue
        found: Dict[str, str] = {}
        ok = True
        for name, spec in (entry.get("packages") or {}).items():
            version = pkgs.get(canonicalize_name(name))
            if not version:
                ok = False
                break
            try:
                if not version_matches(version, spec):
                    ok = False
                    break
            except ValueError:
                ok = False  # an unparsable version never matches: no guessing
                break
            found[name] = version
        if not ok or any(pkgs.get(canonicalize_name(n)) for n in entry.get("absent") or []):
            continue
        detail = ""
        if entry.get("requires_arch_list"):
            if arch_list is None:
                continue
            missing = [c for c in caps if not arch_support(c, arch_list)[0]]
            if not missing:
                continue
            caps = missing
            detail = " (%s)" % arch_support(missing[0], arch_list)[1]
        report = entry.get("report") or {}
        rpkg = report.get("package")
        found_text = found.get(rpkg) if rpkg else None
        if entry.get("requires_arch_list") and found_text is not None:
            found_text = "%s (arch list: %s)" % (found_text, " ".join(arch_list or []) or "empty")
        message = "known bad [%s] on GPU arch %s with %s: %s%s. Fix: %s. Source: %s" % (
            entry["id"],
            ", ".join(sorted(set(arch_name(c) for c in caps))),
            ", ".join("%s %s" % kv for kv in sorted(found.items())) or "this setup",
            entry.get("breaks", "").rstrip("."),
            detail,
            entry.get("fix", "").rstrip("."),
            entry.get("source", ""),
        )
        out.append((entry, {
            "kind": "known_bad",
            "package": rpkg,
            "expected": report.get("expected"),
            "found": found_text,
            "message": message,
        }))
    return out


def match_known_bad(
    packages: Dict[str, Optional[str]],
    capabilities: List[str],
    arch_list: Optional[List[str]],
) -> List[Dict[str, Any]]:
    """Problems for every known-bad entry that this node's setup matches.

    ``packages`` maps distribution names (any spelling: ``fla_core`` = ``fla-core``) to
    installed versions, or None when not installed. ``capabilities`` are the GPUs' compute
    capabilities ("9.0"), one per GPU; with none, GPU-specific entries cannot match.
    ``arch_list`` is ``torch.cuda.get_arch_list()`` when known, else None.
    Each problem has the verify-env keys: kind ("known_bad"), package, expected, found, message.
    """
    return [problem for _entry, problem in match_entries(packages, capabilities, arch_list)]
