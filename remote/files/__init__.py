"""Files between the laptop and the node: code push, pull, a run's upload files.
"""
