"""GPU-side helpers run on the node: preflight, sequential warmup, Triton autotuner guard.

Importing this package imports nothing heavy; each module imports torch/triton/fla lazily.
"""
