"""Weak scaling of a compute-bound data-parallel training step: mpistrat against raw mpi4py, step by step.

    python benchmarks/train_step.py [--ranks 1 2 4] [--runs 1] [--steps 30] [--modes mpistrat,overlap,barrier]
                                    [--plot PATH] [--json PATH]
    mpiexec -bind-to core -n N python benchmarks/train_step.py --worker [--steps 30]   # one rank count

The model: an MLP 784 -> 1024 -> 1024 -> 1024 -> 10 (float32, ReLU, summed softmax
cross-entropy; 2.9 M parameters, 11.1 MiB of gradients in 8 arrays), forward and backward
in NumPy as in ``mpistrat/examples/mlp.py`` (whose ``MLP`` makes the variables), 256
examples per rank and step (weak scaling: the global batch grows with the ranks), plain
SGD. Every mode trains its own copy of the model from the same initial weights on the
same batches, with the same forward and backward code:

* ``raw`` (the reference): the step written with raw mpi4py: backward, then
  ``comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM)`` per gradient (8 calls), then
  ``p -= lr * g`` in NumPy.
* ``mpistrat``: ``MultiWorkerMirroredStrategy.run`` of the replica step: backward, then
  ONE ``get_replica_context().all_reduce(SUM, grads)`` of the list of 8 gradients, then
  ``optimizer.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)``
  (``mpistrat.optimizers.SGD``, in replica context: ``merge_call`` and
  ``extended.update`` on the mirrored variables).
* ``overlap``: as ``mpistrat``, but backward yields each layer's kernel and bias
  gradients as soon as it has them (last layer first), each pair starts its reduction
  with ``experimental_all_reduce_async`` before the layer below is differentiated, and
  the step waits for every handle's ``result()`` before the update.
* ``barrier`` (a bound, not a training step): raw's step with one ``comm.Barrier()`` in
  place of the 8 ``Allreduce`` calls, each rank updating with its own gradients. Every
  all-reduce waits for the slowest rank's backward as the barrier does, and moves data
  besides, so raw / barrier is about the most any all-reduce could make of the paired
  ratio (a bound up to the difference between MPICH's barrier and the synchronisation
  of an all-reduce). Its weights are not checked: its ranks train apart.

Method (that of ``allreduce.py``): warm-up steps of every mode first; then each iteration
runs one step of every mode, in a new random order per iteration (a fixed seed, so the
same on every rank) with no mode twice in a row (two modes: plain alternation); every
step starts after a ``Barrier``, each rank times it, and the slowest rank's time counts.
Per mode: the median step time; examples/s = ranks x 256 / that median; the paired ratio
= median over iterations of raw's step time / this mode's step time in the same iteration
(robust to a machine that changes speed); the fraction of the step spent reducing = each
rank's time in its reduction calls (raw: the 8 ``Allreduce``; mpistrat: the
``all_reduce``; overlap: starting the reductions plus waiting for their results, i.e. the
part not hidden behind compute; barrier: the ``Barrier``) over the iteration's step time,
mean over ranks, median over iterations. A rank's time in a reduction includes waiting
for ranks that finish their backward later. The fraction updating is measured the same
way (raw and barrier: the NumPy updates; mpistrat and overlap: ``apply_gradients``).

The driver (no ``--worker``) runs ``mpiexec -bind-to core -n N`` for every N of ``--ranks``,
``--runs`` times with the rank counts alternating, and reports per N and mode the median
over runs, with the scaling efficiency = examples/s at N / (N x the same mode's examples/s
at 1 rank). This script sets ``OMP_NUM_THREADS=1`` (and ``OPENBLAS_NUM_THREADS``,
``MKL_NUM_THREADS``) before NumPy loads: one BLAS thread per rank, so the ranks use the
cores. At the end every rank checks its weights: equal on every rank (per mode), and each
mode's within float32 rounding of the raw mode's, so the modes did the same work (distance
to raw's weights at most 1% of the distance trained); the exit code is 1 if not.
"""

from __future__ import annotations

import os

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
if __name__ == "__main__":  # before NumPy loads: one BLAS thread per rank (imported as a module: left alone)
    for _name in BLAS_THREAD_VARIABLES:
        os.environ[_name] = "1"

import argparse
import datetime
import hashlib
import json
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

import mpistrat as ms  # loads no MPI: the driver never initialises MPI
from mpistrat.examples.mlp import MLP, softmax_cross_entropy_sum
from mpistrat.optimizers import SGD

LAYER_SIZES = (784, 1024, 1024, 1024, 10)
BATCH_PER_RANK = 256
LEARNING_RATE = 0.01  # of the mean gradient; the summed gradients are scaled by 1 / global batch
SEED = 0  # the weights' initialisation, the same in every mode
DISTINCT_BATCHES = 4  # per rank, cycled; step k of every mode uses batch k % 4
ORDER_SEED = 20261123  # the modes' order per iteration, the same on every rank
MODES = ("raw", "mpistrat", "overlap", "barrier")
UNCHECKED_MODES = ("barrier",)  # bounds, not training: each rank keeps its own gradients
# |w - w_raw| / |w_raw - w_initial| (norms over all variables) above which a mode did other work than raw.
# Sums in another order differ in the last bits, and a ReLU unit near zero can then switch in one mode only:
# at 4 ranks the ratio grew from 4e-6 to 3e-4 over 16 steps; a missed or mis-scaled reduction gives about 1.
SAME_WORK_TOLERANCE = 1e-2
MPIEXEC_TIMEOUT_S = 900

Batch = tuple[np.ndarray, np.ndarray]


# -- the model's arithmetic, shared by every mode -----------------------------------------
def synthetic_batches(rank: int, count: int, batch: int) -> list[Batch]:
    """Learnable data: labels from a fixed random linear map of the inputs; every rank has its own inputs."""
    teacher = np.random.default_rng(12345).standard_normal((LAYER_SIZES[0], LAYER_SIZES[-1]))
    rng = np.random.default_rng(1000 + rank)
    out = []
    for _ in range(count):
        x = rng.standard_normal((batch, LAYER_SIZES[0])).astype(np.float32)
        out.append((x, (x @ teacher).argmax(axis=1).astype(np.int64)))
    return out


def forward(params: Sequence[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits of ``x`` and every layer's input (``params``: kernel, bias, kernel, bias, ...)."""
    h, acts = x, [x]
    last = len(params) - 2
    for i in range(0, len(params), 2):
        z = h @ params[i] + params[i + 1]
        h = z if i == last else np.maximum(z, 0)
        acts.append(h)
    return h, acts


def layer_gradients(params: Sequence[np.ndarray], acts: list[np.ndarray],
                    dlogits: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Backward, layer by layer from the last: ``(layer, kernel gradient, bias gradient)``.

    Each layer's pair is yielded before the layer below is differentiated, so a
    caller can start reducing it while backward goes on.
    """
    dz = dlogits
    for i in range(len(params) - 2, -1, -2):
        h_in = acts[i // 2]
        yield i // 2, h_in.T @ dz, dz.sum(axis=0)
        if i:
            dz = (dz @ params[i].T) * (h_in > 0)


def gradients(params: Sequence[np.ndarray], x: np.ndarray, labels: np.ndarray) -> list[np.ndarray]:
    """Summed gradients of every parameter over the batch, in ``params`` order."""
    logits, acts = forward(params, x)
    _, dlogits = softmax_cross_entropy_sum(logits, labels)
    grads: list[Any] = [None] * len(params)
    for layer, dkernel, dbias in layer_gradients(params, acts, dlogits):
        grads[2 * layer], grads[2 * layer + 1] = dkernel, dbias
    return grads


# -- the steps ------------------------------------------------------------------------
class RawStep:
    """The step written with raw mpi4py: one ``Allreduce(IN_PLACE)`` per gradient, SGD in NumPy."""

    def __init__(self, comm: Any, initial: list[np.ndarray], lr: float, batches: list[Batch]):
        from mpi4py import MPI

        self._comm, self._allreduce, self._sum = comm, comm.Allreduce, MPI.SUM
        self._in_place = MPI.IN_PLACE
        self.params = [np.array(p) for p in initial]
        self.lr, self.batches = lr, batches

    def _reduce(self, grads: list[np.ndarray]) -> None:
        for g in grads:
            self._allreduce(self._in_place, g, self._sum)

    def __call__(self, k: int) -> tuple[float, float]:
        """Step ``k``; returns the seconds spent reducing and updating."""
        grads = gradients(self.params, *self.batches[k % len(self.batches)])
        t0 = time.perf_counter()
        self._reduce(grads)
        t1 = time.perf_counter()
        for p, g in zip(self.params, grads):
            p -= self.lr * g
        return t1 - t0, time.perf_counter() - t1

    def weights(self) -> list[np.ndarray]:
        return self.params


class BarrierStep(RawStep):
    """Raw's step with a ``Barrier`` in place of the reductions: the bound of every all-reduce's step."""

    def _reduce(self, grads: list[np.ndarray]) -> None:
        self._comm.Barrier()


class StrategyStep:
    """The step inside ``MultiWorkerMirroredStrategy.run``: blocking ``all_reduce`` or layer-by-layer overlap."""

    def __init__(self, strategy: Any, lr: float, batches: list[Batch], overlap: bool):
        self.strategy, self.batches = strategy, batches
        with strategy.scope():
            self.model = MLP(LAYER_SIZES, seed=SEED, dtype="float32")
            self.optimizer = SGD(lr)
        self.variables = self.model.trainable_variables
        self._replica_step = self._overlapped if overlap else self._blocking
        self._reducing = self._updating = 0.0

    def __call__(self, k: int) -> tuple[float, float]:
        """Step ``k``; returns the seconds this rank's replica spent reducing and updating."""
        self.strategy.run(self._replica_step, args=self.batches[k % len(self.batches)])
        return self._reducing, self._updating

    def _blocking(self, x: np.ndarray, labels: np.ndarray) -> None:
        grads = gradients([v.value() for v in self.variables], x, labels)
        ctx = ms.get_replica_context()
        t0 = time.perf_counter()
        reduced = ctx.all_reduce(ms.ReduceOp.SUM, grads)
        self._reducing = time.perf_counter() - t0
        self._apply(reduced)

    def _overlapped(self, x: np.ndarray, labels: np.ndarray) -> None:
        params = [v.value() for v in self.variables]
        logits, acts = forward(params, x)
        _, dlogits = softmax_cross_entropy_sum(logits, labels)
        ctx = ms.get_replica_context()
        start = ctx.experimental_all_reduce_async
        handles, reducing = [], 0.0
        for layer, dkernel, dbias in layer_gradients(params, acts, dlogits):
            t0 = time.perf_counter()
            handles.append((layer, start(ms.ReduceOp.SUM, [dkernel, dbias])))
            reducing += time.perf_counter() - t0
        reduced: list[Any] = [None] * len(params)
        # The weights read for this step are snapshots (``value()``): while one is held, the update cannot
        # subtract in place and copies the variable instead. The blocking step drops them with its call.
        del params, acts
        t0 = time.perf_counter()
        for layer, handle in handles:
            reduced[2 * layer], reduced[2 * layer + 1] = handle.result()
        self._reducing = reducing + time.perf_counter() - t0
        self._apply(reduced)

    def _apply(self, reduced: list[np.ndarray]) -> None:
        t0 = time.perf_counter()
        self.optimizer.apply_gradients(zip(reduced, self.variables), experimental_aggregate_gradients=False)
        self._updating = time.perf_counter() - t0

    def weights(self) -> list[np.ndarray]:
        return [np.asarray(self.strategy.experimental_local_results(v)[0]) for v in self.variables]


# -- measuring (worker) -----------------------------------------------------------------
def paired_steps(comm: Any, steps: Sequence[Callable[[int], tuple[float, float]]], iters: int,
                 warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """``step_s[iteration, mode]`` (the slowest rank's) and ``parts_s[rank, iteration, mode, part]``.

    Every iteration runs each step once, in a new random order (``ORDER_SEED``: the same
    on every rank) whose first step is not the previous iteration's last, each after a
    ``Barrier`` (the order rule of ``allreduce.samples``). Step ``warmup + i`` of every mode
    uses the same batch. The parts are the seconds each rank's step reported spending
    reducing (0) and updating (1).
    """
    from mpi4py import MPI

    for step in steps:
        for k in range(warmup):
            step(k)
    m = len(steps)
    step_s, parts_s = np.zeros((iters, m)), np.zeros((iters, m, 2))
    rng = np.random.default_rng(ORDER_SEED)
    last = -1
    for i in range(iters):
        order = rng.permutation(m)
        while m > 1 and order[0] == last:
            order = rng.permutation(m)
        last = order[-1]
        for j in order:
            comm.Barrier()
            t0 = time.perf_counter()
            parts_s[i, j] = steps[j](warmup + i)
            step_s[i, j] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, step_s, MPI.MAX)
    every_rank = np.empty((comm.Get_size(), iters, m, 2))
    comm.Allgather(parts_s, every_rank)
    return step_s, every_rank


def summarize(names: Sequence[str], step_s: np.ndarray, parts_s: np.ndarray, ranks: int) -> dict[str, dict]:
    """Per mode: median step time, examples/s, fractions reducing and updating, and ratios to mode 0 (raw)."""
    out = {}
    raw = step_s[:, 0]
    for j, name in enumerate(names):
        t = float(np.median(step_s[:, j]))
        fractions = np.median((parts_s[:, :, j, :] / step_s[None, :, j, None]).mean(axis=0), axis=0)
        out[name] = {
            "step_s": t,
            "examples_per_s": ranks * BATCH_PER_RANK / t,
            "reducing_fraction": float(fractions[0]),
            "updating_fraction": float(fractions[1]),
            "ratio": float(np.median(raw)) / t,
            "pair": float(np.median(raw / step_s[:, j])),
            "step_s_all": step_s[:, j].tolist(),
        }
    return out


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check_weights(comm: Any, names: Sequence[str], weights: list[list[np.ndarray]],
                  initial: list[np.ndarray]) -> tuple[list[str], dict[str, float]]:
    """Problems with the final weights (the same list on every rank; empty: all good), and per mode its
    distance from raw's weights as a fraction of the distance raw trained (norms over all variables)."""
    problems, differences = [], {}
    for name, w in zip(names, weights):
        digests = comm.allgather(digest(w))
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            problems.append(f"{name}: weights on ranks {differ} differ from rank 0's")
        if not all(np.isfinite(a).all() for a in w):
            problems.append(f"{name}: weights not finite on rank {comm.Get_rank()}")
    trained = _norm(b - i for b, i in zip(weights[0], initial))
    for name, w in zip(names[1:], weights[1:]):
        differences[name] = _norm(a - b for a, b in zip(w, weights[0])) / max(trained, 1e-30)
        if differences[name] > SAME_WORK_TOLERANCE:
            problems.append(f"{name}: weights differ from raw's by {differences[name]:.1e} of the distance trained "
                            f"(float32 rounding stays below {SAME_WORK_TOLERANCE:g})")
    every = comm.allgather(problems)
    return sorted({p for rank_problems in every for p in rank_problems}), differences


def _norm(arrays: Iterator[np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.square(a, dtype=np.float64).sum()) for a in arrays)))


def worker(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    names = ["raw"] + args.modes
    strategy = ms.MultiWorkerMirroredStrategy()
    lr = LEARNING_RATE / (BATCH_PER_RANK * size)  # the gradients are sums over the global batch
    batches = synthetic_batches(rank, DISTINCT_BATCHES, BATCH_PER_RANK)
    initial = [np.array(v.value()) for v in MLP(LAYER_SIZES, seed=SEED, dtype="float32").variables]
    steps: list[Any] = [RawStep(comm, initial, lr, batches)]
    steps += [BarrierStep(comm, initial, lr, batches) if name == "barrier" else
              StrategyStep(strategy, lr, batches, overlap=(name == "overlap")) for name in args.modes]
    step_s, parts_s = paired_steps(comm, steps, args.steps, args.warmup)
    result = summarize(names, step_s, parts_s, size)
    checked = [(name, step) for name, step in zip(names, steps) if name not in UNCHECKED_MODES]
    problems, differences = check_weights(comm, [name for name, _ in checked], [s.weights() for _, s in checked],
                                          initial)
    grad_bytes = sum(a.nbytes for a in initial)
    info = {
        "ranks": size, "modes": names, "iterations": args.steps, "warmup": args.warmup,
        "batch_per_rank": BATCH_PER_RANK, "layers": list(LAYER_SIZES), "gradient_bytes": grad_bytes,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(), "numpy": np.__version__,
        "blas_threads": {k: os.environ.get(k) for k in BLAS_THREAD_VARIABLES}, "problems": problems,
        "weight_difference_from_raw": differences, "results": result,
    }
    if rank == 0:
        print(f"# train_step: {size} rank(s), MLP {'-'.join(map(str, LAYER_SIZES))} float32, {BATCH_PER_RANK} "
              f"examples per rank, {grad_bytes / 2**20:.1f} MiB of gradients in {len(initial)} arrays, SGD; "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; {args.steps} iterations after {args.warmup} "
              f"warm-up steps per mode; {info['mpi']}")
        print(f"{'mode':10} {'step ms':>8} {'examples/s':>11} {'reducing':>9} {'updating':>9} {'ratio':>6} {'pair':>6}")
        for name in names:
            r = result[name]
            print(f"{name:10} {r['step_s'] * 1e3:8.1f} {r['examples_per_s']:11.0f} {r['reducing_fraction']:9.1%} "
                  f"{r['updating_fraction']:9.1%} "
                  f"{r['ratio']:6.3f} {r['pair']:6.3f}")
        verdict = "; ".join(f"WEIGHT CHECK FAILED: {p}" for p in problems) or "equal on every rank in every training mode"
        print(f"# final weights: {verdict}; distance from raw's / distance trained: "
              + ", ".join(f"{name} {d:.1e}" for name, d in differences.items()))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(info, f)
    return 1 if problems else 0


# -- the driver ---------------------------------------------------------------------------
def launched_by_mpiexec() -> bool:
    """True under MPICH/Hydra, Open MPI or PMIx launchers (they set these variables in each rank)."""
    return any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def stop_group(job: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (mpiexec passes it to the ranks), SIGKILL after 30 s."""
    os.killpg(job.pid, signal.SIGTERM)
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def run_worker(mpiexec: str, ranks: int, args: argparse.Namespace, out: str) -> dict:
    cmd = [mpiexec, "--bind-to", "core", "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
           "--out", out, "--steps", str(args.steps), "--warmup", str(args.warmup), "--modes", ",".join(args.modes)]
    print(f"$ {' '.join(cmd[:5])} python benchmarks/train_step.py {' '.join(cmd[7:])}", flush=True)
    job = subprocess.Popen(cmd, start_new_session=True)  # its own process group: stopped with all its ranks
    try:
        code = job.wait(timeout=MPIEXEC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"train_step: the {ranks}-rank run took more than {MPIEXEC_TIMEOUT_S} s; stopped") from None
    finally:
        if job.poll() is None:
            stop_group(job)
    info = None
    if os.path.exists(out):
        with open(out) as f:
            info = json.load(f)
    if code or info is None:
        why = "; ".join(info["problems"]) if info and info["problems"] else "see its output above"
        raise SystemExit(f"train_step: the {ranks}-rank run failed (exit code {code}): {why}")
    return info


def aggregate(runs: dict[int, list[dict]], names: Sequence[str]) -> dict[int, dict[str, dict]]:
    """Per rank count and mode: medians over runs, the paired ratio's range, and the scaling efficiency."""
    table: dict[int, dict[str, dict]] = {}
    for n, infos in runs.items():
        table[n] = {}
        for name in names:
            rs = [info["results"][name] for info in infos]
            pairs = [r["pair"] for r in rs]
            table[n][name] = {
                "step_s": statistics.median(r["step_s"] for r in rs),
                "examples_per_s": statistics.median(r["examples_per_s"] for r in rs),
                "reducing_fraction": statistics.median(r["reducing_fraction"] for r in rs),
                "updating_fraction": statistics.median(r["updating_fraction"] for r in rs),
                "pair": statistics.median(pairs), "pair_min": min(pairs), "pair_max": max(pairs),
            }
    for n, modes in table.items():
        for name, row in modes.items():
            one = table.get(1, {}).get(name)
            row["efficiency"] = row["examples_per_s"] / (n * one["examples_per_s"]) if one else None
    return table


def print_table(table: dict[int, dict[str, dict]], names: Sequence[str], runs: int) -> None:
    print(f"\n# medians over {runs} run(s) per rank count; efficiency = examples/s / (ranks x the same mode's "
          f"examples/s at 1 rank); pair = median over iterations of raw step time / this step time "
          f"(median [min-max] over runs)"
          + ("; barrier: raw's step with a Barrier for its reductions, a bound, not training"
             if any(name in UNCHECKED_MODES for name in names) else ""))
    print(f"{'ranks':>5} {'mode':10} {'step ms':>8} {'examples/s':>11} {'efficiency':>10} {'reducing':>9} "
          f"{'updating':>9} {'pair to raw':>22}")
    for n in sorted(table):
        for name in names:
            r = table[n][name]
            eff = f"{r['efficiency']:10.1%}" if r["efficiency"] is not None else f"{'-':>10}"
            pair = f"{r['pair']:.3f} [{r['pair_min']:.3f}-{r['pair_max']:.3f}]" if name != "raw" else "-"
            print(f"{n:>5} {name:10} {r['step_s'] * 1e3:8.1f} {r['examples_per_s']:11.0f} {eff} "
                  f"{r['reducing_fraction']:9.1%} {r['updating_fraction']:9.1%} {pair:>22}")


def plot(path: str, table: dict[int, dict[str, dict]], names: Sequence[str]) -> None:
    """examples/s against ranks per mode, with linear scaling from raw's 1-rank throughput as a guide."""
    from plotting import line_plot

    ranks = sorted(table)
    label = {name: f"{name} (bound: no reduction)" if name in UNCHECKED_MODES else name for name in names}
    series = {label[name]: (ranks, [table[n][name]["examples_per_s"] for n in ranks]) for name in names}
    dashed = [label[name] for name in names if name in UNCHECKED_MODES]
    if 1 in table:
        series["linear scaling of raw at 1 rank"] = (ranks, [n * table[1]["raw"]["examples_per_s"] for n in ranks])
        dashed.append("linear scaling of raw at 1 rank")
    line_plot(path, series, title=f"train_step.py, weak scaling: MLP {'-'.join(map(str, LAYER_SIZES))}\n"
              f"{BATCH_PER_RANK} examples per rank, {os.cpu_count()} CPUs", xlabel="ranks", ylabel="examples/s",
              xticks=ranks, dashed=dashed)


def driver(args: argparse.Namespace) -> int:
    if args.plot:
        from plotting import PlotUnavailable, pyplot

        try:
            pyplot()  # before minutes of measuring
        except PlotUnavailable as exc:
            raise SystemExit(f"train_step: {exc}") from None
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("train_step: no mpiexec beside this Python or on PATH")
    names = ["raw"] + args.modes
    print(f"# train_step.py driver, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), ranks {args.ranks}, "
          f"{args.runs} run(s) each, alternating")
    runs: dict[int, list[dict]] = {n: [] for n in args.ranks}
    with tempfile.TemporaryDirectory(prefix="mpistrat-train-step-") as tmp:
        for r in range(args.runs):
            for n in args.ranks:
                runs[n].append(run_worker(mpiexec, n, args, os.path.join(tmp, f"run{r}-n{n}.json")))
    table = aggregate(runs, names)
    print_table(table, names, args.runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"table": {str(n): v for n, v in table.items()}, "runs": {str(n): v for n, v in runs.items()}},
                      f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(args.plot, table, names)
        print(f"# wrote {args.plot}")
    return 0


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip() and m.strip() != "raw"]
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes must be distinct names from {list(MODES[1:])} (raw always runs); "
                                         f"got {text!r}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts (driver)")
    parser.add_argument("--runs", type=int, default=1, help="runs per rank count, alternating (driver)")
    parser.add_argument("--steps", type=int, default=30, help="timed iterations (one step of every mode each)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of every mode first")
    parser.add_argument("--modes", type=parse_modes, default=parse_modes("mpistrat,overlap,barrier"),
                        help="comma-separated, from mpistrat,overlap,barrier (raw always runs)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of examples/s against ranks (driver; matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the table and every run's results (driver)")
    parser.add_argument("--worker", action="store_true", help="measure in this mpiexec job (one rank count)")
    parser.add_argument("--out", help="--worker: write this job's results as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.runs < 1 or any(n < 1 for n in args.ranks):
        parser.error("--steps, --warmup, --runs and --ranks must be at least 1")
    if args.worker:
        if args.plot or args.json:
            parser.error("--plot and --json belong to the driver (run without --worker and without mpiexec)")
        return worker(args)
    if launched_by_mpiexec():
        parser.error("under mpiexec, pass --worker (the driver starts mpiexec itself)")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
