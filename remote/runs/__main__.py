"""``python3 -m remote.runs``: see remote.runs.ops."""
from remote._proto import main
from remote.runs.ops import handle

main(handle)
