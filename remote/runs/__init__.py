"""``python3 -m remote.runs``: launch, status, tail, stop (remote/runs/ops.py), the run's supervisor
and its record.
"""
