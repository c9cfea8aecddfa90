"""``python3 -m remote.runs``: see remote.runs.ops."""
from remote.runs import entry

entry()
