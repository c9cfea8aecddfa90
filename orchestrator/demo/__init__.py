"""dfo demo's pieces: its data and model (data), its job and trainer (job/).
"""
