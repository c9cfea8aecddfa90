"""The report of anything that moves files (sync-data, stage-model, sync-code, pull): one shape.

Its serialisation (model_dump) is that host's --json document; subclasses add their own fields.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MoveReport(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built when first used, not at import
    host: str = Field(exclude=True)
    ok: bool = True
    status: str  # "done" | "no change"
    fetched: int  # files moved (sent, for sync-code)
    skipped: int  # files already in place
    deleted: int = 0
    bytes: int
    seconds: float
    mb_per_s: float
    dest: str
    source: str
    files_total: int
    bytes_total: int
    kept: int = 0  # gone from the source but changed at the destination since dfo wrote them: left there
    kept_files: list[str] = []  # the first names, sorted
