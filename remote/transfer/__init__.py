"""``python3 -m remote.transfer.sync`` (sync-data) and ``remote.transfer.stage`` (stage-model).
"""
