"""``python3 -m remote.gang``: see remote.gang.ops."""
from remote._proto import main
from remote.gang.ops import gang

main(gang)
