"""``python3 -m remote.runs``: launch, status, tail, stop (remote/runs/ops.py), the run's supervisor
and its record; submit, queue, cancel (remote/runs/queue_ops.py, the queue: remote/runs/queue.py).
"""
from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict


def _queue_op(name: str) -> Callable[[Dict[str, Any]], Any]:
    """A queue op, its module imported only when it runs (status and tail import no more than before)."""
    def run(request: Dict[str, Any]) -> Any:
        from remote.runs import queue_ops

        return getattr(queue_ops, name)(request)
    return run


def entry():
    """The package's run: ``python3 -m remote.runs`` (its __main__.py), or the controller's ``-c`` launch
    (agent.module_command). Imports the ops only here: the supervisor imports this package too."""
    from remote._proto import serve
    from remote.runs.ops import OPS as RUN_OPS

    OPS = dict(RUN_OPS)
    for name in ("submit", "queue", "cancel"):  # the queue's (remote/runs/queue_ops.py)
        OPS[name] = _queue_op(name)
    serve(OPS)
