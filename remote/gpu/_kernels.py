"""Tiny Triton kernels for the GPU preflight (imports triton: load it lazily)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scaled_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha + y, mask=mask)


def scaled_add(x, y, alpha: float):
    """out = x * alpha + y, computed by the Triton kernel above."""
    import torch

    out = torch.empty_like(x)
    n = x.numel()
    block = 1024
    scaled_add_kernel[(triton.cdiv(n, block),)](x, y, out, alpha, n, BLOCK=block)
    return out
