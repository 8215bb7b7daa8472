"""ParameterServerStrategy's costs: a ps round trip against an all-reduce, scheduled steps/s, the example's examples/s.

    python benchmarks/parameter_server.py            # the driver: starts the mpiexec runs below, prints the tables
    mpiexec -n 4 python benchmarks/parameter_server.py --worker latency
    mpiexec -n 5 python benchmarks/parameter_server.py --worker steps --num-ps 2

``latency`` (1 chief, 1 ps, 2 workers): first every rank times raw ``Allreduce(IN_PLACE)`` of a float32
array (4 ranks, the slowest rank, median of 200), then the job starts and the chief times
``v.assign_add(delta)`` of a ps-held variable of the same size (one request and its answer; median of 200):
what a worker pays per update against what a synchronous step pays per gradient. ``steps``: the chief
schedules 400 functions that each add 1 to a small ps-held variable and joins (steps/s, median of 3 rounds)
with 1 and 2 ps and 2 and 3 workers. ``examples`` runs ``examples/train_ps.py`` and ``examples/train.py``
(``MultiWorkerMirroredStrategy``) at the same rank count, 20 epochs, and compares examples/s.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1 << 10, 16 << 10, 256 << 10, 4 << 20]  # bytes


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def worker(mode: str, num_ps: int) -> None:
    from mpi4py import MPI

    import mpistrat as ms

    world = MPI.COMM_WORLD
    raw = {}
    if mode == "latency":
        for size in SIZES:
            buf = np.zeros(size // 4, np.float32)
            times = []
            world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)  # warm-up
            for _ in range(200):
                world.Barrier()
                t = time.perf_counter()
                world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
                times.append(world.allreduce(time.perf_counter() - t, MPI.MAX))
            raw[size] = statistics.median(times)
    resolver = ms.cluster_resolver.MPIClusterResolver(num_ps=num_ps)
    if resolver.task_type in ("ps", "worker"):
        ms.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
        return
    strategy = ms.ParameterServerStrategy(resolver)
    coordinator = ms.coordinator.ClusterCoordinator(strategy)
    workers = world.Get_size() - 1 - num_ps
    if mode == "latency":
        for size in SIZES:
            with strategy.scope():
                v = ms.Variable(np.zeros(size // 4, np.float32))
            delta = np.ones(size // 4, np.float32)
            update = functools.partial(v.assign_add, delta)
            _median_time(update, 20)  # warm-up
            ps_time = _median_time(update, 200)
            print(f"latency {size} {raw[size] * 1e6:.1f} {ps_time * 1e6:.1f}", flush=True)
    else:
        with strategy.scope():
            counter = ms.Variable(np.zeros(4, np.float32))

        def step():
            counter.assign_add(np.ones(4, np.float32))

        rates = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(400):
                coordinator.schedule(step)
            coordinator.join()
            rates.append(400 / (time.perf_counter() - t))
        print(f"steps {num_ps} {workers} {statistics.median(rates):.0f}", flush=True)


def _run(args: list[str], ranks: int) -> str:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable] + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def driver() -> None:
    me = os.path.abspath(__file__)
    print("## ps round trip (assign_add of a ps-held variable) against raw Allreduce(IN_PLACE), 4 ranks")
    print("| size | raw Allreduce (us) | ps assign_add (us) | ps / allreduce |\n|---|---|---|---|")
    for line in _run([me, "--worker", "latency"], 4).splitlines():
        if line.startswith("latency "):
            _, size, raw, ps = line.split()
            print(f"| {int(size) >> 10} KiB | {float(raw):.1f} | {float(ps):.1f} | {float(ps) / float(raw):.2f} |")
    print("\n## scheduled steps/s (each: one assign_add of 16 bytes on a ps)")
    print("| ps | workers | ranks | steps/s |\n|---|---|---|---|")
    for num_ps, workers in [(1, 2), (2, 2), (1, 3)]:
        ranks = 1 + num_ps + workers
        for line in _run([me, "--worker", "steps", "--num-ps", str(num_ps)], ranks).splitlines():
            if line.startswith("steps "):
                print(f"| {num_ps} | {workers} | {ranks} | {line.split()[3]} |")
    print("\n## the digits example, 4 ranks, 20 epochs (examples/s; test accuracy)")
    ps_out = _run([os.path.join(ROOT, "examples", "train_ps.py")], 4)
    ps_rate = re.search(r"final test accuracy ([\d.]+) .*?, (\d+) examples/s", ps_out)
    sync_out = _run([os.path.join(ROOT, "examples", "train.py"), "--epochs", "20", "--no-progress",
                     "--data-dir", os.path.join(ROOT, "examples", "data")], 4)
    sync = re.search(r"final test accuracy ([\d.]+) after 20 epochs .*\(([\d.]+) s\)", sync_out)
    steps = re.search(r"(\d+) steps/epoch", sync_out)
    batch = re.search(r"global batch (\d+)", sync_out)
    if not (ps_rate and sync and steps and batch):
        raise SystemExit(f"could not read the examples' output:\n{ps_out}\n{sync_out}")
    sync_rate = 20 * int(steps.group(1)) * int(batch.group(1)) / float(sync.group(2))
    print("| strategy | examples/s | test accuracy |\n|---|---|---|")
    print(f"| ParameterServerStrategy (1 chief, 1 ps, 2 workers) | {int(ps_rate.group(2))} | {ps_rate.group(1)} |")
    print(f"| MultiWorkerMirroredStrategy (4 workers) | {sync_rate:.0f} | {sync.group(1)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["latency", "steps"], help="run as one rank of a job (under mpiexec)")
    parser.add_argument("--num-ps", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.num_ps)
    else:
        driver()


if __name__ == "__main__":
    main()
