"""Gitignore-style glob patterns as regular expressions (python3 3.8+, stdlib): the one translation that
sync-code's excludes (orchestrator/steps/codetree.py) and outputs' include (remote/ship/scan.py) share."""
import re


def glob_regex(pat):
    """A regular expression (for re.fullmatch) of one gitignore-style pattern: ``*`` and ``?`` stay
    inside a folder, ``**`` crosses folders, ``[..]`` (``[!..]`` negated), ``\\`` escapes."""
    out, i = [], 0
    while i < len(pat):
        c = pat[i]
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pat.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pat.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pat[i + 1:j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
                i = j
        elif c == "\\" and i + 1 < len(pat):
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def compile_rules(patterns):
    """[(compiled regex, negated, folders only)] of gitignore-style lines: blank lines and ``#`` comments
    skipped; ``!`` negates; a trailing ``/`` means folders only; a ``/`` at the start or inside anchors
    the pattern at the root, else it matches a name at any depth."""
    rules = []
    for raw in patterns:
        p = str(raw).strip()
        if not p or p.startswith("#"):
            continue
        neg = p.startswith("!")
        p = p[1:] if neg else p
        dir_only = p.endswith("/")
        p = p.rstrip("/")
        anchored = "/" in p
        rx = glob_regex(p.lstrip("/"))
        rules.append((re.compile(rx if anchored else "(?:.*/)?" + rx, re.S), neg, dir_only))
    return rules
