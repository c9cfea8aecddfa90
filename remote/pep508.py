"""PEP 508 dependency specifiers and environment markers (stdlib only, python3 3.8+).

Parsing follows packaging 26's grammar (packaging/_parser.py) and marker evaluation its
semantics: version comparisons for python_version & co. when the right side is a valid
specifier, plain string comparison otherwise, ``extra`` names normalized per PEP 685.
"""
from __future__ import annotations

import ast
import os
import platform
import re
import sys

from remote.pep440 import _SPECIFIER_PATTERN, InvalidSpecifier, Specifier, SpecifierSet, canonicalize_name

__all__ = ["InvalidMarker", "InvalidRequirement", "Marker", "Requirement", "default_environment"]


class InvalidRequirement(ValueError):
    pass


class InvalidMarker(ValueError):
    pass


# --------------------------------------------------------------------------- PEP 508

_TOKENS = {
    "LP": r"\(", "RP": r"\)", "LB": r"\[", "RB": r"\]", "SEMI": r";", "COMMA": r",",
    "QUOTED": r"""(?:'[^']*')|(?:"[^"]*")""",
    "OP": r"(?:===|==|~=|!=|<=|>=|<|>)",
    "BOOLOP": r"\b(?:or|and)\b", "IN": r"\bin\b", "NOT": r"\bnot\b",
    "VARIABLE": r"\b(?:python_version|python_full_version|os[._]name|sys[._]platform|platform_(?:release|system)"
                r"|platform[._](?:version|machine|python_implementation)|python_implementation"
                r"|implementation_(?:name|version)|extras?|dependency_groups)\b",
    "SPECIFIER": r"(?i:" + _SPECIFIER_PATTERN + r")",
    "AT": r"@", "URL": r"[^ \t]+", "IDENT": r"\b[a-zA-Z0-9][a-zA-Z0-9._-]*\b",
    "PREFIX_TRAIL": r"\.\*", "LOCAL_TRAIL": r"\+[a-z0-9]+(?:[-_\.][a-z0-9]+)*", "WS": r"[ \t]+", "END": r"$",
}
_TOKEN_RE = dict((k, re.compile(v, re.ASCII)) for k, v in _TOKENS.items())
_VERSION_KEYS = ("implementation_version", "platform_release", "python_full_version", "python_version")


class _Tokens:
    def __init__(self, source: str, error: type) -> None:
        self.source, self.pos, self.error = source, 0, error

    def peek(self, name: str) -> str | None:
        m = _TOKEN_RE[name].match(self.source, self.pos)
        return m.group(0) if m else None

    def at(self, name: str) -> bool:
        return _TOKEN_RE[name].match(self.source, self.pos) is not None

    def take(self, name: str) -> str | None:
        text = self.peek(name)
        if text is not None:
            self.pos += len(text)
        return text

    def expect(self, name: str, what: str) -> str:
        text = self.take(name)
        if text is None:
            self.fail("expected " + what)
        return text  # type: ignore[return-value]

    def fail(self, message: str) -> None:
        raise self.error("%s at column %d of %r" % (message, self.pos + 1, self.source))

    def enclosed(self, open_: str, close: str, body, what: str):  # type: ignore[no-untyped-def]
        opened = self.take(open_) is not None
        value = body()
        if opened and self.take(close) is None:
            self.fail("expected matching %s after %s" % ({"RP": "')'", "RB": "']'"}[close], what))
        return value


def _parse_marker(tok: _Tokens) -> list:
    expr = [_parse_marker_atom(tok)]
    while tok.at("BOOLOP"):
        expr.extend((tok.take("BOOLOP"), _parse_marker_atom(tok)))
    return expr


def _parse_marker_atom(tok: _Tokens):  # type: ignore[no-untyped-def]
    tok.take("WS")
    if tok.at("LP"):
        def body() -> list:
            tok.take("WS")
            inner = _parse_marker(tok)
            tok.take("WS")
            return inner
        atom = tok.enclosed("LP", "RP", body, "marker expression")
    else:
        left = _parse_marker_var(tok)
        tok.take("WS")
        if tok.take("IN"):
            op = "in"
        elif tok.take("NOT"):
            tok.expect("WS", "whitespace after 'not'")
            tok.expect("IN", "'in' after 'not'")
            op = "not in"
        else:
            op = tok.take("OP") or tok.fail("expected a marker operator (<=, <, !=, ==, >=, >, ~=, ===, in, not in)")
        tok.take("WS")
        right = _parse_marker_var(tok)
        atom = _normalize_extra((left, op, right))
    tok.take("WS")
    return atom


def _parse_marker_var(tok: _Tokens) -> tuple:
    var = tok.take("VARIABLE")
    if var is not None:
        var = var.replace(".", "_")
        return ("var", "platform_python_implementation" if var == "python_implementation" else var)
    quoted = tok.take("QUOTED")
    if quoted is None:
        tok.fail("expected a marker variable or quoted string")
    return ("str", str(ast.literal_eval(quoted)))  # type: ignore[arg-type]


def _normalize_extra(item: tuple) -> tuple:
    left, op, right = item
    if left == ("var", "extra") and right[0] == "str":
        right = ("str", canonicalize_name(right[1]))
    elif right == ("var", "extra") and left[0] == "str":
        left = ("str", canonicalize_name(left[1]))
    return (left, op, right)


def default_environment() -> dict:
    iv = sys.implementation.version
    impl = "%d.%d.%d" % (iv.major, iv.minor, iv.micro)
    if iv.releaselevel != "final":
        impl += iv.releaselevel[0] + str(iv.serial)
    full = platform.python_version()
    return {
        "implementation_name": sys.implementation.name, "implementation_version": impl,
        "os_name": os.name, "platform_machine": platform.machine(), "platform_release": platform.release(),
        "platform_system": platform.system(), "platform_version": platform.version(),
        "python_full_version": full + "local" if full.endswith("+") else full,
        "platform_python_implementation": platform.python_implementation(),
        "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform,
    }


def _eval_item(item: tuple, env: dict) -> bool:
    (lk, lv), op, (rk, rv) = item
    if lk == "var":
        key, lhs, rhs = lv, env.get(lv), rv
    else:
        key, lhs, rhs = rv, lv, env.get(rv)
    if lhs is None or rhs is None:
        raise InvalidMarker("undefined marker variable %r" % key)
    if key in _VERSION_KEYS:
        try:
            return Specifier(op + rhs).contains(lhs)
        except InvalidSpecifier:
            pass
    if op == "in":
        return lhs in rhs
    if op == "not in":
        return lhs not in rhs
    if op in ("==", "<=", ">="):
        return lhs == rhs
    if op == "!=":
        return lhs != rhs
    if op in ("<", ">"):
        return False
    raise InvalidMarker("undefined comparison %r %s %r" % (lhs, op, rhs))


def _eval(markers: list, env: dict) -> bool:
    groups = [[]]  # type: list
    for m in markers:
        if isinstance(m, list):
            groups[-1].append(_eval(m, env))
        elif m == "or":
            groups.append([])
        elif m != "and":
            groups[-1].append(_eval_item(m, env))
    return any(all(g) for g in groups)


class Marker:
    """A PEP 508 environment marker such as ``python_version >= "3.9" and extra == "gpu"``."""

    def __init__(self, text: str, _parsed: list | None = None) -> None:
        self.text = text.strip()
        if _parsed is None:
            tok = _Tokens(text, InvalidMarker)
            _parsed = _parse_marker(tok)
            tok.expect("END", "end of marker expression")
        self._markers = _parsed

    def __str__(self) -> str:
        return self.text

    def evaluate(self, environment: dict | None = None) -> bool:
        """True when the marker holds; ``extra`` defaults to "" (no extra requested)."""
        env = default_environment()
        env["extra"] = ""
        if environment:
            env.update(environment)
        if env.get("extra"):
            env["extra"] = canonicalize_name(env["extra"])
        return _eval(self._markers, env)


class Requirement:
    """A PEP 508 dependency specifier: ``name[extras] specifiers ; marker`` or ``name @ url``."""

    def __init__(self, text: str) -> None:
        tok = _Tokens(text, InvalidRequirement)
        tok.take("WS")
        self.name = tok.expect("IDENT", "a package name at the start")
        tok.take("WS")
        self.extras = set(tok.enclosed("LB", "RB", lambda: self._extras(tok), "extras") if tok.at("LB") else [])
        tok.take("WS")
        self.url = None  # type: str | None
        self.marker = None  # type: Marker | None
        spec = ""
        if tok.take("AT"):
            tok.take("WS")
            self.url = tok.expect("URL", "a URL after @")
            if not tok.at("END"):
                tok.expect("WS", "whitespace after the URL")
                if not tok.at("END"):
                    self._marker(tok)
        else:
            spec = tok.enclosed("LP", "RP", lambda: self._specifiers(tok), "version specifier")
            tok.take("WS")
            if not tok.at("END"):
                self._marker(tok)
        tok.expect("END", "end of the requirement")
        self.text = text.strip()
        self.specifier = SpecifierSet(spec)
        self.key = canonicalize_name(self.name)

    @staticmethod
    def _extras(tok: _Tokens) -> list:
        tok.take("WS")
        out = []
        if tok.at("IDENT"):
            out.append(tok.take("IDENT"))
            while True:
                tok.take("WS")
                if tok.at("IDENT"):
                    tok.fail("expected a comma between extra names")
                if not tok.take("COMMA"):
                    break
                tok.take("WS")
                out.append(tok.expect("IDENT", "an extra name after the comma"))
        tok.take("WS")
        return out

    @staticmethod
    def _specifiers(tok: _Tokens) -> str:
        tok.take("WS")
        out = ""
        while tok.at("SPECIFIER"):
            out += tok.take("SPECIFIER")  # type: ignore[operator]
            if tok.at("PREFIX_TRAIL"):
                tok.fail(".* can only be used with == or !=")
            if tok.at("LOCAL_TRAIL"):
                tok.fail("a local version label can only be used with == or !=")
            tok.take("WS")
            if not tok.take("COMMA"):
                break
            out += ","
            tok.take("WS")
        tok.take("WS")
        return out

    def _marker(self, tok: _Tokens) -> None:
        start = tok.pos
        if not tok.take("SEMI"):
            tok.fail("expected ';' before a marker, or the end")
        parsed = _parse_marker(tok)
        tok.take("WS")
        self.marker = Marker(tok.source[start + 1:tok.pos], parsed)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return "<Requirement(%r)>" % self.text
