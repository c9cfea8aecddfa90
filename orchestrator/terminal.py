"""Text from a node, made inert before it reaches this terminal (steps and commands both print it)."""

from __future__ import annotations

import re

# C0 controls (ESC, BEL, CR, ...), DEL, C1 controls (CSI 0x9b, OSC 0x9d, ...) and the bidirectional
# overrides that reorder what a terminal shows
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _visible(m: re.Match[str]) -> str:
    c = m.group(0)
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def clean(text: object) -> str:
    """Text from the node made inert for a terminal: every control character becomes a visible
    escape (ESC -> \\x1b, BEL -> \\x07, CR -> \\r, TAB -> \\t, U+202E -> \\u202e), so a screen clear,
    an OSC 8 link, a title setter, a carriage return or a bell shows as text and does nothing.
    Nothing is dropped: what the node sent stays readable (``--json`` keeps the true value)."""
    return _CONTROL.sub(_visible, "" if text is None else str(text))
