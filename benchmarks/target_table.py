"""Issue 23's table: the strategy's all-reduce against raw mpi4py, the median of several runs, beside its target.

    python benchmarks/target_table.py [--ranks 2 4] [--runs 5] [--tree .] [--old ../old]

Each run is ``mpiexec -bind-to core -n N python TREE/benchmarks/allreduce.py --columns strategy`` (the
method of ``allreduce.py``: interleaved with raw ``Allreduce(IN_PLACE)``, the slowest rank, the median
over iterations). Per size it prints the median over the runs of ``raw time / strategy time`` (the
busbw ratio), each run's value, raw's 1 MiB time in every run (the machine changes speed between
runs) and the cross-core round trip before every run (``machine_phase.py``: the VM's speed phase), the
fused case (100 arrays of 4 KiB in one ``all_reduce`` inside ``strategy.run`` against 100
raw calls) and issue 23's target for each row. With ``--old``, runs of that checkout alternate with
the tree's, and its medians are printed too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

from compare_trees import run_once
from machine_phase import describe, round_trip_ns

SIZES = ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]
FUSED = "100 x 4 KiB one fused all_reduce in strategy.run"
# Issue 23, "Done when": ranks -> size -> the least ratio raw time / strategy time.
TARGETS = {
    2: {"4 KiB": 0.5, "16 KiB": 1.0, "64 KiB": 1.0, "256 KiB": 1.5, "1 MiB": 1.5, "4 MiB": 1.2, "16 MiB": 1.2,
        "64 MiB": 1.5, FUSED: 3.0},
    4: {"64 KiB": 0.8, "256 KiB": 0.8, "1 MiB": 0.8, "4 MiB": 0.8, "16 MiB": 0.8, "64 MiB": 0.8, FUSED: 8.0},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tree", default=".")
    parser.add_argument("--old", help="another checkout, run alternately")
    args = parser.parse_args(argv)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    trees = [("new", os.path.abspath(args.tree))] + ([("old", os.path.abspath(args.old))] if args.old else [])
    for ranks in args.ranks:
        runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
        trips: dict[str, list[float | None]] = {label: [] for label, _ in trees}
        for k in range(args.runs):
            for label, tree in trees:
                trips[label].append(round_trip_ns())
                runs[label].append(run_once(tree, ranks, ["--columns", "strategy"], mpiexec))
                print(f"# {ranks} ranks, run {k + 1}/{args.runs}: {label} done", file=sys.stderr, flush=True)
        print(f"\n## {ranks} ranks, {args.runs} runs: raw time / strategy time (median over runs; each run)")
        for label, _ in trees:
            raw = ", ".join(f"{r['1 MiB raw'][1]:.0f}" for r in runs[label])
            print(f"# {label}: raw Allreduce(IN_PLACE) of 1 MiB, per run: {raw} us; cross-core round trip before "
                  f"each run: {describe(trips[label])}")
        head = f"{'case':>10} | {'target':>6}"
        for label, _ in trees:
            head += f" | {label + ' median':>11} {'runs':>{6 * args.runs}}"
        print(head)
        for case in SIZES + [FUSED]:
            key = case if case == FUSED else f"{case} strategy"
            target = TARGETS.get(ranks, {}).get(case)
            line = f"{'100 x 4K' if case == FUSED else case:>10} | {'' if target is None else f'{target:.1f}':>6}"
            for label, _ in trees:
                values = [r[key][0] for r in runs[label] if key in r]
                median = statistics.median(values)
                mark = "" if target is None else (" ok" if median >= target else " --")
                line += f" | {median:8.2f}{mark:3} {' '.join(f'{v:5.2f}' for v in values):>{6 * args.runs}}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
