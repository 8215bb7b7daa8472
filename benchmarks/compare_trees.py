"""A/B of two checkouts with ``allreduce.py``: runs alternated on one machine, per-size ratio new/old.

    python benchmarks/compare_trees.py --old /path/to/old/checkout --new . [--ranks 2 4] [--runs 5]

Each run starts ``mpiexec -bind-to core -n N python TREE/benchmarks/allreduce.py`` with
``PYTHONPATH=TREE`` (each tree's own benchmark and library, also where mpistrat is installed in editable
mode: ``_tree_shim/sitecustomize.py``; before 2026-11-27 such runs timed the installed tree twice), old and new alternating, ``--runs``
times per rank count. Every run reports, per size and column, the time and the busbw ratio to raw
``Allreduce(IN_PLACE)`` measured in that same run. This script pairs run k of the old tree with run
k of the new one and prints, per size and column, the median over pairs of two numbers (>= 1: the
new code is as fast or faster):

* ``ratio``: new busbw ratio / old busbw ratio. Ratios to raw MPI of the same run cancel most of
  the machine's speed changes between runs, but not a change of raw MPI's own speed between the
  two processes (the libraries allocate differently before the timed calls);
* ``time``: old time / new time of the same column; the ``raw`` row shows how far raw MPI itself
  moved between the two trees' processes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys

_ROW = re.compile(r"^\s*(\d+(?:\.\d+)?\s+[KMG]iB)\s+\d+\s+\|(.*)$")
_FUSED = re.compile(r"^\s+(one fused all_reduce in strategy.run|one fused RankCommunicator call|same, inplace=True):"
                    r"\s+([\d.]+) ms\s+\(([\d.]+)x faster")


def run_once(tree: str, ranks: int, extra: list[str], mpiexec: str) -> dict[str, tuple[float, float]]:
    """``{"<size> <column>": (ratio to raw, time), ...}`` of one run of ``tree``'s benchmark (fused rows:
    (speed-up over 100 raw calls, time))."""
    # _tree_shim first: where mpistrat is installed in editable mode, it makes PYTHONPATH win.
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tree_shim")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim, os.path.abspath(tree)]))
    cmd = [mpiexec, "--bind-to", "core", "-n", str(ranks), sys.executable,
           os.path.join(tree, "benchmarks", "allreduce.py")] + extra
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    result: dict[str, tuple[float, float]] = {}
    columns: list[str] = []
    for line in out.stdout.splitlines():
        if line.strip().startswith("size "):
            columns = [c.split()[0] for c in line.split("|")[1:]]
            continue
        m = _ROW.match(line)
        if m:
            size, cells = m.group(1), m.group(2).split("|")
            for name, cell in zip(columns, cells):
                fields = cell.split()
                if name == "auto":
                    continue
                ratio = 1.0 if name == "raw" else float(fields[-2])  # the ratio of medians
                result[f"{size} {name}"] = (ratio, float(fields[0]))
            continue
        m = _FUSED.match(line)
        if m:
            result[f"100 x 4 KiB {m.group(1)}"] = (float(m.group(3)), float(m.group(2)))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--columns", default="strategy,window")
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="64M")
    args = parser.parse_args(argv)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    extra = ["--columns", args.columns, "--min-size", args.min_size, "--max-size", args.max_size]
    for ranks in args.ranks:
        runs: dict[str, list[dict[str, tuple[float, float]]]] = {"old": [], "new": []}
        for k in range(args.runs):
            for label, tree in (("old", args.old), ("new", args.new)):
                runs[label].append(run_once(tree, ranks, extra, mpiexec))
                print(f"# {ranks} ranks, run {k + 1}/{args.runs}: {label} done", file=sys.stderr, flush=True)
        keys = [key for key in runs["new"][0] if all(key in r for r in runs["old"] + runs["new"])]
        print(f"\n## {ranks} ranks: per run, busbw ratio to raw MPI (old | new), then medians over "
              f"{args.runs} alternated pairs of new/old ratio and old/new time")
        print(f"{'size / column':>45} | {'old runs':>30} | {'new runs':>30} | ratio | time")
        for key in keys:
            old = [r[key] for r in runs["old"]]
            new = [r[key] for r in runs["new"]]
            by_ratio = statistics.median(n[0] / o[0] for o, n in zip(old, new))
            by_time = statistics.median(o[1] / n[1] for o, n in zip(old, new))
            print(f"{key:>45} | {' '.join(f'{v[0]:5.2f}' for v in old):>30} | "
                  f"{' '.join(f'{v[0]:5.2f}' for v in new):>30} | {by_ratio:5.2f} | {by_time:5.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
