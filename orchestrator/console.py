"""dfo's rich consoles (imported on first output: rich costs start-up time that `dfo --help` and the
way to a node's first byte need not pay; cli_common.console and err_console stand for these)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, ConsoleDimensions

WIDE = 10_000  # the width of a console that is not a terminal: lines are never wrapped there


class DfoConsole(Console):
    """A rich Console that, when its stream is not a terminal (a pipe, a file), neither wraps lines
    nor pads them: `dfo status | grep RUN` and `dfo launch > out.txt` keep every line whole, without
    trailing spaces. (rich alone would take the width of the terminal on stdin, else 80 columns.)"""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        return dims if self.is_terminal else ConsoleDimensions(WIDE, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def print(self, *objects: Any, **kw: Any) -> None:
        if self.is_terminal:
            super().print(*objects, **kw)
            return
        kw.setdefault("soft_wrap", True)
        with self.capture() as cap:
            super().print(*objects, **kw)
        text = "\n".join(ln.rstrip() for ln in cap.get().split("\n"))
        self.file.write(text)
        self.file.flush()
