"""``python3 -m remote.runs``: launch, status, tail, stop (remote/runs/ops.py), the run's supervisor
and its record.
"""


def entry():
    """The package's run: ``python3 -m remote.runs`` (its __main__.py), or the controller's ``-c`` launch
    (agent.module_command). Imports the ops only here: the supervisor imports this package too."""
    from remote._proto import serve
    from remote.runs.ops import OPS

    serve(OPS)
