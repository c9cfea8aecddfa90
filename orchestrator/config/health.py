"""run.health: the GPU health gate before a launch (docs/gpu.md, "The health gate").

Off by default. ``health: on`` (or ``true``) turns it on with the defaults; a mapping sets thresholds::

    run:
      health: {min_fraction: 0.8, max_memory_used: 0.05, measure: true, seconds: 60}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from . import rules as jobrules


class HealthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)

    # a measured figure (bf16 matmul, memory copy, host<->device, all-reduce) below this share of what the
    # GPU model achieves (remote/gpu/gpu_models.json) fails the gate
    min_fraction: float = Field(default=0.8, gt=0, le=1, allow_inf_nan=False)
    # GPU memory already in use (not by this job) above this share of the GPU's fails the gate
    max_memory_used: float = Field(default=0.05, ge=0, le=1, allow_inf_nan=False)
    # false: nvidia-smi and the kernel log only (about a second; no torch needed on the node)
    measure: bool = True
    seconds: float = Field(default=60.0, ge=5, le=600, allow_inf_nan=False)  # the gate's bound on the node

    def request(self) -> dict[str, Any]:
        return self.model_dump()


def _on_off(v: object) -> object:
    """``on``/``true`` (YAML 1.1 reads a bare ``on`` as true): the defaults; ``off``/``false``/null: no gate."""
    if v is True or (isinstance(v, str) and v.strip().lower() in ("on", "true", "yes")):
        return {}
    if v is False or v is None or (isinstance(v, str) and v.strip().lower() in ("off", "false", "no")):
        return None
    if not isinstance(v, dict | HealthConfig):
        raise jobrules.fail("on, off, or thresholds such as {min_fraction: 0.8} (fields: min_fraction, "
                            "max_memory_used, measure, seconds)")
    return v


RunHealth = Annotated[HealthConfig | None, BeforeValidator(_on_off)]
