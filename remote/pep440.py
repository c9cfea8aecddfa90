"""PEP 440 versions and specifiers, PEP 503 names (stdlib only); PEP 508 lives in remote.pep508.

A small re-implementation of what ``packaging`` does, for code that runs with a node's
python3 (3.8+) or a job's venv, where ``packaging`` may be absent. Behaviour follows
packaging 26 (tests/test_pep440.py compares the two on many cases), with one simplification:
``Specifier.contains`` always accepts pre-releases that match, which is what an
"is the installed version acceptable" check needs (pip check does the same).
"""
from __future__ import annotations

import re

__all__ = ["InvalidSpecifier", "InvalidVersion", "Specifier", "SpecifierSet", "Version", "canonicalize_name"]
_PEP508_NAMES = ("InvalidMarker", "InvalidRequirement", "Marker", "Requirement", "default_environment")


class InvalidVersion(ValueError):
    pass


class InvalidSpecifier(ValueError):
    pass


def canonicalize_name(name: str) -> str:
    """PEP 503: lowercase, runs of '-', '_' and '.' become one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------- versions

VERSION_PATTERN = r"""
    v?
    (?:
        (?:(?P<epoch>[0-9]+)!)?
        (?P<release>[0-9]+(?:\.[0-9]+)*)
        (?P<pre>[-_\.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_\.]?(?P<pre_n>[0-9]+)?)?
        (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_\.]?(?P<post_l>post|rev|r)[-_\.]?(?P<post_n2>[0-9]+)?))?
        (?P<dev>[-_\.]?(?P<dev_l>dev)[-_\.]?(?P<dev_n>[0-9]+)?)?
    )
    (?:\+(?P<local>[a-z0-9]+(?:[-_\.][a-z0-9]+)*))?
"""
_VERSION_RE = re.compile(r"^\s*" + VERSION_PATTERN + r"\s*$", re.VERBOSE | re.IGNORECASE | re.ASCII)
_NEG, _POS = (0,), (2,)  # sort below / above every real value (which is (1, ...))


class Version:
    """A parsed, normalized PEP 440 version; compares like packaging.version.Version."""

    __slots__ = ("epoch", "release", "pre", "post", "dev", "local", "_key")

    def __init__(self, text: str) -> None:
        m = _VERSION_RE.match(text)
        if not m:
            raise InvalidVersion("invalid version: %r" % (text,))
        self.epoch = int(m.group("epoch") or 0)
        self.release = tuple(int(i) for i in m.group("release").split("."))
        self.pre = None
        if m.group("pre_l"):
            letter = m.group("pre_l").lower()
            letter = {"alpha": "a", "beta": "b", "c": "rc", "pre": "rc", "preview": "rc"}.get(letter, letter)
            self.pre = (letter, int(m.group("pre_n") or 0))
        self.post = None
        if m.group("post"):
            self.post = int(m.group("post_n1") or m.group("post_n2") or 0)
        self.dev = int(m.group("dev_n") or 0) if m.group("dev") else None
        self.local = None
        if m.group("local"):
            self.local = tuple(int(p) if p.isdigit() else p.lower() for p in re.split(r"[-_\.]", m.group("local")))
        self._key = self._cmpkey()

    def _cmpkey(self) -> tuple:
        rel = list(self.release)
        while len(rel) > 1 and rel[-1] == 0:
            rel.pop()
        if self.pre is None and self.post is None and self.dev is not None:
            pre = _NEG  # 1.0.dev0 sorts before 1.0a0
        elif self.pre is None:
            pre = _POS
        else:
            pre = (1,) + self.pre
        post = _NEG if self.post is None else (1, self.post)
        dev = _POS if self.dev is None else (1, self.dev)
        if self.local is None:
            local = _NEG
        else:  # numbers sort above strings; numbers numerically, strings lexically
            local = (1,) + tuple((1, p, "") if isinstance(p, int) else (0, 0, p) for p in self.local)
        return (self.epoch, tuple(rel), pre, post, dev, local)

    def __str__(self) -> str:
        s = self.public
        if self.local is not None:
            s += "+" + ".".join(str(p) for p in self.local)
        return s

    def __repr__(self) -> str:
        return "<Version(%r)>" % str(self)

    @property
    def public(self) -> str:
        s = self.base_version
        if self.pre is not None:
            s += "%s%d" % self.pre
        if self.post is not None:
            s += ".post%d" % self.post
        if self.dev is not None:
            s += ".dev%d" % self.dev
        return s

    @property
    def base_version(self) -> str:
        s = "%d!" % self.epoch if self.epoch else ""
        return s + ".".join(str(i) for i in self.release)

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    @property
    def is_postrelease(self) -> bool:
        return self.post is not None

    def _replace(self, **parts: object) -> Version:
        new = Version.__new__(Version)
        for slot in ("epoch", "release", "pre", "post", "dev", "local"):
            setattr(new, slot, parts[slot] if slot in parts else getattr(self, slot))
        new._key = new._cmpkey()
        return new

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self._key == other._key

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __lt__(self, other: Version) -> bool:
        return self._key < other._key

    def __le__(self, other: Version) -> bool:
        return self._key <= other._key

    def __gt__(self, other: Version) -> bool:
        return self._key > other._key

    def __ge__(self, other: Version) -> bool:
        return self._key >= other._key


def _parse_or_none(text: object) -> Version | None:
    if isinstance(text, Version):
        return text
    try:
        return Version(str(text))
    except InvalidVersion:
        return None


# --------------------------------------------------------------------------- specifiers

_PRE = r"(?:[-_\.]?(?:alpha|beta|preview|pre|a|b|c|rc)[-_\.]?[0-9]*)?"
_POST = r"(?:(?:-[0-9]+)|(?:[-_\.]?(?:post|rev|r)[-_\.]?[0-9]*))?"
_DEV = r"(?:[-_\.]?dev[-_\.]?[0-9]*)?"
_SPECIFIER_PATTERN = (
    r"(?:===\s*[^\s;)]*)"
    r"|(?:(?:==|!=)\s*v?(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)*(?:\.\*|" + _PRE + _POST + _DEV
    + r"(?:\+[a-z0-9]+(?:[-_\.][a-z0-9]+)*)?)?)"
    r"|(?:~=\s*v?(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)+" + _PRE + _POST + _DEV + r")"
    r"|(?:(?:<=|>=|<|>)\s*v?(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)*" + _PRE + _POST + _DEV + r")"
)
_SPECIFIER_RE = re.compile(r"^\s*(?:" + _SPECIFIER_PATTERN + r")\s*$", re.IGNORECASE | re.ASCII)
_SPLIT_PRE = re.compile(r"^([0-9]+)((?:a|b|c|rc)[0-9]+)$")


def _version_split(text: str) -> list:
    epoch, _, rest = text.rpartition("!")
    out = [epoch or "0"]
    for item in rest.split("."):
        m = _SPLIT_PRE.match(item)
        out.extend(m.groups() if m else [item])
    return out


def _numeric_len(parts: list) -> int:
    n = 0
    for p in parts:
        if not p.isdigit():
            break
        n += 1
    return n


class Specifier:
    """One clause such as ``>=1.2`` or ``==3.6.*``."""

    def __init__(self, spec: str) -> None:
        if not _SPECIFIER_RE.match(spec):
            raise InvalidSpecifier("invalid specifier: %r" % (spec,))
        spec = spec.strip()
        n = 3 if spec.startswith("===") else 2 if spec[:2] in ("~=", "==", "!=", "<=", ">=") else 1
        self.operator, self.version = spec[:n], spec[n:].strip()

    def __str__(self) -> str:
        return self.operator + self.version

    def __repr__(self) -> str:
        return "<Specifier(%r)>" % str(self)

    def contains(self, item: object) -> bool:
        """Whether ``item`` (a version string or Version) satisfies this clause."""
        op, spec = self.operator, self.version
        if op == "===":
            return str(item).lower() == spec.lower()
        v = _parse_or_none(item)
        if v is None:
            return False
        if op == "==":
            return self._equal(v, spec)
        if op == "!=":
            return not self._equal(v, spec)
        if op == "~=":
            prefix = _takewhile_not_suffix(_version_split(spec))[:-1]
            return self._ge(v, spec) and self._equal(v, prefix[0] + "!" + ".".join(prefix[1:]) + ".*")
        if op == ">=":
            return self._ge(v, spec)
        if op == "<=":
            return v._replace(local=None) <= Version(spec)
        sv = Version(spec)
        if op == "<":
            if not v < sv:
                return False
            return not (not sv.is_prerelease and v.is_prerelease and v >= sv._replace(dev=0, local=None))
        # ">"
        if not v > sv:
            return False
        if not sv.is_postrelease and v.is_postrelease and v._replace(post=None, dev=None, local=None) == sv:
            return False
        return not (v.local is not None and v._replace(local=None) == sv)

    @staticmethod
    def _ge(v: Version, spec: str) -> bool:
        return v._replace(local=None) >= Version(spec)

    @staticmethod
    def _equal(v: Version, spec: str) -> bool:
        if spec.endswith(".*"):
            split_spec = _version_split(str(Version(spec[:-2])))
            split_v = _version_split(v.public)
            have, want = _numeric_len(split_v), _numeric_len(split_spec)
            if want > have:
                split_v = split_v[:have] + ["0"] * (want - have) + split_v[have:]
            return split_v[: len(split_spec)] == split_spec
        sv = Version(spec)
        if sv.local is None:
            v = v._replace(local=None)
        return v == sv


def _takewhile_not_suffix(parts: list) -> list:
    out = []
    for p in parts:
        if any(p.startswith(s) for s in ("dev", "a", "b", "rc", "post")):
            break
        out.append(p)
    return out


class SpecifierSet:
    """Comma-separated clauses; a version must satisfy all of them (an empty set allows any)."""

    def __init__(self, specs: str = "") -> None:
        parts = [s.strip() for s in specs.split(",") if s.strip()]
        if specs.strip() and len(parts) != len(specs.split(",")):
            raise InvalidSpecifier("invalid specifier: %r" % (specs,))
        self.specs = [Specifier(p) for p in parts]

    def __str__(self) -> str:
        return ",".join(sorted(str(s) for s in self.specs))

    def __repr__(self) -> str:
        return "<SpecifierSet(%r)>" % str(self)

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.specs)

    def contains(self, item: object) -> bool:
        return all(s.contains(item) for s in self.specs)

    def exact_version(self) -> str | None:
        """The version of a single ``==V`` (no wildcard) clause, else None."""
        if len(self.specs) == 1 and self.specs[0].operator in ("==", "===") and "*" not in self.specs[0].version:
            return self.specs[0].version
        return None


def __getattr__(name: str) -> object:
    """``from remote.pep440 import Requirement`` works too (it lives in remote.pep508)."""
    if name in _PEP508_NAMES:
        from remote import pep508

        return getattr(pep508, name)
    raise AttributeError(name)
