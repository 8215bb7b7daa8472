"""MirroredStrategy in one process: all-reduce cost and run overhead.

    python benchmarks/mirrored.py [--size-mib 16] [--replicas 4] [--repeats 20]

Prints, in one run: the time of ``ReplicaContext.all_reduce(SUM)`` of a float32
array over N logical CPU replicas inside ``strategy.run``, beside a plain
NumPy sum of the same N arrays (the floor: the data must be read once and
written N times... here the baseline only reads N and writes 1), and the
per-step overhead of ``strategy.run`` for a trivial function, in microseconds
per replica. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mpistrat as ms


def median_time(fn, repeats: int) -> float:
    fn()  # warm up (threads, buffers)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=16.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    n = args.replicas
    count = int(args.size_mib * 2**20) // 4
    strategy = ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    arrays = [np.random.default_rng(i).standard_normal(count).astype(np.float32) for i in range(n)]
    per_replica = ms.PerReplica(arrays)

    def mpistrat_all_reduce():
        return strategy.run(lambda x: ms.get_replica_context().all_reduce("sum", x), args=(per_replica,))

    def numpy_sum():
        out = arrays[0].copy()
        for a in arrays[1:]:
            np.add(out, a, out=out)
        return out

    result = strategy.experimental_local_results(mpistrat_all_reduce())
    expect = numpy_sum()
    assert all(np.array_equal(r, expect) for r in result), "all_reduce result differs from numpy"

    t_ms = median_time(mpistrat_all_reduce, args.repeats)
    t_np = median_time(numpy_sum, args.repeats)
    t_np_bcast = median_time(lambda: [numpy_sum()] + [numpy_sum().copy() for _ in range(n - 1)][:0] or
                             [np.copyto(np.empty_like(expect), expect) for _ in range(n - 1)], args.repeats)

    trivial = median_time(lambda: strategy.run(lambda: None), max(args.repeats, 200))
    one = ms.MirroredStrategy(["/cpu:0"])
    trivial_one = median_time(lambda: one.run(lambda: None), max(args.repeats, 200))

    print(f"MirroredStrategy, {n} logical CPU replicas, float32 {args.size_mib:g} MiB per replica")
    print(f"{'measurement':<52}{'time':>12}{'ratio':>10}")
    print(f"{'numpy sum of the arrays (reference)':<52}{t_np * 1e3:>10.2f}ms{1.0:>10.2f}")
    print(f"{'numpy sum + copies to the other replicas':<52}{t_np_bcast * 1e3:>10.2f}ms{t_np_bcast / t_np:>10.2f}")
    print(f"{'mpistrat all_reduce inside strategy.run':<52}{t_ms * 1e3:>10.2f}ms{t_ms / t_np:>10.2f}")
    print(f"{'run() of a trivial fn, per step':<52}{trivial * 1e6:>10.1f}us")
    print(f"{'run() of a trivial fn, per replica':<52}{trivial / n * 1e6:>10.1f}us")
    print(f"{'run() of a trivial fn, 1 replica (inline)':<52}{trivial_one * 1e6:>10.1f}us")


if __name__ == "__main__":
    main()
