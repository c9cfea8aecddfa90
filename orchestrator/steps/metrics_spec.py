"""What launch sends the node's sampler and notifier (the ``metrics`` and ``notify`` fields of the launch
request): run.metrics_every, run.log_metrics, run.idle_*, and notify: with its webhook resolved here (a
secret: it travels in the request on stdin, to the supervisor's memory alone). docs/metrics.md."""

from __future__ import annotations

import os
import re
from typing import Any

from ..config.models import LoadedJob
from ..errors import ConfigError

_ENV_REF = re.compile(r"^\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?$")


def launch_fields(loaded: LoadedJob) -> dict[str, Any]:
    """The launch request's ``metrics`` (the sampler's spec) and ``notify`` (the webhook: stdin only)."""
    job, run = loaded.job, loaded.job.run
    out: dict[str, Any] = {}
    if run is not None:
        out["metrics"] = {"every": run.metrics_every, "log_metrics": run.log_metrics,
                          "idle_util_pct": run.idle_util_pct, "idle_minutes": run.idle_minutes,
                          "idle_action": run.idle_action}
    if job.notify is not None:
        out["notify"] = {"webhook": webhook_url(loaded), "on": list(job.notify.on)}
    return out


def webhook_url(loaded: LoadedJob) -> str:
    """notify.webhook: ``$NAME`` / ``${NAME}`` from this shell's environment, else the URL as written."""
    assert loaded.job.notify is not None
    raw = loaded.job.notify.webhook.strip()
    m = _ENV_REF.match(raw)
    if m:
        value = os.environ.get(m.group(1))
        if not value:
            raise ConfigError(f"{loaded.path}: notify.webhook: {m.group(1)} is not set in this shell's environment",
                              hint=f"export {m.group(1)}=https://hooks.slack.com/... (it reaches the node on stdin "
                                   "only)")
        raw = value
    if not raw.startswith(("http://", "https://")):
        raise ConfigError(f"{loaded.path}: notify.webhook is not an http(s) URL",
                          hint="write notify: {webhook: $SLACK_WEBHOOK} and export SLACK_WEBHOOK")
    return raw


