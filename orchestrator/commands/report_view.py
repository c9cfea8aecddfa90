"""How a report of moved files is printed (sync-data, stage-model, sync-code): one place."""

from __future__ import annotations

from remote.lib.fsutil import human_bytes

from ..cli_common import console, safe
from ..steps.report import MoveReport


def files(n: int) -> str:
    """``1 file``, ``2 files``."""
    return f"{n} file{'s' if n != 1 else ''}"


def print_moved(host: str, command: str, r: MoveReport, *, verb: str = "fetched", detail: str = "") -> None:
    """The head of a report: "no change" with what matches, or "done" with the counts; ``detail``
    ends the counts line (a rate, what was verified). The caller holds its output lock."""
    if r.status == "no change":
        console.print(f"{safe(host)}: {command}: [dim]no change[/]: {files(r.files_total)} "
                      f"({human_bytes(r.bytes_total)}) in {safe(r.dest)} match {safe(r.source)} "
                      f"({r.seconds:.2f}s)", soft_wrap=True)
        return
    console.print(f"{safe(host)}: {command}: [green]done[/]: {safe(r.source)} -> {safe(r.dest)}", soft_wrap=True)
    console.print(f"  {verb} {files(r.fetched)} ({human_bytes(r.bytes)}), skipped {r.skipped}, "
                  f"deleted {r.deleted}, in {r.seconds:.1f}s{detail}", soft_wrap=True)


def print_names(n: int, names: list[str], says: str) -> None:
    """``  N file(s) <says>: a, b and K more`` (``says`` may use {them} for them/it)."""
    if n:
        more = f" and {n - len(names)} more" if n > len(names) else ""
        console.print(f"  {n} file{'s' if n != 1 else ''} {says.format(them='them' if n != 1 else 'it')}: "
                      f"{safe(', '.join(names))}{more}", soft_wrap=True)
