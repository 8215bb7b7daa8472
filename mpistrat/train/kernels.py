"""Optimizer update rules on NumPy arrays, in place, one cache-sized block at a time."""

from __future__ import annotations

import numpy as np

from mpistrat.config import cache_block_bytes

__all__ = ["BLOCK_BYTES", "sgd"]

# Each rule passes over a block of the weights, the gradient and a scratch block before it moves on, so
# the gradient is read and the weights are read and written once from memory; ``p -= lr * g`` in NumPy
# writes the whole ``lr * g`` out and reads it back (benchmarks/README.md, "optimizer_apply.py").
BLOCK_BYTES = cache_block_bytes()[0]


def sgd(param: np.ndarray, grad: np.ndarray, lr: float) -> None:
    """``param -= lr * grad`` for C-contiguous arrays of one dtype and shape, with the bits of NumPy's
    (the product rounded to the dtype, then subtracted)."""
    p, g = param.reshape(-1), grad.reshape(-1)
    n = p.shape[0]
    step = max(1, BLOCK_BYTES // p.itemsize)
    if n <= step:
        np.subtract(p, np.multiply(g, lr), out=p)
        return
    scratch = np.empty(step, p.dtype)
    multiply, subtract = np.multiply, np.subtract
    for start in range(0, n, step):
        end = start + step
        if end > n:
            end, scratch = n, scratch[: n - start]
        block = p[start:end]
        multiply(g[start:end], lr, out=scratch)
        subtract(block, scratch, out=block)
