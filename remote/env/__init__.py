"""The node's Python environment: probe, provision, package checks, known-bad versions.
"""
