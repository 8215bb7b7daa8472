"""The training step's matmuls with the weights at each offset from a cache line: why variables are aligned.

    OMP_NUM_THREADS=1 python benchmarks/aligned_weights.py [--iters 40]

``train_step.py``'s MLP (784 -> 1024 x3 -> 10, float32, 256 examples): forward and backward
(``train_step.gradients``) with the same weights copied to ``OFFSETS`` bytes past a 64-byte boundary
and as ``np.array`` places them, the placements in a new random order every iteration. Prints per
placement the median time and the median over iterations of (time at 16 bytes, where NumPy's 16-byte
alignment puts large arrays) / (its time): above 1, faster than NumPy's placement. Variables store their
arrays on a boundary (``mpistrat.aligned``), as TensorFlow's CPU allocator does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import train_step as ts

OFFSETS = (0, 16, 32, 48)  # bytes past a 64-byte boundary
BASELINE = 16  # NumPy's alignment: where its allocations of large arrays start (glibc's mmap chunks)


def placed(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``array`` whose first byte is ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(array.nbytes + 128, np.uint8)
    start = -raw.__array_interface__["data"][0] % 64 + offset
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()
    weights = [np.array(v.value()) for v in ts.MLP(ts.LAYER_SIZES, seed=ts.SEED, dtype="float32").variables]
    batches = ts.synthetic_batches(0, 4, ts.BATCH_PER_RANK)
    sets = {f"{o} B": [placed(w, o) for w in weights] for o in OFFSETS}
    sets["np.array"] = [np.array(w) for w in weights]
    names = list(sets)
    for name in names:  # warm-up
        ts.gradients(sets[name], *batches[0])
    times: dict[str, list[float]] = {name: [] for name in names}
    rng = np.random.default_rng(0)
    for i in range(args.iters):
        for j in rng.permutation(len(names)):
            name = names[j]
            t0 = time.perf_counter()
            ts.gradients(sets[name], *batches[i % len(batches)])
            times[name].append(time.perf_counter() - t0)
    base = times[f"{BASELINE} B"]
    where = {name: sorted({w.__array_interface__["data"][0] % 64 for w in ws}) for name, ws in sets.items()}
    print(f"# aligned_weights: MLP {'-'.join(map(str, ts.LAYER_SIZES))} float32, {ts.BATCH_PER_RANK} examples, "
          f"{args.iters} iterations; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; NumPy {np.__version__}")
    print(f"{'weights at':>12} {'ms':>8} {'16 B / this':>12}  offsets mod 64")
    for name in names:
        pair = statistics.median(b / t for b, t in zip(base, times[name]))
        print(f"{name:>12} {statistics.median(times[name]) * 1e3:8.2f} {pair:12.3f}  {where[name]}")


if __name__ == "__main__":
    main()
