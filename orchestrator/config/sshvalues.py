"""The rules of inventory values that reach ssh: the ssh_config dfo writes, or ssh's argv (issue 32, item 5).

ssh_config is read line by line, and some of dfo's lines carry an inventory value unquoted (``Port``,
``ProxyJump``: ssh takes no quotes there), so a newline in a value would start directives of the value's
own (``ProxyCommand`` runs a command). Every such value is checked where the inventory is read
(orchestrator/config/models.py: exit 2, ``FILE:LINE: field: message``), and again where the config is
written (orchestrator/transport/openssh_setup.py ``bare`` and ``q``), whatever the transport:

* no value holds a control character (newline, carriage return, tab, NUL, DEL, C1);
* names ssh reads as one word (host, user, every ProxyJump hop, private_address) hold no whitespace,
  no quote or backslash, no ``#``, and do not start with ``-`` (an option to ssh); a host also holds no
  pattern character of ssh_config (``*``, ``?``, ``!``, ``,``), since dfo matches it with ``Match``;
* paths (identity, known_hosts, ssh_config) go into ssh_config double-quoted: they may hold blanks, never
  a ``"``.
"""

from __future__ import annotations

import unicodedata

_QUOTES = "\"'`\\"
_PATTERN = "*?!,"


def _fail(message: str) -> Exception:
    """The validation error of a rule broken (pydantic's, imported only here: the transports use the checks
    above without loading pydantic)."""
    from .rules import fail

    return fail(message)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


def _control(value: str, cc: str) -> str:
    return f"{_shown(value)} holds a control character ({cc}): no ssh_config line can carry it"


def control_char(value: str) -> str | None:
    """The first control character of ``value`` (as Python writes it), or None."""
    for ch in value:
        if unicodedata.category(ch) == "Cc":
            return repr(ch)[1:-1]
    return None


def word_problem(value: str, what: str, pattern: bool = False) -> str | None:
    """Why ``value`` cannot be one word of ssh's (a host, a user, a jump hop), or None."""
    cc = control_char(value)
    if cc is not None:
        return _control(value, cc)
    if not value:
        return f"{what} is empty"
    bad = [c for c in value if c.isspace() or c in _QUOTES or c == "#" or (pattern and c in _PATTERN)]
    if bad:
        return f"{_shown(value)} holds {bad[0]!r}, which ssh cannot take in {what}"
    if value.startswith("-"):
        return f"{_shown(value)} starts with '-': ssh would read {what} as an option"
    return None


def path_problem(value: str) -> str | None:
    """Why ``value`` cannot be a double-quoted path in ssh_config, or None."""
    cc = control_char(value)
    if cc is not None:
        return _control(value, cc)
    if '"' in value:
        return f"{_shown(value)} holds '\"': ssh_config has no way to quote it"
    return None


def jump_problem(value: str) -> str | None:
    """Why ``value`` cannot be a ProxyJump (``none``, or ``[user@]host[:port]`` hops separated by commas)."""
    cc = control_char(value)
    if cc is not None:
        return _control(value, cc)
    spec = value.strip()
    if spec.lower() == "none":
        return None
    for hop in spec.split(","):
        why = word_problem(hop, "a ProxyJump hop")
        if why is not None:
            return f"{why} (write [user@]host[:port], hops separated by commas, or none)"
    return None


# --------------------------------------------------------------------------- pydantic validators (models.py)

def ssh_host(value: str) -> str:
    why = word_problem(value, "a host name", pattern=True)
    if why is not None:
        raise _fail(why)
    return value


def ssh_user(value: str) -> str:
    why = word_problem(value, "a user name")
    if why is not None:
        raise _fail(why)
    return value


def ssh_path(value: str) -> str:
    why = path_problem(value)
    if why is not None:
        raise _fail(why)
    return value


def ssh_jump(value: str) -> str:
    why = jump_problem(value)
    if why is not None:
        raise _fail(why)
    return value


def plain_text(value: str) -> str:
    """Text that reaches a node's command line (python, workspace): no control characters."""
    cc = control_char(value)
    if cc is not None:
        raise _fail(f"{_shown(value)} holds a control character ({cc})")
    return value
