"""``python3 -m remote.runs``: see remote.runs.ops."""
from remote._proto import serve
from remote.runs.ops import OPS

serve(OPS)
