"""``python3 -m remote.gang``: see remote.gang.ops."""
from remote._proto import serve
from remote.gang.ops import OPS

serve(OPS)
