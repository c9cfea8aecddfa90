"""Known-bad combinations of GPU arch and package versions (python3 3.8+, stdlib only).

The data lives in ``known_bad.json`` beside this file. ``match_known_bad`` is what
``dfo verify-env`` calls, with or without ``--gpu``::

    match_known_bad({"torch": "2.11.0+cu130", "triton": "3.6.0", "fla-core": "0.6.0"},
                    ["9.0"], ["sm_80", "sm_90", "sm_100", "sm_120"])

Versions are compared with a small PEP 440-like matcher (no ``packaging``): release
tuples, then dev < pre (a/b/rc) < final < post, local labels (``+cu130``) ignored.
Unlike PEP 440 specifiers, pre-releases are always included in ranges: a known-bad
range should rather warn once too often than miss a nightly build.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "known_bad.json")

_VERSION_RE = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>\d+)!)?
    (?P<release>\d+(?:\.\d+)*)
    (?:[-_.]?(?P<pre_l>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>\d*))?
    (?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d*))?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d*))?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


class Version:
    """A parsed version; ordering follows PEP 440 closely enough for known-bad ranges."""

    __slots__ = ("text", "epoch", "release", "pre", "post", "dev", "local")

    def __init__(self, text: str) -> None:
        m = _VERSION_RE.match(text)
        if m is None:
            raise ValueError("not a version: %r" % (text,))
        self.text = text.strip()
        self.epoch = int(m.group("epoch") or 0)
        self.release: Tuple[int, ...] = tuple(int(p) for p in m.group("release").split("."))
        pre_l = m.group("pre_l")
        self.pre: Optional[Tuple[int, int]] = (
            (_PRE_RANK[pre_l.lower()], int(m.group("pre_n") or 0)) if pre_l else None
        )
        if m.group("post_n1"):
            self.post: Optional[int] = int(m.group("post_n1"))
        elif m.group("post_l"):
            self.post = int(m.group("post_n2") or 0)
        else:
            self.post = None
        self.dev: Optional[int] = int(m.group("dev_n") or 0) if m.group("dev_l") else None
        self.local: Optional[str] = m.group("local").lower() if m.group("local") else None

    def key(self) -> Tuple[Any, ...]:
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        if self.pre is None and self.post is None and self.dev is not None:
            pre: Tuple[int, ...] = (-1,)  # 1.0.dev1 sorts before 1.0a1
        elif self.pre is None:
            pre = (3,)  # a final (or post) release sorts after its pre-releases
        else:
            pre = (self.pre[0], self.pre[1])
        post = (-1,) if self.post is None else (self.post,)
        dev = (1 << 62,) if self.dev is None else (self.dev,)
        return (self.epoch, tuple(release), pre, post, dev)

    def __repr__(self) -> str:
        return "Version(%r)" % (self.text,)


def parse_version(text: str) -> Version:
    return Version(text)


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as version ``a`` sorts before, with or after ``b`` (local labels ignored)."""
    ka, kb = Version(a).key(), Version(b).key()
    return (ka > kb) - (ka < kb)


def _match_one(version: Version, clause: str) -> bool:
    clause = clause.strip()
    m = re.match(r"^(===|~=|==|!=|<=|>=|<|>)\s*(.+)$", clause)
    if m is None:
        raise ValueError("not a version specifier: %r" % (clause,))
    op, target = m.group(1), m.group(2).strip()
    if op == "===":
        return version.text == target
    if op in ("==", "!=") and target.endswith(".*"):
        prefix = tuple(int(p) for p in target[:-2].split("."))
        release = version.release + (0,) * max(0, len(prefix) - len(version.release))
        hit = release[: len(prefix)] == prefix
        return hit if op == "==" else not hit
    want = Version(target)
    if op in ("==", "!="):
        same = version.key() == want.key()
        if same and want.local is not None:
            same = version.local == want.local
        return same if op == "==" else not same
    if op == "~=":
        if len(want.release) < 2:
            raise ValueError("~= needs at least two release parts: %r" % (clause,))
        prefix = want.release[:-1]
        release = version.release + (0,) * max(0, len(prefix) - len(version.release))
        return version.key() >= want.key() and release[: len(prefix)] == prefix
    kv, kw = version.key(), want.key()
    if op == "<":
        return kv < kw
    if op == "<=":
        return kv <= kw
    if op == ">":
        return kv > kw
    return kv >= kw


def version_matches(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every comma-separated clause of ``spec`` ("" = any)."""
    parsed = Version(version)
    return all(_match_one(parsed, c) for c in spec.split(",") if c.strip())


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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
    pkgs = {normalize_name(k): v for k, v in packages.items()}
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
            version = pkgs.get(normalize_name(name))
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
        if not ok or any(pkgs.get(normalize_name(n)) for n in entry.get("absent") or []):
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
