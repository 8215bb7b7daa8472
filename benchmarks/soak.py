"""Soak: many small training steps on several ranks; throughput, memory and weight agreement.

    mpiexec -n 4 python benchmarks/soak.py [--steps 10000] [--check-every 1000]
                                           [--batch 32] [--hidden 64] [--reference-steps 2000]

Every rank trains a small MLP (``mpistrat.examples.mlp``: 64 -> hidden -> 10,
float32) with ``MultiWorkerMirroredStrategy``: each step is one
``strategy.run`` in which the replica computes its gradients on its own
synthetic batch, reduces gradients and example count in ONE fused
``all_reduce``, and updates the mirrored variables with SGD (momentum 0.9)
through the optimizer's ``merge_call``.

Every ``--check-every`` steps (and at step 0) each rank hashes the bytes of
all its weights and optimizer slots (BLAKE2b), the digests and the resident
set sizes (``VmRSS``) are all-gathered with raw mpi4py, and rank 0 prints a
row: steps/s over the interval (the slowest rank's), RSS per rank, and the
ranks whose weights differ from rank 0's (mismatches). The summary gives the
overall steps/s, RSS at the start (step 0, after one warm-up step) and the
end per rank with the growth, and the number of mismatches, which must be 0.

Then, in the same run, ``--reference-steps`` of the same step written with
raw mpi4py (same model code, gradients packed by hand into one buffer,
``Allreduce(IN_PLACE)``, SGD in NumPy) give the reference throughput and the
ratio mpistrat / raw. The exit code is 1 if any mismatch was seen or a weight
is not finite.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

import mpistrat as ms
from mpistrat.examples.mlp import MLP
from mpistrat.optimizers import SGD

FEATURES, CLASSES = 64, 10
LEARNING_RATE, MOMENTUM = 0.05, 0.9
DISTINCT_BATCHES = 64  # per rank, cycled


def rss_mib() -> float:
    """This process's resident set size in MiB (VmRSS; peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_batches(rank: int, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Learnable data: labels from a fixed random linear map, different inputs on every rank."""
    teacher = np.random.default_rng(12345).standard_normal((FEATURES, CLASSES))
    rng = np.random.default_rng(1000 + rank)
    out = []
    for _ in range(DISTINCT_BATCHES):
        x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
        out.append((x, (x @ teacher).argmax(axis=1)))
    return out


def digest(arrays: list[np.ndarray]) -> int:
    """A 63-bit hash of the arrays' bytes (equal weights <=> equal digests, up to collisions)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


class Soak:
    """The mpistrat training step and its periodic checks."""

    def __init__(self, hidden: int, batches: list) -> None:
        self.strategy = ms.MultiWorkerMirroredStrategy()
        with self.strategy.scope():
            self.model = MLP([FEATURES, hidden, CLASSES], seed=0)
            self.optimizer = SGD(LEARNING_RATE, momentum=MOMENTUM)
            self.optimizer.build(self.model.trainable_variables)
        self.batches = batches

    def replica_step(self, x: np.ndarray, y: np.ndarray) -> None:
        _, _, grads = self.model.loss_and_gradients(x, y)
        total = ms.get_replica_context().all_reduce(
            ms.ReduceOp.SUM, {"grads": grads, "count": np.array([x.shape[0]], np.float32)})
        scale = 1.0 / total["count"][0]
        self.optimizer.apply_gradients([(g * scale, v) for g, v in zip(total["grads"], self.model.trainable_variables)],
                                       experimental_aggregate_gradients=False)

    def step(self, i: int) -> None:
        self.strategy.run(self.replica_step, args=self.batches[i % len(self.batches)])

    def state(self) -> list[np.ndarray]:
        """Every local copy of the weights and optimizer slots (all replicas of this rank)."""
        out = []
        for v in self.model.trainable_variables + self.optimizer.variables:
            out.extend(np.asarray(x) for x in self.strategy.experimental_local_results(v))
        return out


class _PlainMLP(MLP):
    """The same model computing from plain writable arrays (variables' values are read-only)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain = [np.array(v.value()) for v in self.variables]

    def _params(self) -> list:
        return self.plain


def reference_steps(hidden: int, batches: list, steps: int, comm: MPI.Comm) -> float:
    """Steps/s of the same training step with raw mpi4py (one packed Allreduce(IN_PLACE), NumPy SGD)."""
    model = _PlainMLP([FEATURES, hidden, CLASSES], seed=0)
    params = model.plain
    velocity = [np.zeros_like(p) for p in params]
    sizes = [p.size for p in params]
    offsets = np.cumsum([0] + sizes)
    flat = np.empty(offsets[-1] + 1, np.float32)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        _, _, grads = model.loss_and_gradients(x, y)
        for g, start, stop in zip(grads, offsets[:-1], offsets[1:]):
            flat[start:stop] = g.ravel()
        flat[-1] = x.shape[0]
        comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
        scale = 1.0 / flat[-1]
        for p, v, start, stop in zip(params, velocity, offsets[:-1], offsets[1:]):
            v *= MOMENTUM
            v -= (LEARNING_RATE * scale) * flat[start:stop].reshape(p.shape)
            p += v

    step(0)
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    elapsed = comm.allreduce(time.perf_counter() - t0, MPI.MAX)
    return steps / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--check-every", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32, help="examples per replica and step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--reference-steps", type=int, default=2000, help="raw mpi4py steps (0: none)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    batches = synthetic_batches(rank, args.batch)
    soak = Soak(args.hidden, batches)
    soak.step(0)  # warm-up: buffers, plans, thresholds

    def check(step: int) -> tuple[list[float], list[int]]:
        gathered = comm.allgather((rss_mib(), digest(soak.state())))
        rss = [r for r, _ in gathered]
        bad = [r for r, (_, d) in enumerate(gathered) if d != gathered[0][1]]
        return rss, bad

    say(f"soak: {size} ranks x {soak.strategy.num_replicas_in_sync // size} replica(s), MLP {FEATURES}-{args.hidden}-"
        f"{CLASSES} float32, batch {args.batch} per replica, {args.steps} steps, check every {args.check_every}")
    say(f"{'step':>7} {'steps/s':>9}  {'RSS MiB per rank':<{9 * size}} mismatched ranks")
    rss_start, bad = check(0)
    mismatches = len(bad)
    say(f"{0:>7} {'':>9}  " + "".join(f"{r:9.1f}" for r in rss_start) + f" {bad or '-'}")
    total_time = 0.0
    step = 0
    while step < args.steps:
        n = min(args.check_every, args.steps - step)
        comm.Barrier()
        t0 = time.perf_counter()
        for i in range(step + 1, step + n + 1):
            soak.step(i)
        elapsed = comm.allreduce(time.perf_counter() - t0, MPI.MAX)
        total_time += elapsed
        step += n
        rss, bad = check(step)
        mismatches += len(bad)
        say(f"{step:>7} {n / elapsed:9.0f}  " + "".join(f"{r:9.1f}" for r in rss) + f" {bad or '-'}")
    say(f"\n{args.steps} steps in {total_time:.1f} s: {args.steps / total_time:.0f} steps/s "
        f"({1e3 * total_time / args.steps:.3f} ms per step, slowest rank)")
    for r in range(size):
        say(f"rank {r}: RSS {rss_start[r]:.1f} MiB at the start, {rss[r]:.1f} MiB at the end "
            f"({rss[r] - rss_start[r]:+.1f} MiB)")
    finite = comm.allreduce(int(all(np.isfinite(a).all() for a in soak.state())), MPI.MIN)
    say(f"weight mismatches between ranks: {mismatches} (over {args.steps // args.check_every + 1} checks); "
        f"weights finite on every rank: {'yes' if finite else 'NO'}")
    if args.reference_steps:
        raw = reference_steps(args.hidden, batches, args.reference_steps, comm)
        ours = args.steps / total_time
        say(f"raw mpi4py reference, same step: {raw:.0f} steps/s; mpistrat / raw = {ours / raw:.2f}")
    return 1 if mismatches or not finite else 0


if __name__ == "__main__":
    sys.exit(main())
