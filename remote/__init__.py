"""Code that runs ON the node, as ``python3 -m remote.<name>``.

Every module here runs on python3 3.8+ with the standard library only, except the ones that
exist to drive torch/triton (remote/gpu/). Each one reads its request (JSON) from stdin and
answers with one framed JSON document (see remote/_proto.py).
"""

PROTOCOL_VERSION = 1
