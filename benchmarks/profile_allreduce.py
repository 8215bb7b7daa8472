"""Profile one all-reduce path per rank: where the microseconds of a call go.

    mpiexec -bind-to core -n 2 python benchmarks/profile_allreduce.py --path strategy --size 4K --calls 20000
    mpiexec -bind-to core -n 2 python benchmarks/profile_allreduce.py --path rankcomm --size 1M --cprofile
    mpiexec -bind-to core -n 2 py-spy record --native --format raw -o /tmp/s.%r.txt -- \\
        python benchmarks/profile_allreduce.py --path strategy --size 16M --calls 400

``--path``: ``strategy`` (``get_replica_context().all_reduce("sum", buf)`` inside
``MultiWorkerMirroredStrategy.run``, a new result, the input untouched), ``rankcomm``
(``RankCommunicator.allreduce([buf], "sum")``, the call the strategy makes) or ``raw``
(``Allreduce(IN_PLACE)``). Every rank times ``--calls`` calls back to back after a warm-up
(no barrier between calls: the steady state a training loop sees) and prints its time per call;
with ``--cprofile`` each rank then profiles as many calls again and prints its top functions by
own time (cProfile's overhead inflates every Python call; read its counts, and its shares only
against each other). Without it, the loop is what a sampling profiler (``py-spy``, ``perf``)
attached from outside sees.

``--stages`` times where one call's microseconds go instead, in ``allreduce.py``'s conditions: the
call alternates with raw ``Allreduce(IN_PLACE)``, a barrier before each, and wrappers record when the
call enters ``RankCommunicator.allreduce``, its first transport, the agreement check's ``start`` and
``finish``, and when each returns, on the clock every rank of a machine shares (``CLOCK_MONOTONIC``)
from the first rank's barrier exit. Each wrapper adds a few tenths of a microsecond; the medians
over ``--calls`` calls are printed per rank, with the slowest rank's median of the whole call and of
raw's beside it.

    mpiexec -bind-to core -n 2 python benchmarks/profile_allreduce.py --path strategy --size 4K --stages
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import numpy as np
from allreduce import parse_size
from mpi4py import MPI

import mpistrat as ms


def make_call(path: str, size: int) -> tuple:
    """The zero-argument call of ``path`` on a zero float32 buffer of ``size`` bytes, and the strategy."""
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    rc = strategy.extended._communicator
    buf = np.zeros(size // 4, np.float32)
    get = ms.get_replica_context
    if path == "strategy":
        run = strategy.run

        def step() -> object:
            return get().all_reduce("sum", buf)

        return (lambda: run(step)), strategy
    if path == "rankcomm":
        return (lambda: rc.allreduce([buf], "sum")), strategy
    if path == "raw":
        return (lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)), strategy
    raise SystemExit(f"unknown --path {path!r}: strategy, rankcomm or raw")


def _wrap(obj: object, name: str, label: str, marks: dict) -> None:
    """Record ``marks[label]`` when ``obj.name`` is entered (the first time in a call) and ``marks[label + "/"]``
    when it returns."""
    inner = getattr(obj, name)

    def recorded(*args: object, **kwargs: object) -> object:
        marks.setdefault(label, time.perf_counter())
        try:
            return inner(*args, **kwargs)
        finally:
            marks[label + "/"] = time.perf_counter()

    setattr(obj, name, recorded)


def stages(path: str, size: int, calls: int) -> list[str]:
    """Per-rank medians of when each stage of a call begins and ends (see the module docstring)."""
    world = MPI.COMM_WORLD
    call, strategy = make_call(path, size)
    rc = strategy.extended._communicator
    marks: dict[str, float] = {}
    order = ["allreduce", "repeat", "pool", "pool/", "transport", "check.start", "check.start/", "check.finish",
             "check.finish/", "check", "check/", "transport/", "repeat/", "allreduce/"]
    _wrap(rc, "allreduce", "allreduce", marks)
    _wrap(rc, "allreduce_repeat", "repeat", marks)  # the lean path of a repeated call (strategy)
    for t in rc.transports:
        for verb in ("allreduce_array", "allreduce_packed"):
            _wrap(t, verb, "transport", marks)
    if rc._guard is not None:
        _wrap(rc._guard, "start", "check.start", marks)
        _wrap(rc._guard, "finish", "check.finish", marks)
        _wrap(rc._guard, "check_aux", "check", marks)  # start and finish in one (a folded check)
    buf = np.zeros(size // 4, np.float32)
    raw = lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)  # noqa: E731
    for _ in range(200):
        call()
        raw()
    for plan in list(rc._planner.singles.values()):  # planned by now: the result pools of the call
        for step in plan.steps:
            if step.pool is not None:
                _wrap(step.pool, "get", "pool", marks)
    at = np.full((calls, len(order)), np.nan)
    starts, ends, raws = np.zeros(calls), np.zeros(calls), np.zeros(calls)
    for i in range(calls):
        world.Barrier()
        t0 = time.perf_counter()
        raw()
        raws[i] = time.perf_counter() - t0
        marks.clear()
        world.Barrier()
        starts[i] = time.perf_counter()
        call()
        ends[i] = time.perf_counter()
        for j, label in enumerate(order):
            if label in marks:
                at[i, j] = marks[label]
    first = starts.copy()
    world.Allreduce(MPI.IN_PLACE, first, MPI.MIN)  # the first rank's barrier exit, per call
    slowest = np.array([ends - starts, raws])
    world.Allreduce(MPI.IN_PLACE, slowest, MPI.MAX)
    us = lambda x: float(np.nanmedian(x)) * 1e6  # noqa: E731
    text = f"rank {world.Get_rank()}: begins {us(starts - first):.1f}"
    for j, label in enumerate(order):
        if not np.all(np.isnan(at[:, j])):
            text += f", {label} {us(at[:, j] - first):.1f}"
    text += f", returns {us(ends - first):.1f} us"
    if world.Get_rank() == 0:
        text += (f"\n  (slowest rank: this call {us(slowest[0]):.1f} us, raw Allreduce(IN_PLACE) {us(slowest[1]):.1f} us;"
                 f" transports {[t.name for t in rc.transports]})")
    return [text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="strategy")
    parser.add_argument("--size", default="4K")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--cprofile", action="store_true", help="then profile as many calls with cProfile")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--stages", action="store_true", help="time the stages of a call (see the docstring)")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    if args.stages:
        lines = stages(args.path, parse_size(args.size), args.calls)
        for r in range(world.Get_size()):
            if r == world.Get_rank():
                print("\n".join(lines), flush=True)
            world.Barrier()
        return 0
    call, strategy = make_call(args.path, parse_size(args.size))
    for _ in range(max(50, args.calls // 20)):
        call()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    per_call = (time.perf_counter() - t0) / args.calls
    lines = [f"rank {world.Get_rank()}: {args.path} {args.size}: {per_call * 1e6:.1f} us per call "
             f"({args.calls} calls, unprofiled)"]
    if args.cprofile:
        world.Barrier()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        lines.append(text.getvalue())
    for r in range(world.Get_size()):  # one rank at a time, in rank order
        if r == world.Get_rank():
            print("\n".join(lines), flush=True)
        world.Barrier()
    del strategy
    return 0


if __name__ == "__main__":
    sys.exit(main())
