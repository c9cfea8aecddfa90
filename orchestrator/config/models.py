"""Pydantic models of inventory.yaml and job files (extra fields forbidden).

The inventory's schema lives in inventory_schema.py, its plain objects in hosttypes.py and its loader in
inventory.py (a later command rebuilds it from a record without loading pydantic); all re-exported here."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from remote.lib.redact import is_secret

from ..errors import ConfigError
from ..nodepath import canonical
from . import rules as jobrules
from .health import RunHealth
from .hosttypes import (  # noqa: F401 - the plain inventory and host, re-exported
    DEFAULT_KNOWN_HOSTS,
    HostDefaults,
    HostEntry,
    Inventory,
    ResolvedHost,
    TransportName,
)
from .inventory import expand_targets, load_inventory  # noqa: F401 - re-exported
from .inventory_schema import (  # noqa: F401 - the inventory's schema, re-exported
    NAME,
    HostDefaultsSchema,
    HostEntrySchema,
    InventorySchema,
    Strict,
    validate_inventory,
)
from .yamlpos import load_model

# --------------------------------------------------------------------------- job files


# the rules of single fields (orchestrator.config.rules): a broken one is FILE:LINE: field: message, exit 2
PackageSpec = Annotated[str, AfterValidator(jobrules.package_spec)]
IndexLocation = Annotated[str, AfterValidator(jobrules.index_location)]
NodePath = Annotated[str, AfterValidator(jobrules.node_path)]


class IndexConfig(Strict):
    url: IndexLocation | None = None
    extra_urls: list[IndexLocation] = []
    find_links: list[IndexLocation] = []
    no_index: bool = False


class Override(Strict):
    package: Annotated[str, AfterValidator(jobrules.override_spec)]
    reason: str = Field(min_length=3)

    @property
    def name(self) -> str:
        return re.split(r"[<>=!~\[; ]", self.package, maxsplit=1)[0].strip()


class S3Config(Strict):
    endpoint_url: str | None = None
    region: str = "us-east-1"
    profile: str | None = None
    credentials: Literal["controller", "node", "anonymous"] = "controller"  # anonymous: unsigned (public bucket)
    concurrency: int = Field(default=32, ge=1, le=512)
    part_size_mb: int = Field(default=16, ge=5, le=5120)
    multipart_threshold_mb: int = Field(default=64, ge=5)


class ModelConfig(Strict):
    source: Annotated[str, AfterValidator(lambda v: jobrules.transfer_source(v, "model"))]
    dest: NodePath
    margin_pct: float = Field(default=5.0, ge=0)


class DataConfig(Strict):
    source: Annotated[str, AfterValidator(lambda v: jobrules.transfer_source(v, "data"))]
    dest: NodePath
    delete: bool = False


class CodeConfig(Strict):
    """code: a local folder pushed to the node before every launch (dfo sync-code; docs/code.md)."""

    source: str = "."  # relative to the job file; in a git work tree: what git would commit
    dest: NodePath | None = None  # on the node; default run.workdir
    exclude: list[str] = []  # more gitignore-style patterns


class OutputsConfig(Strict):
    """outputs: what the run writes that must outlive the node (docs/outputs.md). {name} and
    {run_id} are expanded in path and dest; an object's key is dest + the path relative to path."""

    path: Annotated[str, AfterValidator(jobrules.outputs_path)] = "/workspace/checkpoints/{name}"
    # s3://bucket/prefix/; none: nothing ships
    dest: Annotated[str | None, AfterValidator(jobrules.outputs_dest)] = None
    every: float = Field(default=300.0, gt=0)  # seconds between passes; one last pass after the run ends
    settle: float = Field(default=10.0, ge=0)  # a file ships once unchanged this long
    include: list[str] = ["**"]  # gitignore-style patterns
    restore: bool = True  # before launch, fetch dest into path when path is empty or missing
    cpu: float = Field(default=2.0, gt=0)  # the shipper's CPU budget, in cores


class RestartsConfig(Strict):
    """run.restarts: when the watcher (dfo watch, up --watch) relaunches a run (docs/recovery.md)."""

    max: int = Field(default=3, ge=0, le=1000)  # per run; then the run fails for good
    # lost: a node gone (unreachable for lost_after s, or its gang watch says so); signal: the trainer killed
    # by a signal (OOM killer, NCCL abort); an exit code (e.g. 134) restarts on that code too
    on: list[str | int] = ["lost", "signal"]
    backoff: float = Field(default=30.0, ge=0)  # seconds before a restart, doubled each time
    lost_after: float = Field(default=60.0, gt=0)  # seconds a node may be unreachable before it counts as lost

    @field_validator("on")
    @classmethod
    def _codes(cls, v: list[str | int]) -> list[str | int]:
        for item in v:
            if item == 0:
                raise ValueError("exit code 0 is a success, never a reason to restart")
            if isinstance(item, bool) or (isinstance(item, str) and item not in ("lost", "signal")) or (
                    isinstance(item, int) and not 1 <= item <= 255):
                raise ValueError(f"{item!r}: each entry is 'lost', 'signal' or an exit code from 1 to 255")
        return v


class RunConfig(Strict):
    workdir: NodePath = "~"  # the node user's home (/root for root)
    upload: list[str] = []
    command: Annotated[str, AfterValidator(lambda v: jobrules.command_placeholders(v, {}))]
    env: dict[str, str] = {}

    @field_validator("upload")
    @classmethod
    def _one_name_each(cls, v: list[str]) -> list[str]:
        """Each file lands in run.workdir under its own name: no two entries may share one."""
        seen: dict[str, str] = {}
        for rel in v:
            name = Path(rel).name
            if name in seen:
                raise jobrules.fail(f"{rel!r} and {seen[name]!r} would both land as {name} in run.workdir: "
                                    "rename one of them")
            seen[name] = rel
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars(cls, v: object) -> object:
        """`OMP_NUM_THREADS: 8` means the string "8" (YAML reads it as a number)."""
        if isinstance(v, dict):
            return {k: (str(x).lower() if isinstance(x, bool) else str(x)) if isinstance(x, int | float) else x
                    for k, x in v.items()}
        return v
    secret_env: list[str] = []
    wait: float = Field(default=60.0, ge=0)
    autotune_guard: bool = False
    health: RunHealth = None  # the GPU health gate before a launch (config/health.py); off by default
    stop_grace: float = Field(default=30.0, ge=0)
    nodes: int = Field(default=1, ge=1, le=1024)  # a gang over this many hosts; -H names exactly that many
    launcher: Literal["none", "torchrun"] = "none"  # torchrun: run.command is what torchrun runs
    nproc_per_node: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"  # auto: the node's GPU count (1 without)
    rdzv_port: int = Field(default=29400, ge=1, le=65535)
    metrics_every: float = Field(default=10.0, ge=0)  # seconds between the sampler's rows; 0: no sampler
    log_metrics: dict[str, str] = {}  # name -> regex with one group, matched on each log line (docs/metrics.md)
    idle_util_pct: float = Field(default=5.0, ge=0, le=100)
    idle_minutes: float | None = Field(default=None, gt=0)  # every GPU under idle_util_pct this long: idle
    idle_action: Literal["alert", "stop"] = "alert"
    gpus: int | None = Field(default=None, ge=0)  # dfo submit: GPUs one run needs; None: all of the node's

    @field_validator("log_metrics")
    @classmethod
    def _one_group(cls, v: dict[str, str]) -> dict[str, str]:
        for name, pat in v.items():
            if not NAME.match(name):
                raise jobrules.fail(f"{name!r}: a metric's name is letters, digits, '.', '_' or '-'")
            try:
                groups = re.compile(pat).groups
            except re.error as exc:
                raise jobrules.fail(f"{name}: {pat!r} is not a regular expression: {exc}") from None
            if groups != 1:
                raise jobrules.fail(f"{name}: {pat!r} has {groups} groups; it needs exactly one, around the number")
        return v

    # recovery (issue 20): hosts (or group names) that may replace a lost node; restarts: when
    spares: list[str] = []
    restarts: RestartsConfig | None = None

    @field_validator("spares", mode="before")
    @classmethod
    def _spares_list(cls, v: object) -> object:
        """`spares: gpu-pool` (one group or host name) means [gpu-pool]."""
        return [v] if isinstance(v, str) else v

    @field_validator("spares")
    @classmethod
    def _spare_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not NAME.match(name):
                raise ValueError(f"spare {name!r} must be a host or group name of the inventory")
        if len(set(v)) != len(v):
            raise ValueError("a spare is named twice")
        return v

    @property
    def recovers(self) -> bool:
        """The job asks for recovery: spares or restarts given."""
        return bool(self.spares) or self.restarts is not None

    @property
    def restart_policy(self) -> RestartsConfig:
        return self.restarts or RestartsConfig()


class NotifyConfig(Strict):
    """notify: where the node's supervisor posts alerts (docs/metrics.md). ``webhook`` is a secret: write
    ``$NAME`` (or ``${NAME}``) and it is read from this shell's environment when the run is launched."""

    webhook: str
    on: list[Literal["failed", "lost", "restarted", "succeeded", "stopped", "idle"]] = [
        "failed", "lost", "restarted", "succeeded", "idle"]


class Job(Strict):
    name: str
    python: Annotated[str, AfterValidator(canonical)] = "python3"
    venv: NodePath = "~/venv"  # ~: the node user's home (/root/venv for root)
    installer: Literal["uv", "pip"] = "pip"
    packages: list[PackageSpec] = []
    index: IndexConfig = Field(default_factory=IndexConfig)
    overrides: list[Override] = []
    workspace: NodePath | None = None  # None: the host's (inventory), else the node's default
    s3: S3Config = Field(default_factory=S3Config)
    model: ModelConfig | None = None
    data: DataConfig | None = None
    code: CodeConfig | None = None
    outputs: OutputsConfig | None = None
    run: RunConfig | None = None
    notify: NotifyConfig | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError("must be letters, digits, '.', '_' or '-'")
        return v

    @field_validator("run")
    @classmethod
    def _run_sections(cls, v: RunConfig | None, info: ValidationInfo) -> RunConfig | None:
        """run.command's {model.dest} / {data.dest} need their section (model: and data: are read first)."""
        if v is not None:
            present: dict[str, bool] = {k: info.data[k] is not None for k in ("model", "data") if k in info.data}
            try:
                jobrules.command_placeholders(v.command, present)
            except PydanticCustomError as exc:
                raise jobrules.fail(f"run.command {exc.message()}") from None
            if v.recovers and not (info.data.get("outputs") and info.data["outputs"].dest):
                raise jobrules.fail("run.spares/run.restarts need outputs.dest: a restart resumes from the last "
                                    "checkpoint shipped there (add outputs: {dest: s3://BUCKET/PREFIX/})")
            if v.recovers and "{run_id}" in info.data["outputs"].dest:
                raise jobrules.fail("run.spares/run.restarts: outputs.dest holds {run_id}, so a restarted run "
                                    "would not find what the lost one shipped: take {run_id} out of outputs.dest")
        return v

    @property
    def venv_python(self) -> str:
        return f"{self.venv.rstrip('/')}/bin/python"


class LoadedJob(BaseModel):
    model_config = ConfigDict(defer_build=True)

    job: Job
    path: Path

    def need(self, section: str) -> object:
        value = getattr(self.job, section)
        if value is None:
            raise ConfigError(f"{self.path}: this command needs a '{section}:' section",
                              hint="see docs/configuration.md, Job files")
        return value


def load_job(path: str | os.PathLike[str]) -> LoadedJob:
    p = Path(path)
    if not p.exists() and not p.suffix and (Path("jobs") / f"{p}.yaml").exists():
        p = Path("jobs") / f"{p}.yaml"
    job = load_model(p, Job, display=str(p))
    return LoadedJob(job=job, path=p.resolve())


def is_secret_env(name: str, job: Job | None = None, value: str | None = None) -> bool:
    """A secret variable: listed in the job's run.secret_env, named like one (whole words, see
    remote.lib.redact: HF_TOKEN yes, TOKENIZERS_PARALLELISM no), or holding a URL with credentials
    (``postgres://u:pass@db/x``). A false positive only keeps a value off the node's disk; a false
    negative writes a secret there."""
    if job is not None and job.run is not None and name in job.run.secret_env:
        return True
    return is_secret(name, value)
