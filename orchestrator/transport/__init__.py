"""How a node is reached: the Transport interface (base), OpenSSH/paramiko (ssh), this machine (local),
host keys and liveness.
"""
