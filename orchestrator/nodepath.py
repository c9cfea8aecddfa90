"""Node paths on the controller: written as the job or inventory gives them, never expanded here.

``~``, ``$HOME`` and ``${HOME}`` at the start of a node path mean the node user's home, which only the
node knows (the laptop's home is not the node's): each remote module expands them where it reads its
request (remote/fsutil.node_path), and a shell command for the node leaves them to the node's sh. The
controller only spells ``$HOME/x`` as ``~/x`` (the same path there), so that a path has one spelling.
"""

from __future__ import annotations

import shlex

HOME_PREFIXES = ("~", "${HOME}", "$HOME")


def canonical(path: str) -> str:
    """``$HOME/x`` and ``${HOME}/x`` spelled ``~/x``; any other path as it is."""
    for pre in HOME_PREFIXES[1:]:
        if path == pre or path.startswith(pre + "/"):
            return "~" + path[len(pre):]
    return path


def in_home(path: str) -> bool:
    """True for a path under the node user's home (``~``, ``~/...``, ``$HOME/...``)."""
    return any(path == pre or path.startswith(pre + "/") for pre in HOME_PREFIXES)


def shell(path: str) -> str:
    """``path`` as one word of an sh command run on the node: quoted, but with a leading ``~`` left for
    the node's sh to expand (``"$HOME"/venv/bin/python``)."""
    p = canonical(path)
    if p == "~":
        return '"$HOME"'
    if p.startswith("~/"):
        return '"$HOME"' + shlex.quote(p[1:])
    return shlex.quote(p)
