"""The reproducible sum of ``CommunicationOptions(deterministic=True)``: the same bits for any layout of replicas."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from mpistrat import devices as dev

__all__ = ["MAX_REPLICAS", "headroom_bits", "replicas_error", "reproducible_sum"]

# The scheme (docs/internals.md, "Deterministic all-reduce"), element by element:
#   1. E = the largest binary exponent of the element over all replicas, an upper bound (|x| < 2**E) read from
#      the exponent field b of each value (E = b - bias + 1: frexp's exponent for normal values, the smallest
#      normal exponent for zeros and subnormals): an all-reduce MAX of the int16 fields, exact in any order.
#   2. Each replica's value, in float64, is scaled by 2**(K - E) and rounded to the nearest integer (half to
#      even): an int64 with |r| <= 2**K, K = bits(n, dtype). Rounding one value depends on that value and E
#      alone, never on the order or on which replicas share a rank.
#   3. The integers are summed (locally, then an all-reduce SUM of int64): exact, so associative; n terms of
#      at most 2**K stay below 2**62.
#   4. The sum goes to float64 (round to nearest), times 2**(E - K), then to the input dtype.
# An element whose values are not all finite (b all ones on some replica) sums counts instead (NaN, +Inf, -Inf
# in separate bit fields): NaN if any NaN or both infinities, else the infinity, as the plain sum in any order.
MAX_REPLICAS = 1 << 20  # the non-finite counts' fields are 21 bits wide
CHUNK = 1 << 15  # elements per piece of a host array's passes (256 KiB of float64 temporaries)
_FIELD = 21
_NAN, _POS_INF, _NEG_INF = 1 << (2 * _FIELD), 1 << _FIELD, 1
_MASK = (1 << _FIELD) - 1
# float16/32 values scaled to |y| < 2**50 round by one addition: y + 1.5 * 2**52 has an ulp of 1.
_MAGIC = 1.5 * 2.0**52
_MAGIC_BITS = int(np.array(_MAGIC).view(np.int64))
# dtype -> (unsigned view, mantissa bits, exponent field mask, bias - 1): E = b - (bias - 1)
_FORMATS = {np.dtype(np.float16): (np.uint16, 10, 0x1F, 14), np.dtype(np.float32): (np.uint32, 23, 0xFF, 126),
            np.dtype(np.float64): (np.uint64, 52, 0x7FF, 1022)}

AllReduce = Callable[[list, str, str], list]  # (arrays, "max" or "sum", phase) -> reduced arrays


def headroom_bits(n: int, dtype: Any = np.float64) -> int:
    """K: the bits of each scaled value, so that ``n`` of them sum below 2**62 (62 - ceil(log2 n)); at most 50
    for float16 and float32 (twice their 24-bit significand and more: one addition rounds them)."""
    if not 1 <= n <= MAX_REPLICAS:
        raise ValueError(f"deterministic all-reduce: {n} replicas; at most {MAX_REPLICAS} are supported")
    k = 62 - (n - 1).bit_length()
    return k if np.dtype(dtype) == np.float64 else min(k, 50)


def _real_flat(x: Any, xp: Any) -> Any:
    """``x`` as a 1-D array of reals: a complex array's real and imaginary parts interleaved."""
    flat = xp.ascontiguousarray(x).reshape(-1)
    return flat.view(flat.real.dtype) if flat.dtype.kind == "c" else flat


def _codes(x: Any) -> Any:
    """Each element's exponent field b as int16 (all ones: NaN or Inf)."""
    view, mantissa, mask, _ = _FORMATS[x.dtype]
    return ((x.view(view) >> mantissa) & mask).astype(np.int16)


def _scales(codes: Any, dtype: np.dtype, k: int, xp: Any) -> Any:
    """2**(K - E) per element from the agreed fields, as float64 built from its bits (an exact power of two;
    a table lookup measured 6 times slower); for float64 inputs K - E as int32, for ldexp (2**(K - E) may
    overflow there)."""
    shift = k + _FORMATS[dtype][3]  # K - E = shift - b
    if dtype == np.float64:
        return xp.subtract(shift, codes, dtype=np.int32)
    bits = xp.subtract(shift + 1023, codes, dtype=np.int64)
    bits <<= 52
    return bits.view(np.float64)


def _step(xp: Any, size: int) -> int:
    """Elements per piece of an array's passes: CHUNK for host arrays, whose temporaries then stay in cache
    (benchmarks/README.md, "Deterministic all-reduce"); a device array in one piece."""
    return CHUNK if xp is np else max(size, 1)


def _fields(xs: list, xp: Any) -> Any:
    """The largest exponent field over the local replicas ``xs`` (real 1-D arrays), per element."""
    out = xp.empty(xs[0].size, np.int16)
    step = _step(xp, out.size)
    for start in range(0, out.size, step):
        part = slice(start, start + step)
        out[part] = _codes(xs[0][part])
        for x in xs[1:]:
            xp.maximum(out[part], _codes(x[part]), out=out[part])
    return out


def _encode(xs: list, codes: Any, k: int, nonfinite: Any, xp: Any) -> Any:
    """The local replicas' values on the agreed grid, summed: int64 per element."""
    dtype = xs[0].dtype
    out = xp.empty(codes.size, np.int64)
    step = _step(xp, out.size)
    for start in range(0, out.size, step):
        part = slice(start, start + step)
        scale = _scales(codes[part], dtype, k, xp)
        mask = None if nonfinite is None else nonfinite[part]
        out[part] = _fixed(xs[0][part], scale, mask, xp)
        for x in xs[1:]:
            out[part] += _fixed(x[part], scale, mask, xp)
    return out


def _decode(total: Any, codes: Any, k: int, dtype: np.dtype, nonfinite: Any, xp: Any) -> Any:
    """The summed int64 back to floats of ``dtype`` (a real dtype), per element."""
    out = xp.empty(total.size, dtype)
    step = _step(xp, out.size)
    with np.errstate(over="ignore"):  # a sum beyond the dtype's range is +-Inf, as the plain sum's
        for start in range(0, out.size, step):
            part = slice(start, start + step)
            mask = None if nonfinite is None else nonfinite[part]
            out[part] = _float(total[part], _scales(codes[part], dtype, k, xp), dtype, mask, xp)
    return out


def _nonfinite(codes: Any, dtype: np.dtype) -> Any:
    return codes == _FORMATS[dtype][2]


def _counts(x: Any, xp: Any) -> Any:
    """NaN, +Inf and -Inf as their count fields, finite values as 0."""
    return xp.where(xp.isnan(x), _NAN, xp.where(x == np.inf, _POS_INF, xp.where(x == -np.inf, _NEG_INF, 0)))


def _fixed(x: Any, scale: Any, nonfinite: Any, xp: Any) -> Any:
    """One replica's values as int64 on the agreed grid: times ``scale`` (2**(K - E), exact), rounded
    (non-finite elements as counts; ``nonfinite`` None when there is none)."""
    if nonfinite is not None:
        counts = _counts(x, xp)
        x = xp.where(nonfinite, 0, x)
    if x.dtype == np.float64:
        fixed = xp.rint(xp.ldexp(x, scale)).astype(np.int64)
    else:
        y = xp.multiply(x, scale, dtype=np.float64)
        y += _MAGIC
        fixed = y.view(np.int64)
        fixed -= _MAGIC_BITS
    if nonfinite is not None:
        fixed = xp.where(nonfinite, counts, fixed)
    return fixed


def _float(total: Any, scale: Any, dtype: np.dtype, nonfinite: Any, xp: Any) -> Any:
    """The int64 sums back to floats of ``dtype`` (the real dtype of a complex result): to float64, divided
    by ``scale`` (2**(K - E): exact)."""
    if dtype == np.float64:
        out = xp.ldexp(total.astype(np.float64), -scale)
    else:  # in float64 (an exact division), then rounded to the dtype on the way out
        out = xp.divide(total, scale, out=xp.empty(total.shape, dtype), casting="unsafe")
    if nonfinite is not None:
        positive = ((total >> _FIELD) & _MASK) > 0
        nan = (total >= _NAN) | (positive & ((total & _MASK) > 0))
        special = xp.where(nan, np.nan, xp.where(positive, np.inf, -np.inf))
        out = xp.where(nonfinite, special, out)
    return out.astype(dtype, copy=False)


def replicas_error(per_replica: Sequence[Sequence[Any]]) -> Exception | None:
    """Why the local replicas' leaves cannot be summed together (counts, shapes or dtypes differ, a float
    type other than float16/32/64 and their complex types), or None."""
    first = per_replica[0]
    for j, leaf in enumerate(first):
        kind = leaf.dtype.kind
        if kind in "fc" and (leaf.dtype if kind == "f" else np.empty(0, leaf.dtype).real.dtype) not in _FORMATS:
            return TypeError(f"deterministic all-reduce: value #{j} has dtype {leaf.dtype}; float16, float32, "
                             "float64 and their complex types are supported")
    for i, leaves in enumerate(per_replica[1:], 1):
        if len(leaves) != len(first):
            return ValueError(f"local replica 0 passes {len(first)} values, local replica {i} {len(leaves)}")
        for j, (a, b) in enumerate(zip(first, leaves)):
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                return ValueError(f"value #{j}: local replica 0 holds {a.dtype}{list(a.shape)}, local replica {i} "
                                  f"{b.dtype}{list(b.shape)}; every replica must pass one shape and dtype")
    return None


def reproducible_sum(per_replica: Sequence[Sequence[Any]], n: int, allreduce: AllReduce | None = None) -> list:
    """The sum of each leaf over ``n`` replicas, the same bits however they are spread over ranks.

    ``per_replica[i][j]`` is leaf j of this rank's local replica i (NumPy or CuPy arrays, one device, every
    replica one shape and dtype per leaf); ``n`` the replicas of every rank together; ``allreduce`` the
    cross-rank all-reduce of a list of int arrays, which it may reduce in place (they are this function's
    own; None: this rank holds every replica). Float and complex
    leaves go through the fixed-point scheme above, integer leaves are summed as they are (two's complement
    addition is associative, wrapping included). Every leaf comes back as a new array of its shape and dtype.
    """
    headroom_bits(n)  # n in range
    error = replicas_error(per_replica)
    if error is not None:
        raise error
    first = per_replica[0]
    shapes = [tuple(leaf.shape) for leaf in first]
    floats = [j for j, leaf in enumerate(first) if leaf.dtype.kind in "fc"]
    xps = {j: dev.array_module(dev.device_of(first[j])) for j in floats}
    reals = {j: [_real_flat(leaves[j], xps[j]) for leaves in per_replica] for j in floats}
    codes = {j: _fields(reals[j], xps[j]) for j in floats}
    if floats and allreduce is not None:
        codes = dict(zip(floats, allreduce([codes[j] for j in floats], "max", "exponents")))
    grid = {}
    for j in floats:
        dtype = reals[j][0].dtype
        nonfinite = _nonfinite(codes[j], dtype)
        grid[j] = (headroom_bits(n, dtype), nonfinite if bool(nonfinite.any()) else None)
    ints = []
    for j, leaf in enumerate(first):
        if j in grid:
            acc = _encode(reals[j], codes[j], *grid[j], xps[j])
        else:
            acc = leaf.copy()
            for leaves in per_replica[1:]:
                acc += leaves[j]
        ints.append(acc)
    if allreduce is not None:
        ints = allreduce(ints, "sum", "sum")
    out = []
    for j, (leaf, total) in enumerate(zip(first, ints)):
        if j in grid:
            real = _decode(total, codes[j], grid[j][0], reals[j][0].dtype, grid[j][1], xps[j])
            total = (real.view(leaf.dtype) if leaf.dtype.kind == "c" else real).reshape(shapes[j])
        out.append(total)
    return out
