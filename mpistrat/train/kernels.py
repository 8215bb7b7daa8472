"""Optimizer update rules on NumPy arrays, in place, in one pass over each array."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from mpistrat.config import update_block_bytes

try:  # the rules compiled (built by pip install where a C compiler is): one pass, no scratch
    from mpistrat.train import _update
except ImportError:
    _update = None

__all__ = ["BLOCK_BYTES", "adam", "applies", "momentum", "nesterov", "sgd", "worth"]

# Every rule reads and writes each array once per step; NumPy's whole-array expressions write every
# temporary out and read it back. The compiled rules (float32 and float64) go element by element; the
# NumPy ones pass over one block of each array (and scratch blocks) before the next.
BLOCK_BYTES = update_block_bytes()[0]

_add, _subtract, _multiply, _divide, _sqrt = np.add, np.subtract, np.multiply, np.divide, np.sqrt
# NumPy 1 promotes a Python float by its value (NEP 50 made it weak in NumPy 2).
_VALUE_BASED = np.lib.NumpyVersion(np.__version__) < "2.0.0"
# NumPy's error modes the compiled rules report as NumPy would; under the others (raise, call, log) the
# NumPy rules run, so that an error is handled where NumPy handles it.
_REPORTED = frozenset({"ignore", "warn", "print"})
_ERRORS = ((1, "divide", "divide by zero"), (2, "over", "overflow"), (4, "under", "underflow"),
           (8, "invalid", "invalid value"))  # NumPy's numbers (NPY_FPE_*), np.geterr's keys, its words


def worth(grad: object) -> bool:
    """Whether blocking could pay for ``grad``'s update: a NumPy array longer than one block (a shorter
    rule's temporaries stay in cache, and the NumPy expressions cost less Python)."""
    return type(grad) is np.ndarray and grad.nbytes > BLOCK_BYTES


def applies(arrays: Sequence[np.ndarray], grad: object, coefficients: Sequence[object]) -> bool:
    """Whether the rules below give the bits of the same rule written with NumPy expressions and
    ``assign``: ``grad`` a floating NumPy array of at least one dimension (NumPy 1's promotion makes a 0-d
    product float64) and, with every array, C-contiguous, of one dtype and shape; every coefficient a
    Python ``float`` that NumPy casts to the arrays' dtype (a NumPy scalar may widen the arithmetic, and
    so may, on NumPy 1, a float beyond the dtype's range)."""
    if (type(grad) is not np.ndarray or grad.dtype.kind != "f" or grad.ndim == 0
            or not grad.flags.c_contiguous):
        return False
    dtype, shape = grad.dtype, grad.shape
    for array in arrays:
        if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
            return False
    for c in coefficients:
        if type(c) is not float or (_VALUE_BASED and np.result_type(dtype, c) != dtype):
            return False
    return True


def _blocks(arrays: Sequence[np.ndarray], scratch: int) -> Iterator[list[np.ndarray]]:
    """Per block: that block of each array (flat), then ``scratch`` blocks of their dtype."""
    for array in arrays:
        if not array.flags.c_contiguous:  # reshape would copy, and the rule would write into the copy
            raise ValueError("update kernels need C-contiguous arrays")
    flat = [array.reshape(-1) for array in arrays]
    n, dtype = flat[0].shape[0], flat[0].dtype
    step = max(1, min(n, BLOCK_BYTES // dtype.itemsize))
    tmp = [np.empty(step, dtype) for _ in range(scratch)]
    for start in range(0, n, step):
        end = min(start + step, n)
        size = end - start
        yield [f[start:end] for f in flat] + [t[:size] for t in tmp]


def _compiled(rule: Any, name: str, arrays: tuple, coefficients: tuple, *flags: bool) -> bool:
    """Whether the compiled ``rule(*arrays, *coefficients, *flags)`` ran: its arrays float32 or float64, its
    coefficients Python floats (NumPy rounds those to the arrays' dtype, as the compiled rules do; a NumPy
    scalar may widen NumPy's arithmetic instead); its floating-point errors reported as NumPy reports
    them for an operation called ``name``, after the whole update."""
    if rule is None or any(type(c) is not float for c in coefficients):
        return False
    modes = np.geterr()
    if not _REPORTED.issuperset(modes.values()):
        return False
    raised = rule(*arrays, *coefficients, *flags)
    if raised is NotImplemented:
        return False
    for bit, key, words in _ERRORS:
        if raised & bit and modes[key] != "ignore":
            message = f"{words} encountered in {name}"
            if modes[key] == "warn":
                warnings.warn(message, RuntimeWarning, stacklevel=3)  # at the caller of the rule
            else:  # print: as NumPy prints it
                sys.stderr.write(f"Warning: {message}\n")
    return True


def sgd(param: np.ndarray, grad: np.ndarray, lr: float) -> None:
    """``param -= lr * grad``."""
    if _compiled(_update and _update.sgd, "sgd", (param, grad), (lr,)):
        return
    for p, g, t in _blocks((param, grad), 1):
        _multiply(g, lr, out=t)
        _subtract(p, t, out=p)


def momentum(param: np.ndarray, velocity: np.ndarray, grad: np.ndarray, lr: float, mu: float) -> None:
    """``velocity = mu * velocity - lr * grad``; ``param += velocity``."""
    if not _compiled(_update and _update.momentum, "momentum", (param, velocity, grad), (lr, mu), False):
        _momentum(param, velocity, grad, lr, mu, nesterov=False)


def nesterov(param: np.ndarray, velocity: np.ndarray, grad: np.ndarray, lr: float, mu: float) -> None:
    """``velocity = mu * velocity - lr * grad``; ``param += mu * velocity - lr * grad``."""
    if not _compiled(_update and _update.momentum, "nesterov", (param, velocity, grad), (lr, mu), True):
        _momentum(param, velocity, grad, lr, mu, nesterov=True)


def _momentum(param: np.ndarray, velocity: np.ndarray, grad: np.ndarray, lr: float, mu: float,
              nesterov: bool) -> None:
    for p, v, g, t, u in _blocks((param, velocity, grad), 2):
        _multiply(v, mu, out=t)
        _multiply(g, lr, out=u)
        _subtract(t, u, out=v)
        if nesterov:
            _multiply(v, mu, out=t)
            _subtract(t, u, out=t)
            _add(p, t, out=p)
        else:
            _add(p, v, out=p)


def adam(param: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray, lr: float, beta_1: float,
         beta_2: float, epsilon: float) -> None:
    """``m = beta_1 m + (1 - beta_1) grad``; ``v = beta_2 v + (1 - beta_2) grad^2``;
    ``param -= lr * m / (sqrt(v) + epsilon)``."""
    keep_1, keep_2 = 1 - beta_1, 1 - beta_2
    if _compiled(_update and _update.adam, "adam", (param, m, v, grad), (lr, beta_1, keep_1, beta_2, keep_2, epsilon)):
        return
    for p, mb, vb, g, t, u in _blocks((param, m, v, grad), 2):
        _multiply(mb, beta_1, out=t)
        _multiply(g, keep_1, out=u)
        _add(t, u, out=mb)
        _multiply(g, g, out=t)
        _multiply(t, keep_2, out=t)
        _multiply(vb, beta_2, out=u)
        _add(u, t, out=vb)
        _multiply(mb, lr, out=t)
        _sqrt(vb, out=u)
        _add(u, epsilon, out=u)
        _divide(t, u, out=t)
        _subtract(p, t, out=p)
