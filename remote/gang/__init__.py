"""``python3 -m remote.gang``: a run over several nodes (remote/gang/ops.py) and its watch.
"""
