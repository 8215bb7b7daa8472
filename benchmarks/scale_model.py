"""Latency-bandwidth model of the all-reduce paths: fitted on 2-rank runs, checked on held-out ones, projected.

    mpiexec -bind-to core -n 2 python benchmarks/scale_model.py --measure      # the run the fit uses
    mpiexec -bind-to user:0,0 -n 2 python benchmarks/scale_model.py --measure  # fitted too: both on one core
    mpiexec -bind-to core -n 4 python benchmarks/scale_model.py --measure      # held out: 4 ranks
    MPISTRAT_PRETEND_NODES=2 mpiexec -bind-to core -n 4 python benchmarks/scale_model.py --measure
    python benchmarks/scale_model.py --predict [--net-latency-us 1.2] [--net-gbps 192]
    python benchmarks/scale_model.py --all      # the four runs above, in rounds, then --predict (about 8 minutes)

``--measure`` times, with ``allreduce.py``'s method (warm-up; calls interleaved in a new random order
per iteration, each after a barrier; the slowest rank's time; the median over iterations), for
float32 sizes 4 KiB..64 MiB, in ``--repeats`` sweeps, each over the sizes in a new random order
(the same on every rank): a slow spell of the machine falls on scattered sizes, not on a range.
``--append`` adds the sweeps to the layout's earlier ones in ``--data``; ``--all`` measures the
four layouts ``--rounds`` times in turn, so that each layout's sweeps come from several moments.
The paths and probes:

* ``mpi``: raw ``Allreduce(IN_PLACE)``, MPI within the machine, on a private array of 4 KiB pages
  (:func:`private_region`, as the window's memory);
* ``window``: the shared-memory window engine, ``ShmTransport`` on a bucket already packed, the
  reduce-scatter at every size, its result left in the window (``allreduce.py``'s window column);
  on pretend nodes, the hierarchical path;
* ``mpi_waited`` and ``mpi_beside_waited``: ``Iallreduce(IN_PLACE)`` of node shared memory completed by the
  library's ``Waiter``, as the hierarchical path's slice owners run their exchange, and ``Allreduce(IN_PLACE)``
  of the same memory, interleaved with each other after the sweeps, up to 1 MiB, once per ``--measure``
  (never among the judged paths, whose times it disturbs); fit inputs, judged nowhere;
* probes of the machine, no communication: ``shm_pass`` and ``private_pass`` (``np.add(a, b,
  out=a)`` over the halves of an n-byte region of node shared memory / of a private region, both on 4 KiB
  pages and written before the sweeps, every rank at once) and ``fault`` (first touch of a fresh n-byte
  private anonymous mapping, up to 1 MiB, once per ``--measure``, after the sweeps: one value per round,
  not per sweep).

It merges the layout's sweep medians into ``--data`` (JSON, one entry per layout). ``--predict`` needs
no MPI: it takes per size the least of its sweeps (``--statistic min``, the default: the model has no
term for other programs on the machine, and they only ever add time; this VM's speed changes up to 3x
between sweeps, benchmarks/README.md) or their median, fits each path on the 2-rank runs up to 1 MiB
only (a core per rank; both ranks on one core), predicts every other measurement (2 ranks above
1 MiB, 4 ranks, 4 ranks on 2 pretend nodes; the same-core run is a fit input, like the probes, and
is not judged) with its error, prints how many predictions fall within 20% under both statistics,
and projects the flat and the hierarchical path to clusters. Each path's form follows its code (benchmarks/README.md,
"scale_model.py", has the sources):

* window, one node: two node synchronisations (``a_w`` each) and, per rank, the bytes its reduce
  plan writes (``window_writes``, from ``make_plan``, block by block): on two ranks its slice of the
  two segments summed (n/2) and pushed into the other (n/2); on p ranks the first two segments' slices
  summed and each later one added ((p-1) n/p), the slice pushed into the p-1 others ((p-1) n/p), and
  from local rank 2 up, summed aside, copied back (n/p): ``2 a_w + b_w w n``, w = 1 on two ranks, 1.5
  and 1.75 on four;
* MPI within a node: MPICH's reduce-scatter + all-gather (Rabenseifner), ``log2 p`` steps each way,
  step k sending ``n / 2^k`` bytes (``a_m + b_m x``: a step of 8 KiB or more is a kernel copy after a
  handshake, its line fitted from 64 KiB all-reduces up, a shorter one goes through MPICH's shared
  cells with a latency of its own) and the reduce-scatter summing them, plus the first-touch faults of
  the ``n / 2`` bytes MPICH's scratch buffer receives, from 32 MiB (glibc maps allocations above its
  largest mmap threshold afresh on every call);
* hierarchical: the window's reduce-scatter per node, each slice owner's ``n / p`` bytes of window
  all-reduced with MPI across the nodes (its sums into the window at the shared-memory probe's cost; on
  pretend nodes its copies growing beyond the fit as MPI's do; across a network, the link's; plus what
  the library's wait adds per call, ``mpi_waited``'s less ``mpi_beside_waited``'s), the push;
* ranks that outnumber the machine's cores (4 on 2, numbered round robin over the cores as hydra's
  ``-bind-to core`` places them): each core runs its ranks' work one after the other; a node
  synchronisation costs the hand-over of the core besides ``a_w``, and a byte their plans write the
  same-core run's cost (both fitted on the run with both ranks on one core) or, where more, the probe's
  extra at their working set, which counts the ranks per core (``layout_ws``: they share its caches; MPI's
  copies and sums of its own buffers grow at the machine's working set); an MPI
  step between ranks of two cores is each core's ranks' steps one after the other, a step between ranks
  of one core (ranks 2^(k-1) apart, a multiple of the cores) the same-core run's step, and the library's
  wait of such a pair the same-core run's.

Two variants are checked: ``alpha-beta`` (constant per-byte costs) and ``+cache`` (beyond the fit's
working set, a byte the window writes or a sum reads costs what the probe's pass costs more there than
at the fit's largest, on top of its fitted cost, and a byte MPI copies twice that, every buffer being on
4 KiB pages: the fit's sizes stay in cache, the held-out ones do not). The projection uses ``+cache``.

The network's latency and bandwidth are parameters. The defaults are a published HDR InfiniBand
figure, not measured or validated here: Microsoft's HBv3-series performance page gives 1.2 us
(1 byte) and 192 Gb/s one way (OSU ``osu_latency`` / ``osu_bw``) on 200 Gb/s HDR InfiniBand
(https://learn.microsoft.com/azure/virtual-machines/hbv3-performance).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

SIZES = [4096 << i for i in range(15)]  # 4 KiB .. 64 MiB, float32
FIT_MAX = 1 << 20  # the fit uses the 2-rank run up to this size
CHECK_MIN = 64 << 10  # predictions are judged from this size up
TARGET = 0.20  # the bound on a prediction's relative error
SAME_CALL_BOUND = (1 + TARGET) / (1 - TARGET)  # two measurements further apart: no prediction within TARGET of both
FAULT_FIT_MIN = 256 << 10  # below, a mapping's fixed cost hides the faults
PAGE = 4096
# glibc (mallopt(3), M_MMAP_THRESHOLD): the dynamic threshold never rises above 4 MiB * sizeof(long),
# so allocations of 32 MiB and more are mapped, first touched and unmapped on every call.
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
# MPICH's collective selection (maint/tuning/coll/ch4/generic.json, src/mpi/coll/coll_selection.json):
# across nodes a commutative all-reduce of at most 32 KiB takes the node-aware composition (node
# reduce, all-reduce of the node leaders, node broadcast); above, the flat reduce-scatter + all-gather.
MPICH_COMPOSITION_MAX = 32 << 10
# coll_selection.json: recursive doubling up to these sizes, reduce-scatter + all-gather above (built-in ops)
MPICH_ALLREDUCE_SHORT = 8
MPICH_IALLREDUCE_SHORT = 2048
MPICH_REDUCE_SHORT = 2048  # binomial reduce up to it, reduce-scatter + gather above
MPICH_BINOMIAL_BCAST_MAX = 12288  # coll_selection.json: binomial broadcast below it (and below 8 ranks)
# MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD: a message of at least this many bytes between ranks of a node is
# copied once, by the kernel (CMA, after a handshake); a shorter one goes through MPICH's shared cells.
MPICH_CMA_MIN = 8192
# MPI's kernel-copy line (latency, cost per byte) is fitted from this size, the first the issue judges, so that
# the held-out sizes continue the larger steps' line (benchmarks/README.md, eighteenth session). The 16 and 32 KiB
# all-reduces (kernel copies of 8 and 16 KiB) are not fitted.
MPI_LINE_MIN = CHECK_MIN
DEFAULT_NET_LATENCY_US = 1.2  # HBv3, HDR InfiniBand, osu_latency, 1 byte (module docstring)
DEFAULT_NET_GBPS = 192.0  # HBv3, HDR InfiniBand (200 Gb/s line rate), osu_bw, one way
DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale_model.json")
PATHS = ("mpi", "window")
PROBES = ("shm_pass", "private_pass", "fault")
# Fit inputs measured in every layout after the sweeps, beside each other: an Iallreduce of shared memory completed by
# the library's wait, and an Allreduce of the same memory; their difference is what the wait adds to an MPI call.
WAITED = "mpi_waited"
WAIT_REFERENCE = "mpi_beside_waited"
MEASURED = list(PATHS) + list(PROBES) + [WAIT_REFERENCE, WAITED]  # what --measure times, recorded with each run
ROTATED_WAIT = ["mpi", "window", WAITED, "shm_pass", "private_pass", "fault"]  # the seventeenth session's MEASURED
FIT_LAYOUT = "2 ranks, 1 node"
SAME_CORE_LAYOUT = "2 ranks, 1 node, one core"  # fitted too: what ranks that share a core pay
# How the fault probe is taken, recorded with each run: before e8d4a94 it mapped shared pages (shmem,
# about twice a private page's fault) among the timed paths, and such a file's runs lack the field.
FAULT_PROBE = "private pages, after the sweeps"
STATISTICS = ("min", "median")  # of a size's sweeps
SWEEP_ORDER_SEED = 20261127  # the sizes' order in sweep k: the same on every rank


def human(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def layout_key(ranks: int, nodes: int, pretend: bool, one_core: bool = False) -> str:
    """The data file's key of a layout: ``"4 ranks, 2 pretend nodes"``, ``"2 ranks, 1 node, one core"``."""
    return f"{ranks} ranks, {nodes} {'pretend ' if pretend else ''}node{'s' if nodes > 1 else ''}" + (
        ", one core" if one_core else "")


# -- measuring (under mpiexec) --------------------------------------------------------------------
def private_region(nbytes: int) -> np.ndarray:
    """``nbytes`` of private float32 memory on 4 KiB pages, every page written.

    A fresh ``np.zeros`` per size lies on huge pages or not by the allocator's history (NumPy advises
    arrays of 4 MiB and more onto them): a 4 MiB array had 24-50% of its pages huge, an 8 or 16 MiB one
    50-100%, in one process, and MPI's copies cost up to 1.4 times more on 4 KiB pages (benchmarks/README.md).
    Slices of this region lie on 4 KiB pages at every size, as the window's memory and MPICH's scratch
    buffer do, the same in every run."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)  # Linux's; --measure runs on Linux only (os.sched_getaffinity)
    array = np.frombuffer(region, dtype=np.float32)
    array.fill(0)  # a page never written reads as the kernel's zero page (in cache at any size)
    return array


def shared_region(machine: Any, nbytes: int) -> tuple[np.ndarray, Any]:
    """This rank's ``nbytes`` of node shared memory (float32, every page written now, not in a timed call), and
    the window to free afterwards."""
    from mpi4py import MPI

    win = MPI.Win.Allocate_shared(nbytes, 4, comm=machine)
    region = np.frombuffer(win.tomemory(), dtype=np.float32)
    region[:] = 0
    return region, win


def _memory_probes(machine: Any, max_bytes: int) -> tuple[Callable, Callable, Callable, Any]:
    """Setups ``size -> callable`` of the three probes, and the shared window to free afterwards."""
    shared, win = shared_region(machine, max_bytes)
    private = private_region(max_bytes)

    def halves(buf: np.ndarray, size: int) -> Callable[[], None]:
        a, b = buf[: size // 8], buf[size // 8 : size // 4]
        return lambda: np.add(a, b, out=a)  # zeros: stays finite

    def fault(size: int) -> Callable[[], None]:
        def touch() -> None:
            # private, as glibc maps MPICH's scratch buffer: a shared mapping's pages are shmem's, which
            # fault in at about twice the cost here (4 against 2 us per page)
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = np.frombuffer(m, dtype=np.uint8)
            view[::PAGE] = 1
            del view
            m.close()

        return touch

    return (lambda size: halves(shared, size)), (lambda size: halves(private, size)), fault, win


def measure(args: argparse.Namespace) -> int:
    """Time the paths and probes of this layout and merge the medians into ``args.data`` (collective)."""
    from allreduce import choose_iters, samples  # the benchmarks' one method
    from mpi4py import MPI

    from mpistrat.comm.transport.shm.allreduce import ShmTransport

    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        raise SystemExit("scale_model.py --measure: run it under mpiexec with 2 or more ranks")
    problem = _data_problem(args.data) if world.Get_rank() == 0 else None
    problem = world.bcast(problem, root=0)  # every rank stops, before any measurement, on rank 0's problem
    if problem:
        raise SystemExit(f"scale_model.py --measure: {problem}")
    sizes = [s for s in SIZES if s <= args.max_size]
    window = ShmTransport(world, min_bytes=0, max_bytes=max(sizes))
    window.direct_max_bytes = -1  # the engine: the reduce-scatter at every size, as allreduce.py's window column
    lay = window.layout
    machine = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    affinity = world.allgather(sorted(os.sched_getaffinity(0)))  # per rank, in rank order
    cores = len(set().union(*machine.allgather(os.sched_getaffinity(0))))
    machine_ranks = machine.Get_size()
    key = layout_key(world.Get_size(), lay.num_nodes, lay.pretend, one_core=cores == 1)
    facts = {"ranks": world.Get_size(), "nodes": lay.num_nodes, "local": lay.local_size, "machine_ranks": machine_ranks,
             "cores": cores, "sizes": sizes, "window": window.describe(),
             "mpi_library": MPI.Get_library_version().splitlines()[0].strip(), "commit": _commit(),
             "fault_probe": FAULT_PROBE, "measured": MEASURED}
    stored = 0  # sweeps of this layout already in the file (--append): the next sweep's order follows them
    if args.append:
        problem, stored = world.bcast(_append_state(args.data, key, facts) if world.Get_rank() == 0 else None, root=0)
        if problem:
            window.close()
            machine.Free()
            raise SystemExit(f"scale_model.py --measure --append: {problem}")
    shm_probe, private_probe, fault_probe, probe_win = _memory_probes(machine, max(sizes))
    mpi_region = private_region(max(sizes))  # MPI's buffer at every size: on 4 KiB pages, whatever ran before
    waited_region, waited_win = shared_region(machine, max(sizes))  # as the slice owners' window memory
    names = facts["measured"]
    medians: dict[str, list[list[float]]] = {name: [[] for _ in sizes] for name in names}
    iters: list[list[int]] = [[] for _ in sizes]
    say = print if world.Get_rank() == 0 else (lambda *a, **k: None)
    load_before = os.getloadavg()
    say(f"# scale_model --measure: {key} ({lay.local_size} per node), {machine_ranks} ranks on {cores} cores; "
        f"{args.repeats} sweeps, {args.budget} s per size", flush=True)
    started = time.time()
    for sweep in range(args.repeats):
        for i in np.random.default_rng([SWEEP_ORDER_SEED, stored + sweep]).permutation(len(sizes)).tolist():
            size = sizes[i]
            count = size // 4
            buf = mpi_region[:count]

            def mpi(buf: np.ndarray = buf) -> None:
                world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)

            def engine(count: int = count) -> None:
                window.pack_buffer(count, np.float32)
                window.allreduce_packed(count, np.float32, "sum")

            fns = {"mpi": mpi, "window": engine, "shm_pass": shm_probe(size), "private_pass": private_probe(size)}
            calls = list(fns.values())
            n_iter = choose_iters(world, calls, args.budget)
            times = samples(world, calls, n_iter)
            for j, name in enumerate(fns):
                medians[name][i].append(statistics.median(times[:, j]))
            iters[i].append(n_iter)
            say(f"  sweep {sweep + 1}/{args.repeats} {human(size):>9}: "
                + " ".join(f"{name} {medians[name][i][-1] * 1e6:.1f}" for name in fns) + " us", flush=True)
    # The library's wait after the sweeps, never among the judged paths, whose times it disturbs
    # (benchmarks/README.md, eighteenth session). At the fit's sizes, the only ones the fit reads.
    for i, size in enumerate(sizes):
        if size <= FIT_MAX:
            region = waited_region[: size // 4]

            def beside(buf: np.ndarray = region) -> None:
                world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)

            def waited(buf: np.ndarray = region) -> None:
                request = world.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
                window.waiter.until(request.Test)  # as the transport waits (its timeout: none here)

            pair = [beside, waited]
            times = samples(world, pair, choose_iters(world, pair, args.budget))
            for j, name in enumerate((WAIT_REFERENCE, WAITED)):
                medians[name][i].append(statistics.median(times[:, j]))
            say(f"  the wait {human(size):>9}: {WAIT_REFERENCE} {medians[WAIT_REFERENCE][i][-1] * 1e6:.1f} "
                f"{WAITED} {medians[WAITED][i][-1] * 1e6:.1f} us", flush=True)
    # The fault probe after the sweeps, never among the timed paths: a call finds the caches as the call
    # before left them (allreduce.py, samples), and the probe's fresh pages would evict the paths' buffers
    # only at the sizes it runs at (up to 1 MiB), the fit's.
    for i, size in enumerate(sizes):
        if size <= FIT_MAX:
            probe = [fault_probe(size)]
            n_iter = choose_iters(world, probe, args.budget)
            medians["fault"][i].append(statistics.median(samples(world, probe, n_iter)[:, 0]))
    run = {
        **facts, "pretend": lay.pretend, "affinity": affinity,
        "median_s": {name: [statistics.median(v) if v else None for v in medians[name]] for name in names},
        "sweeps_s": medians, "iterations": iters,
        "numpy": np.__version__, "when_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "seconds": round(time.time() - started, 1), "load_average": [load_before, os.getloadavg()],
        "argv": sys.argv,
    }
    window.close()
    probe_win.Free()
    waited_win.Free()
    machine.Free()
    if world.Get_rank() == 0:
        _merge(args.data, key, run, args.append)
        say(f"# {key}: {run['seconds']} s, {'added to' if args.append else 'written to'} {args.data}")
    return 0


def _data_problem(path: str) -> str | None:
    """Why the measurements could not be merged into ``path`` (None: they can)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.access(folder, os.W_OK):
        return f"cannot write into {folder} (--data {path})"
    if os.path.exists(path):
        try:
            load_data(path)
        except ValueError as exc:
            return str(exc)
    return None


def _commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it ("" outside git)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


def _merge(path: str, key: str, run: dict[str, Any], append: bool = False) -> None:
    """Replace ``key``'s entry of the data file (created when missing), or with ``append`` add the run's
    sweeps to the entry's (same sizes and layout), atomically."""
    data: dict[str, Any] = {"format": 1, "runs": {}}
    if os.path.exists(path):
        data = load_data(path)
    earlier = data["runs"].get(key)
    if append and earlier is not None:
        run = _appended(earlier, run)
    data["runs"][key] = run
    for entry in data["runs"].values():
        entry.pop("time_s", None)  # load_data's, derived from the sweeps
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


_LAYOUT_FIELDS = ("ranks", "nodes", "local", "machine_ranks", "cores", "sizes")
# the same on every round of a layout
_APPEND_FIELDS = _LAYOUT_FIELDS + ("window", "mpi_library", "commit", "fault_probe", "measured")
_ROUND_FIELDS = ("when_utc", "seconds", "load_average", "argv", "affinity")


def _mismatch(earlier: dict[str, Any], facts: dict[str, Any]) -> str | None:
    """Why sweeps of a run with ``facts`` cannot join the entry ``earlier`` (None: they can)."""
    for field in _APPEND_FIELDS:
        if earlier.get(field) != facts.get(field):
            return (f"the data file's run has {field}={earlier.get(field)!r}, this one {facts.get(field)!r}; "
                    "measure without --append")
    return None


def _append_state(path: str, key: str, facts: dict[str, Any]) -> tuple[str | None, int]:
    """Before measuring with ``--append``: why this run's sweeps could not join ``key``'s entry of ``path``
    (None: they can), and how many sweeps the entry holds (0: no entry yet)."""
    earlier = load_data(path)["runs"].get(key) if os.path.exists(path) else None
    if earlier is None:
        return None, 0
    return _mismatch(earlier, facts), len(earlier["sweeps_s"]["mpi"][0])


def _appended(earlier: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``earlier`` with ``run``'s sweeps added: medians over all sweeps, each round's facts kept."""
    problem = _mismatch(earlier, run)
    if problem:
        raise ValueError(f"--append: {problem}")
    merged = dict(run)
    merged["sweeps_s"] = {name: [a + b for a, b in zip(earlier["sweeps_s"][name], sweeps)]
                          for name, sweeps in run["sweeps_s"].items()}
    merged["iterations"] = [a + b for a, b in zip(earlier["iterations"], run["iterations"])]
    merged["median_s"] = {name: [statistics.median(v) if v else None for v in sweeps]
                          for name, sweeps in merged["sweeps_s"].items()}
    merged["rounds"] = earlier.get("rounds", [{f: earlier.get(f) for f in _ROUND_FIELDS}])
    merged["rounds"] = merged["rounds"] + [{f: run.get(f) for f in _ROUND_FIELDS}]
    for field in ("when_utc", "load_average", "argv"):  # the entry's own: its first round's
        merged[field] = earlier.get(field)
    merged["seconds"] = round(sum(r["seconds"] or 0 for r in merged["rounds"]), 1)
    return merged


def load_data(path: str, statistic: str = "min") -> dict[str, Any]:
    """The data file, checked for the fields ``--predict`` reads (ValueError naming what is missing), with
    each run's ``time_s``: per path or probe and size, the ``statistic`` of its sweeps."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no measurements; run {_MEASURE_HINT}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != 1 or not isinstance(data.get("runs"), dict):
        raise ValueError(f"{path}: not a scale_model.py data file (expected {{'format': 1, 'runs': {{...}}}})")
    for key, run in data["runs"].items():
        missing = [f for f in _LAYOUT_FIELDS + ("sweeps_s",) if f not in run]
        missing += [f"sweeps_s.{p}" for p in PATHS if p not in run.get("sweeps_s", {})]
        if missing:
            raise ValueError(f"{path}: run {key!r} lacks {', '.join(missing)}; measure it again")
        run["time_s"] = sweep_statistic(run["sweeps_s"], statistic)
    return data


def sweep_statistic(sweeps_s: dict[str, list[list[float]]], statistic: str) -> dict[str, list[float | None]]:
    """Per name and size, the least (``min``) or the median of the sweeps' times (None: never measured)."""
    take = {"min": min, "median": statistics.median}[statistic]
    return {name: [take(v) if v else None for v in per_size] for name, per_size in sweeps_s.items()}


_MEASURE_HINT = "mpiexec -bind-to core -n 2 python benchmarks/scale_model.py --measure (or --all)"
_SAME_CORE_HINT = ("measure it: mpiexec -bind-to user:C,C -n 2 python benchmarks/scale_model.py --measure, "
                   "C a core this job may use (or --all)")
_NO_SAME_CORE = f"ranks that share a core need the {SAME_CORE_LAYOUT!r} run; {_SAME_CORE_HINT}"


# -- the model ------------------------------------------------------------------------------------
@dataclass
class Machine:
    """What the fit run measured of its machine, beside the all-reduces.

    ``ws``: machine working sets (bytes: both ranks' regions) at which ``shm`` and ``private``, the
    seconds per byte of one rank's pass over its region (node shared memory with 4 KiB pages, like the
    window; a private region on 4 KiB pages, like MPI's buffer, :func:`private_region`), were measured;
    ``fault``: seconds per byte first touched; ``constant``: per-byte costs never grow with the working set
    (the plain alpha-beta model).
    """

    ws: np.ndarray
    shm: np.ndarray
    private: np.ndarray
    fault: float
    constant: bool

    def pass_cost(self, kind: str, ws: float) -> float:
        """Seconds per byte of a pass over memory of ``kind`` at machine working set ``ws``, interpolated
        in log2(ws), the nearest measured value outside the measured range."""
        costs = self.shm if kind == "shm" else self.private
        return float(np.interp(math.log2(max(ws, 1.0)), np.log2(self.ws), costs))

    def extra(self, kind: str, ws: float) -> float:
        """Seconds a byte of a pass over memory of ``kind`` costs more at working set ``ws`` than at the
        fit's largest (``2 * FIT_MAX``), never below 0; always 0 for the plain model. Added to a fitted
        cost per byte, not multiplied into it: that cost holds more than the memory's (the window's
        Python calls, its blocks summed in cache), which the cache's misses do not grow."""
        if self.constant or ws <= 2.0 * FIT_MAX:
            return 0.0
        return max(0.0, self.pass_cost(kind, ws) - self.pass_cost(kind, 2.0 * FIT_MAX))

    @classmethod
    def from_run(cls, run: dict[str, Any], constant: bool) -> Machine:
        """The fit run's probes (at size n, two ranks pass over n bytes each: a working set of 2n)."""
        med = run["time_s"]
        for probe in PROBES:
            if probe not in med:
                raise ValueError(f"run {FIT_LAYOUT!r} lacks the {probe} probe; measure it again")
        sizes = np.array(run["sizes"], dtype=float)
        shm = np.array(med["shm_pass"], dtype=float) / sizes
        private = np.array(med["private_pass"], dtype=float) / sizes
        faults = [t / s for s, t in zip(run["sizes"], med["fault"]) if t is not None and FAULT_FIT_MIN <= s <= FIT_MAX]
        if not faults:
            raise ValueError(f"run {FIT_LAYOUT!r} has no fault probe between {human(FAULT_FIT_MIN)} and "
                             f"{human(FIT_MAX)}; measure it again")
        return cls(2 * sizes, shm, private, statistics.median(faults), constant)


@dataclass
class Network:
    """Between nodes: ``latency`` seconds per message, ``bandwidth`` bytes/s of a node's link."""

    latency: float
    bandwidth: float


def _message_step(x: float, a: float, a_eager: float | None, b: float) -> float:
    """An MPI message step of ``x`` bytes: the kernel copy's latency ``a`` from ``MPICH_CMA_MIN`` bytes, the
    shared cells' ``a_eager`` below (None: ``a``), and ``b`` per byte."""
    return (a if x >= MPICH_CMA_MIN or a_eager is None else a_eager) + b * x


def window_writes(local: int, local_rank: int) -> float:
    """Bytes the window's reduce plan (``mpistrat/comm/transport/shm/plan.py``, ``make_plan``) has node rank
    ``local_rank`` of ``local`` write per byte of the bucket, every local rank owning a slice and the result
    left in the window (``allreduce_packed`` without ``out``, as measured), block by block: on two ranks its
    slice of the two segments summed (n/2) and pushed into the other segment (n/2); on p ranks the first two
    segments' slices summed and each later one added (p-1 sums of n/p), the slice pushed into the p-1
    others ((p-1) n/p), and where it sums aside (``sums_aside``: local rank 2 and up, whose
    own segment comes later in the summing order), copied back (n/p)."""
    if local < 2:
        return 0.0
    aside = 1.0 / local if local > 2 and local_rank >= 2 else 0.0
    return 2.0 * (local - 1) / local + aside


def layout_ws(n: float, ranks: int, cores: int) -> float:
    """The working set at which the per-byte costs of work on window memory (the plans, the slice owners' exchange)
    of ``ranks`` on ``cores`` cores, each all-reducing ``n`` bytes, grow: the machine's (``ranks * n``) times the
    ranks that share a core, as they share its caches. MPI's copies and sums of its own buffers grow at the
    machine's (benchmarks/README.md, nineteenth session)."""
    return ranks * n * max(1, ranks // cores)


def core_load(local: int, ranks: int, cores: int) -> float:
    """The most bytes per byte of the bucket that one core's ranks write, one after the other, when
    ``ranks`` in nodes of ``local`` sit round robin on ``cores`` cores (hydra's ``-bind-to core``: rank r
    on core ``r % cores``; ranks numbered node by node)."""
    loads = [0.0] * min(cores, ranks)
    for r in range(ranks):
        loads[r % cores] += window_writes(local, r % local)
    return max(loads)


@dataclass
class Model:
    """Both paths' fitted parameters on one machine's costs.

    ``a_window``: seconds per node synchronisation; ``b_window``: seconds per byte a rank's reduce plan
    writes (:func:`window_writes`: n on two ranks, its slice summed, then pushed into the other);
    ``a_mpi``: seconds per MPI message step of ``MPICH_CMA_MIN`` bytes or more (the kernel's copy and
    its handshake); ``a_eager``: per shorter step (MPICH's shared cells; None: ``a_mpi``); ``b_mpi``:
    seconds per byte sent. Summing a received ``x`` bytes costs the probe's pass over ``2 x`` bytes of its
    memory (:meth:`reduce`); per-byte costs grow with the working set beyond the fit's (:meth:`Machine.extra`).

    Fitted on the 2-rank run with both ranks on one core (None without it), as the fit run's:
    ``a_window_core``, seconds per node synchronisation of ranks that share a core (the hand-over of the
    core); ``b_window_core``, seconds per byte the plans of ranks that share a core write, one after the
    other, within the cache (their blocks share the core's caches: :meth:`window_byte`); ``a_core``,
    ``b_core``, ``a_core_eager``: an MPI message step between two ranks of one core (both ranks' copies, on
    that core), as ``a_mpi``, ``b_mpi``, ``a_eager``.

    ``wait``, ``wait_core``: seconds the library's way of completing an MPI all-reduce (``Iallreduce`` polled by
    its ``Waiter``) adds per call to MPI's own, a core per rank and (the same-core run's) two ranks on one
    core (:func:`_wait_extra`: a measured difference, below 0 where the waited call is the faster; 0 from a run
    that did not measure it; ``wait_core`` None without the same-core run).
    """

    machine: Machine
    a_window: float
    b_window: float
    a_mpi: float
    b_mpi: float
    a_eager: float | None = None
    a_window_core: float | None = None
    b_window_core: float | None = None
    a_core: float | None = None
    b_core: float | None = None
    a_core_eager: float | None = None
    wait: float = 0.0
    wait_core: float | None = None
    scratch_faults: bool = True  # False: as with MALLOC_MMAP_MAX_=0 (MPICH's scratch buffer stays mapped)

    # -- one machine (all ranks share its memory) --
    def window_byte(self, ws: float, shared_core: bool = False) -> float:
        """Seconds per byte the window's reduce plan writes at machine working set ``ws``, by a rank with a core
        of its own or (``shared_core``) one that shares its core. Both lose cache the fit's plans had: ranks
        that share a core, as their blocks share its caches (what the same-core run pays more per byte); every
        rank, beyond the fit's working set (the probe's extra). The loss is counted once, the larger of the two."""
        if not shared_core:
            return self.b_window + self.machine.extra("shm", ws)
        if self.b_window_core is None:
            raise ValueError(_NO_SAME_CORE)
        return self.b_window + max(self.b_window_core - self.b_window, self.machine.extra("shm", ws))

    def window_plans(self, n: float, local: int, ranks: int, cores: int, ws: float) -> float:
        """The window's reduce plans of ``ranks`` in nodes of ``local`` on ``cores`` cores (:func:`core_load`),
        between the synchronisations."""
        return core_load(local, ranks, cores) * self.window_byte(ws, shared_core=ranks > cores) * n

    def window_node(self, n: float, local: int, ws: float) -> float:
        """The window's reduce-scatter and push on a node of ``local`` ranks, a core per rank: two node
        synchronisations and the slowest rank's plan."""
        return 2 * self.a_window + self.window_plans(n, local, local, local, ws)

    def mpi_step(self, x: float, ws: float, memory: str = "private") -> float:
        """One MPI message step of ``x`` bytes of ``memory`` between ranks of one machine at machine working set
        ``ws``. MPICH copies a message of ``MPICH_CMA_MIN`` bytes or more once, in the kernel, page by page
        (CMA), after a handshake that a shorter message through its shared cells does without; beyond the
        fit the copy grows (:meth:`copy_growth`)."""
        return _message_step(x, self.a_mpi, self.a_eager, self.b_mpi) + self.copy_growth(memory, ws) * x

    def core_step(self, x: float) -> float:
        """One MPI message step of ``x`` bytes between two ranks of one core, both ranks' copies on it (the
        same-core run's fit; ``mpi_step``'s two protocols)."""
        if self.a_core is None or self.b_core is None:
            raise ValueError(_NO_SAME_CORE)
        return _message_step(x, self.a_core, self.a_core_eager, self.b_core)

    def copy_growth(self, memory: str, ws: float) -> float:
        """Seconds per byte an MPI step's copy of ``memory`` costs more at machine working set ``ws`` than at
        the fit's sizes: a pass over twice the bytes copied (read and written, as :meth:`reduce` charges a
        sum), the probe's extra. Every buffer measured lies on 4 KiB pages (the window's memory, MPICH's
        scratch buffer, and :func:`private_region` for the arrays), whose kernel copies grow beyond the cache."""
        return 2 * self.machine.extra(memory, ws)

    def reduce(self, x: float, ws: float, memory: str = "private") -> float:
        """Summing a received ``x`` bytes into ``x`` bytes of ``memory`` (``private``: a NumPy array; ``shm``:
        the window's segments), the probe's pass over ``2 x`` bytes."""
        return 2 * x * (self.machine.pass_cost(memory, 2.0 * FIT_MAX) + self.machine.extra(memory, ws))

    def mpi_rest(self, n: float, cores: int) -> float:
        """What :meth:`mpi_machine` adds to the two message steps of a 2-rank all-reduce of ``n`` bytes on ``cores``
        (1 or 2) cores: the sum of ``n / 2`` bytes, MPICH's scratch buffer's faults and the copies' growth at the
        machine's working set, for each rank of a core, one after the other."""
        if cores not in (1, 2):
            raise ValueError(f"the 2-rank fit runs on 1 or 2 cores, got {cores}")
        ws = 2 * n
        per_core = 2 // cores
        return per_core * (self.reduce(n / 2, ws) + self.faults(n, 2) + self.copy_growth("private", ws) * n)

    def faults(self, n: float, ranks: int) -> float:
        """MPICH's scratch buffer for the reduce-scatter (``n`` bytes), mapped afresh on every call from
        glibc's largest mmap threshold up: its first step receives ``n / 2`` bytes into it, and every
        later step into part of the region the step before received into, so ``n / 2`` are touched
        whatever the number of ranks."""
        if not self.scratch_faults or n < GLIBC_MMAP_THRESHOLD_MAX or ranks < 2:
            return 0.0
        return self.machine.fault * n / 2

    def mpi_machine(self, n: float, ranks: int, ws: float, per_core: int = 1, cores: int = 1,
                    stride: int = 1, memory: str = "private") -> float:
        """MPICH's reduce-scatter + all-gather over ``ranks`` (a power of two) of one machine, on an array in
        ``memory`` (:meth:`reduce`).

        With ``per_core`` ranks on each of ``cores`` cores (more than one: such all-reduces run on
        every core at once, as every rank's does), world rank r sits on core ``r % cores`` (hydra's
        ``-bind-to core``) and this communicator's ranks are ``stride`` world ranks apart. Step k pairs
        ranks ``2^(k-1)`` apart: on two cores, each core copies for its ``per_core`` ranks one after
        the other; on one core (that distance in world ranks a multiple of ``cores``), each core holds
        ``per_core / 2`` such pairs, each exchange the same-core run's step. Each core sums, and
        faults MPICH's scratch buffer in, for its ``per_core`` ranks. Copies grow beyond the fit
        (:meth:`copy_growth`)."""
        steps = round(math.log2(ranks))
        grow = self.copy_growth(memory, ws)
        t = 0.0
        for k in range(1, steps + 1):
            x = n / 2**k
            if per_core > 1 and (stride * 2 ** (k - 1)) % cores == 0:  # a pair's two copies on its core
                step = per_core / 2 * (self.core_step(x) + 2 * grow * x)
            else:
                step = per_core * self.mpi_step(x, ws, memory)
            t += 2 * step + per_core * self.reduce(x, ws, memory)
        return t + per_core * self.faults(n, ranks)

    def measured_layout(self, path: str, n: float, ranks: int, nodes: int, cores: int) -> float:
        """Predicted time of ``path`` on a layout of this machine: ``ranks`` over ``nodes`` (pretend)
        nodes (ranks numbered node by node), every rank on one machine of ``cores`` cores. Where ranks
        outnumber cores, each core runs its ranks' work one after the other (:meth:`mpi_machine` for
        MPI; for the window, :func:`core_load`), and a node synchronisation costs what it costs between
        two ranks of one core (the hand-over) besides, with ranks on several cores, what it costs between
        two cores. The window's per-byte costs grow at :func:`layout_ws`, MPI's at the machine's working set."""
        if ranks > cores and ranks % cores:
            raise ValueError(f"{ranks} ranks on {cores} cores: the model takes ranks that share cores evenly")
        per_core = max(1, ranks // cores)
        local = ranks // nodes
        if path == "mpi":  # MPI knows nothing of pretend nodes: one machine
            return self.mpi_machine(n, ranks, ranks * n, per_core, cores)
        ws = layout_ws(n, ranks, cores)
        sync = self.a_window if cores > 1 else 0.0
        if per_core > 1:
            if self.a_window_core is None:
                raise ValueError(_NO_SAME_CORE)
            sync += self.a_window_core
        t = 2 * sync + self.window_plans(n, local, ranks, cores, ws)
        if nodes > 1:  # every slice owner all-reduces its n/local bytes of window with its peers on the other nodes
            t += self.mpi_machine(n / local, nodes, ws / local, per_core, cores, stride=local, memory="shm")
            t += self.waited(per_core, cores, stride=local)
        return t

    def waited(self, per_core: int, cores: int, stride: int) -> float:
        """What the library's wait adds to the slice owners' all-reduce (one call per owner, owners ``stride``
        world ranks apart), as :meth:`mpi_machine` places them: where an owner's peer shares its core, each core
        completes its ``per_core / 2`` pairs' calls one after the other at the same-core run's cost, else its
        ``per_core`` owners' calls at the fit run's. A measured difference, so it may be below 0."""
        if per_core > 1 and stride % cores == 0:
            if self.wait_core is None:
                raise ValueError(_NO_SAME_CORE)
            return per_core / 2 * self.wait_core
        return per_core * self.wait

    # -- clusters --
    def net_allreduce(self, x: float, nodes: int, flows: int, ws: float, net: Network, short: int,
                      memory: str = "private") -> float:
        """MPICH's all-reduce of ``x`` bytes of ``memory`` (:meth:`reduce`) over ``nodes`` ranks, one per
        node, while ``flows`` such all-reduces share each node's link: recursive doubling up to ``short``
        bytes, else reduce-scatter + all-gather (with its scratch buffer)."""
        steps = round(math.log2(nodes))
        if steps == 0:
            return 0.0
        if x <= short:
            return steps * (net.latency + flows * x / net.bandwidth + self.reduce(x, ws, memory))
        return sum(2 * (net.latency + flows * (x / 2**k) / net.bandwidth) + self.reduce(x / 2**k, ws, memory)
                   for k in range(1, steps + 1)) + self.faults(x, nodes)

    def flat(self, n: float, ranks: int, per_node: int, net: Network) -> float:
        """``MPI_Allreduce`` over ``ranks`` at ``per_node`` ranks per node (MPICH's own choice)."""
        nodes = ranks // per_node
        ws = per_node * n
        if nodes == 1:
            return self.mpi_machine(n, ranks, ws)
        if n <= MPICH_COMPOSITION_MAX:  # node reduce, leaders' all-reduce, node broadcast
            leaders = self.net_allreduce(n, nodes, 1, ws, net, MPICH_ALLREDUCE_SHORT)
            return self._node_reduce(n, per_node, ws) + leaders + self._node_bcast(n, per_node, ws)
        # Reduce-scatter + all-gather over every rank; step k pairs ranks 2^(k-1) apart, so with the
        # ranks of a node numbered together the first log2(per_node) steps stay in the node, and in the
        # others the node's ranks send their pieces through its link at once.
        t = 0.0
        for k in range(1, round(math.log2(ranks)) + 1):
            x = n / 2**k
            if 2 ** (k - 1) < per_node:
                t += 2 * self.mpi_step(x, ws)
            else:
                t += 2 * (net.latency + per_node * x / net.bandwidth)
            t += self.reduce(x, ws)
        return t + self.faults(n, ranks)

    def _node_reduce(self, n: float, local: int, ws: float) -> float:
        steps = round(math.log2(local))
        if n <= MPICH_REDUCE_SHORT:  # binomial tree
            return steps * (self.mpi_step(n, ws) + self.reduce(n, ws))
        return sum(2 * self.mpi_step(n / 2**k, ws) + self.reduce(n / 2**k, ws) for k in range(1, steps + 1))

    def _node_bcast(self, n: float, local: int, ws: float) -> float:
        steps = round(math.log2(local))
        if local < 8 or n < MPICH_BINOMIAL_BCAST_MAX:  # binomial tree
            return steps * self.mpi_step(n, ws)
        return sum(2 * self.mpi_step(n / 2**k, ws) for k in range(1, steps + 1))  # scatter + all-gather

    def hierarchical(self, n: float, ranks: int, per_node: int, net: Network) -> float:
        """mpistrat's window transport: the node's reduce-scatter, then each slice owner's ``n / per_node``
        bytes of window all-reduced across the nodes (``per_node`` owners sharing the link, each completing its
        call with the library's wait, ``wait``), then the push. With one rank per node the window is off and the
        call is ``flat``."""
        nodes = ranks // per_node
        if per_node == 1:
            return self.flat(n, ranks, per_node, net)
        ws = per_node * n  # the node's; the owners' all-reduce touches their slices, ws / per_node (as measured_layout)
        return self.window_node(n, per_node, ws) + self.net_allreduce(
            n / per_node, nodes, per_node, ws / per_node, net, MPICH_IALLREDUCE_SHORT, memory="shm") + (
            self.wait if nodes > 1 else 0.0)


def _fit_line(x: np.ndarray, rest: np.ndarray, measured: np.ndarray, syncs: float,
              b: float | None = None) -> tuple[float, float]:
    """Least squares of the relative error of ``measured = syncs * a + rest + b * x`` with ``a, b >= 0``
    (``b`` given: ``a`` alone)."""
    if b is not None:
        column = np.full_like(x, syncs) / measured
        target = (measured - rest - b * x) / measured
        return max(0.0, float(column @ target / (column @ column))), b
    design = np.stack([np.full_like(x, syncs), x], axis=1) / measured[:, None]
    target = (measured - rest) / measured
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a < 0 or b < 0:  # the best fit with the offending parameter at zero
        keep = 1 if a < 0 else 0
        column = design[:, keep]
        value = max(0.0, float(column @ target / (column @ column)))
        a, b = (0.0, value) if keep == 1 else (value, 0.0)
    return float(a), float(b)


def _fit_lines(run: dict[str, Any],
               rest_of: Callable[[float], float]) -> tuple[float, float, float, float, float | None]:
    """A 2-rank run's lines up to ``FIT_MAX``: the window's ``a`` and ``b`` (two synchronisations and the bytes
    the plans of the core that runs the most write, :func:`core_load`; within the fit's sizes a byte
    costs ``b``, no extra: exact on the same-core run while its plans' extra cost per byte exceeds the probe's
    extra at its 1 MiB working set, ``layout_ws``, as on the data so far), and MPI's ``a``, ``b``
    and the short steps' latency (None where every step is a kernel copy): one step each way of n/2 bytes
    plus ``rest_of(n)``, the latency and the per-byte cost from the sizes whose steps the kernel copies from
    ``MPI_LINE_MIN`` up, the shorter steps' latency beside them."""
    sizes = np.array(run["sizes"], dtype=float)
    n = sizes[sizes <= FIT_MAX]
    window_t = np.array(run["time_s"]["window"], dtype=float)[: len(n)]
    written = core_load(run["local"], run["ranks"], run["cores"]) * n
    a_w, b_w = _fit_line(written, np.zeros_like(n), window_t, 2)
    mpi_t = np.array(run["time_s"]["mpi"], dtype=float)[: len(n)]
    rest = np.array([rest_of(s) for s in n])
    cma = n / 2 >= MPICH_CMA_MIN
    line = cma & (n >= MPI_LINE_MIN)
    if line.sum() < 2:
        first = max(2 * MPICH_CMA_MIN, MPI_LINE_MIN)
        raise ValueError(f"the fit needs two sizes or more from {human(first)} up to {human(FIT_MAX)}")
    a_m, b_m = _fit_line(n[line], rest[line], mpi_t[line], 2)
    eager = None if cma.all() else _fit_line(n[~cma], rest[~cma], mpi_t[~cma], 2, b=b_m)[0]
    return a_w, b_w, a_m, b_m, eager


def _check_layout(run: dict[str, Any], key: str, one_core: bool) -> None:
    """ValueError unless ``run`` is 2 ranks on one node, with a core per rank or (``one_core``) one core."""
    placed = run["cores"] == 1 if one_core else run["cores"] >= 2
    if run["ranks"] != 2 or run["nodes"] != 1 or run["machine_ranks"] != 2 or not placed:
        where = "both ranks on one core" if one_core else "a core per rank"
        raise ValueError(f"the fit needs the {key!r} run, 2 ranks with {where}, got {run['ranks']} ranks "
                         f"on {run['nodes']} node(s), {run['machine_ranks']} ranks on {run['cores']} cores")


def fit(run: dict[str, Any], constant: bool, core_run: dict[str, Any] | None = None) -> Model:
    """Each path's parameters up to ``FIT_MAX`` from the fit run (2 ranks, one node, a core each) and, when
    given, the same-core run (2 ranks on one core: what ranks that share a core pay)."""
    _check_layout(run, FIT_LAYOUT, one_core=False)
    machine = Machine.from_run(run, constant)
    model = Model(machine, 0.0, 0.0, 0.0, 0.0)
    model.a_window, model.b_window, model.a_mpi, model.b_mpi, model.a_eager = _fit_lines(
        run, lambda s: model.mpi_rest(s, cores=2))
    model.wait = _wait_extra(run)
    if core_run is not None:  # one core runs both ranks' passes, copies, sums and faults
        _check_layout(core_run, SAME_CORE_LAYOUT, one_core=True)
        model.a_window_core, model.b_window_core, model.a_core, model.b_core, model.a_core_eager = _fit_lines(
            core_run, lambda s: model.mpi_rest(s, cores=1))
        model.wait_core = _wait_extra(core_run)
    return model


def _wait_extra(run: dict[str, Any]) -> float:
    """The median, over the sizes up to ``FIT_MAX``, of what ``mpi_waited`` (``Iallreduce`` of shared memory polled
    by the library's waiter) costs more than ``Allreduce`` of the same memory timed beside it (``mpi`` in a file of
    the seventeenth session, which timed the waited call among the paths): a cost per call. Each size's is the
    median of the differences of the times measured together (one pair per round, or per sweep in such a file),
    whatever ``--statistic``: the least of each name could come from different rounds. 0 where the run did not
    measure it (a file from before the seventeenth session)."""
    sweeps = run["sweeps_s"]
    waited = sweeps.get(WAITED) or []
    reference = sweeps.get(WAIT_REFERENCE) or sweeps["mpi"]
    per_size = [statistics.median(w - m for w, m in zip(ws, ms))
                for s, ws, ms in zip(run["sizes"], waited, reference) if s <= FIT_MAX and ws and ms]
    return statistics.median(per_size) if per_size else 0.0


# -- reports --------------------------------------------------------------------------------------
VARIANTS = (("alpha-beta", True), ("+cache", False))


@dataclass
class Check:
    """One measured time next to each variant's prediction."""

    layout: str
    path: str
    size: int
    measured: float
    predicted: list[float]
    fitted: bool  # part of the fit (not a prediction)

    def errors(self) -> list[float]:
        return [p / self.measured - 1 for p in self.predicted]


def checks(data: dict[str, Any], models: Sequence[Model]) -> list[Check]:
    """Every measured time of every layout but the same-core run (a fit input, like the probes) next to
    each model's prediction."""
    out = []
    for key, run in data["runs"].items():
        if key == SAME_CORE_LAYOUT:
            continue
        for path in PATHS:
            for size, t in zip(run["sizes"], run["time_s"][path]):
                if t is None:
                    continue
                pred = [m.measured_layout(path, size, run["ranks"], run["nodes"], run["cores"]) for m in models]
                out.append(Check(key, path, size, t, pred, key == FIT_LAYOUT and size <= FIT_MAX))
    return out


def held_out(found: list[Check]) -> list[Check]:
    """The predictions the issue judges: not part of the fit, from ``CHECK_MIN`` up."""
    return [c for c in found if not c.fitted and c.size >= CHECK_MIN]


def same_call_disagreements(runs: dict[str, Any]) -> list[str]:
    """The judged sizes at which two layouts that ran the same MPI call (the same ranks on the same cores: MPI knows
    nothing of pretend nodes) measured it more than ``SAME_CALL_BOUND`` times apart, so that no prediction can
    lie within ``TARGET`` of both: the machine's speed changed between the runs. Sizes are matched by value, so runs
    of different size lists are compared where they overlap."""
    keys = [key for key in runs if key != SAME_CORE_LAYOUT]
    out = []
    for i, first in enumerate(keys):
        for second in keys[i + 1:]:
            a, b = runs[first], runs[second]
            if (a["ranks"], a["cores"]) != (b["ranks"], b["cores"]):
                continue
            theirs = dict(zip(b["sizes"], b["time_s"]["mpi"]))
            for size, x in zip(a["sizes"], a["time_s"]["mpi"]):
                y = theirs.get(size)
                if size >= CHECK_MIN and x and y and max(x, y) / min(x, y) > SAME_CALL_BOUND:
                    slower, faster = (first, second) if x > y else (second, first)
                    out.append(f"{human(size)}: {max(x, y) / min(x, y):.2f}x slower in {slower!r} than in {faster!r}")
    return out


def print_checks(found: list[Check], statistic: str, say: Callable[..., None]) -> None:
    names = [name for name, _ in VARIANTS]
    say(f"\n## Predictions against measurements (measured: the {statistic} of each size's sweeps; error = "
        "predicted / measured - 1; * = fitted, not predicted)\n")
    say("| layout | path | size | measured (us) | " + " | ".join(f"{n} (us) | error" for n in names) + " |")
    say("|---|---|---|---|" + "---|---|" * len(names))
    for c in found:
        cells = " | ".join(f"{p * 1e6:.1f} | {e:+.0%}" for p, e in zip(c.predicted, c.errors()))
        say(f"| {c.layout} | {c.path} | {human(c.size)}{'*' if c.fitted else ''} | {c.measured * 1e6:.1f} | {cells} |")
    say(f"\nHeld out, from {human(CHECK_MIN)} up: predictions within {TARGET:.0%} of the measurement, per variant")
    groups: dict[tuple[str, str], list[Check]] = {}
    for c in held_out(found):
        groups.setdefault((c.layout, c.path), []).append(c)
    say("\n| layout | path | sizes | " + " | ".join(f"{n}: within | worst" for n in names) + " |")
    say("|---|---|---|" + "---|---|" * len(names))
    for (layout, path), cs in groups.items():
        cells = []
        for v in range(len(names)):
            errs = [c.errors()[v] for c in cs]
            worst = max(errs, key=abs)
            cells.append(f"{sum(abs(e) <= TARGET for e in errs)}/{len(errs)} | {worst:+.0%}")
        say(f"| {layout} | {path} | {human(cs[0].size)}..{human(cs[-1].size)} | {' | '.join(cells)} |")


def project(model: Model, net: Network, sizes: Sequence[int], ranks: Sequence[int], per_node: Sequence[int],
            say: Callable[..., None]) -> None:
    """Time and busbw of the flat and the hierarchical path per size, total ranks and ranks per node."""
    say(f"\n## Projection: flat (MPI_Allreduce, MPICH's algorithms) and hierarchical (the window per node, MPI "
        f"across nodes)\nnetwork {net.latency * 1e6:g} us, {net.bandwidth * 8 / 1e9:g} Gb/s per node (parameters, "
        f"not measured here); the node's costs are this machine's, a core per rank"
        + ("; MPICH's scratch buffer kept mapped (--malloc-knobs)" if not model.scratch_faults else ""))
    for n in sizes:
        say(f"\n### {human(n)}: time flat / hierarchical (us), busbw flat / hierarchical (GB/s), "
            f"speed-up of hierarchical\n")
        say("| ranks | " + " | ".join(f"{p} per node" for p in per_node) + " |")
        say("|---|" + "---|" * len(per_node))
        for r in ranks:
            cells = []
            for p in per_node:
                if p > r:
                    cells.append("")
                    continue
                flat, hier = model.flat(n, r, p, net), model.hierarchical(n, r, p, net)
                bus = 2 * (r - 1) / r * n / 1e9
                cells.append(f"{flat * 1e6:.0f} / {hier * 1e6:.0f}, {bus / flat:.1f} / {bus / hier:.1f}, "
                             f"{flat / hier:.2f}x")
            say(f"| {r} | " + " | ".join(cells) + " |")


def fit_all(runs: dict[str, Any]) -> list[Model]:
    """Each variant's model, fitted on the 2-rank run and, where measured, the same-core run."""
    return [fit(runs[FIT_LAYOUT], constant, runs.get(SAME_CORE_LAYOUT)) for _, constant in VARIANTS]


def within_counts(data: dict[str, Any], statistic: str) -> list[tuple[int, int]]:
    """Per variant: how many held-out predictions of ``data`` (as :func:`load_data` gives it) fall within
    ``TARGET``, of how many, under ``statistic``."""
    runs = {key: dict(run, time_s=sweep_statistic(run["sweeps_s"], statistic)) for key, run in data["runs"].items()}
    found = held_out(checks({"runs": runs}, fit_all(runs)))
    return [(sum(abs(c.errors()[v]) <= TARGET for c in found), len(found)) for v in range(len(VARIANTS))]


def predict(args: argparse.Namespace) -> int:
    data = load_data(args.data, args.statistic)
    runs = data["runs"]
    if FIT_LAYOUT not in runs:
        raise SystemExit(f"{args.data}: no {FIT_LAYOUT!r} run to fit on; run {_MEASURE_HINT}")
    shared = [key for key, run in runs.items() if run["machine_ranks"] > run["cores"] and key != SAME_CORE_LAYOUT]
    if shared and SAME_CORE_LAYOUT not in runs:
        raise SystemExit(f"{args.data}: {', '.join(map(repr, shared))} put ranks on a shared core, which needs the "
                         f"{SAME_CORE_LAYOUT!r} run; {_SAME_CORE_HINT}")
    say = print
    say(f"# scale_model --predict: {args.data}, the {args.statistic} of each size's sweeps")
    for key, run in runs.items():
        rounds = run.get("rounds", [run])
        when = ", ".join(f"{r.get('when_utc') or '?'}" for r in rounds)
        load = ", ".join(f"{r['load_average'][0][0]:.2f}" if r.get("load_average") else "?" for r in rounds)
        say(f"#   {key}: {len(rounds)} round(s) at {when} UTC (load {load}), {len(run['sweeps_s']['mpi'][0])} sweeps, "
            f"commit {run.get('commit') or '?'}, {run['machine_ranks']} ranks on {run['cores']} cores, "
            f"{run.get('mpi_library', '')}")
        if run.get("fault_probe") != FAULT_PROBE:
            say(f"#     its fault probe is not {FAULT_PROBE!r} (a file from before e8d4a94: shared pages, about "
                "twice the fault cost of MPICH's private ones); measure it again")
        if run.get("measured") == ROTATED_WAIT:
            say(f"#     a file of the seventeenth session of issue 23: it timed {WAITED} among the judged paths, which "
                "disturbs their times; measure it again")
        if "measured" not in run:
            say("#     a file from before the seventeenth session of issue 23: its MPI buffers and private probe "
                "lay on huge pages or not by the allocator's history (the model takes 4 KiB pages), and it has "
                f"no {WAITED} path (the library's wait taken as nothing); measure it again")
    models = fit_all(runs)
    say("\n## Fitted on the 2-rank runs up to 1 MiB (a: per node synchronisation or MPI message step; b: per "
        "byte the window's plan writes or MPI sends; sum: per byte summed; the fault and the per-byte growth "
        "come from the probes; waited: what the library's wait adds to an MPI all-reduce, per call; one core: the "
        "run with both ranks on one core, its synchronisation's hand-over, its plans' bytes, its MPI step and "
        "its wait)\n")
    say("| variant | window a (us) | window b (ns/B) | MPI a (us) | MPI a, short steps (us) | MPI b (ns/B) "
        "| sum (ns/B) | fault (us/page) | waited (us) | one core: hand-over (us) | window b (ns/B) | MPI a (us) "
        "| MPI a, short steps (us) | MPI b (ns/B) | waited (us) |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def us(value: float | None, fallback: float | None = None, scale: float = 1e6, digits: int = 2) -> str:
        value = fallback if value is None else value
        return "-" if value is None else f"{value * scale:.{digits}f}"

    for (name, _), m in zip(VARIANTS, models):
        say(f"| {name} | {us(m.a_window)} | {us(m.b_window, scale=1e9, digits=3)} | {us(m.a_mpi)} | "
            f"{us(m.a_eager, m.a_mpi)} | {us(m.b_mpi, scale=1e9, digits=3)} | "
            f"{us(m.reduce(1.0, 0), scale=1e9, digits=3)} | {us(m.machine.fault * PAGE)} | {us(m.wait)} | "
            f"{us(m.a_window_core)} | "
            f"{us(m.b_window_core, scale=1e9, digits=3)} | {us(m.a_core)} | "
            f"{us(m.a_core_eager, m.a_core)} | "
            f"{us(m.b_core, scale=1e9, digits=3)} | {us(m.wait_core)} |")
    print_checks(checks(data, models), args.statistic, say)
    disagreements = same_call_disagreements(runs)
    if disagreements:
        say(f"\nThe same MPI call, measured in two layouts, more than {SAME_CALL_BOUND:.2f}x apart (no "
            f"prediction can lie within {TARGET:.0%} of both; the machine's speed changed between the runs, "
            f"measure again): " + "; ".join(disagreements))
    say(f"\nHeld out, every layout, within {TARGET:.0%}, per statistic of the sweeps: "
        + "; ".join(f"{statistic}: " + ", ".join(f"{name} {k}/{total}" for (name, _), (k, total)
                                                 in zip(VARIANTS, within_counts(data, statistic)))
                    for statistic in STATISTICS))
    net = Network(args.net_latency_us * 1e-6, args.net_gbps * 1e9 / 8)
    models[1].scratch_faults = not args.malloc_knobs
    project(models[1], net, args.project_sizes, args.project_ranks, args.per_node, say)
    return 0


def measure_all(args: argparse.Namespace) -> int:
    """The four measured layouts, one ``mpiexec`` each, then ``--predict``."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("scale_model.py --all: no mpiexec next to this Python or on PATH")
    base = {k: v for k, v in os.environ.items() if k != "MPISTRAT_PRETEND_NODES"}
    common = ["--measure", "--data", args.data, "--repeats", str(args.repeats), "--budget", str(args.budget),
              "--max-size", str(args.max_size)]
    core = min(os.sched_getaffinity(0))  # the same-core run's, one this process may use
    layouts = ((2, None, "core"), (4, None, "core"), (4, 2, "core"), (2, None, f"user:{core},{core}"))
    for round_ in range(args.rounds):  # the first round replaces the layouts' entries, the others add sweeps
        for ranks, pretend, bind in layouts:
            env = dict(base, MPISTRAT_PRETEND_NODES=str(pretend)) if pretend else base
            cmd = [mpiexec, "--bind-to", bind, "-n", str(ranks), sys.executable, os.path.abspath(__file__)] + common
            cmd += ["--append"] if round_ or args.append else []
            prefix = f"MPISTRAT_PRETEND_NODES={pretend} " if pretend else ""
            print(f"# round {round_ + 1}/{args.rounds}: {prefix}{' '.join(cmd)}", flush=True)
            done = subprocess.run(cmd, env=env, timeout=1800, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} exited with {done.returncode}")
    return predict(args)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64K, 1M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value


def _power_of_two(text: str) -> int:
    value = int(text)
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"the model takes powers of two, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="time this layout (under mpiexec)")
    mode.add_argument("--predict", action="store_true", help="fit, check and project from --data (no MPI)")
    mode.add_argument("--all", action="store_true", help="measure the four layouts (mpiexec), then predict")
    parser.add_argument("--data", default=DEFAULT_DATA, help="the measurements (JSON; default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="sweeps over the sizes per measurement")
    parser.add_argument("--append", action="store_true", help="--measure: add the sweeps to the layout's in --data")
    parser.add_argument("--rounds", type=int, default=10, help="--all: measure the four layouts this many times")
    parser.add_argument("--statistic", choices=STATISTICS, default="min",
                        help="--predict: of a size's sweeps, the one fitted and checked (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per size and sweep")
    parser.add_argument("--max-size", type=_size, default=SIZES[-1])
    parser.add_argument("--net-latency-us", type=float, default=DEFAULT_NET_LATENCY_US)
    parser.add_argument("--net-gbps", type=float, default=DEFAULT_NET_GBPS, help="a node's link, Gb/s one way")
    parser.add_argument("--project-sizes", type=_size, nargs="+", default=[16 << 10, 1 << 20, 16 << 20, 64 << 20])
    parser.add_argument("--malloc-knobs", action="store_true",
                        help="project as with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296: MPICH's scratch "
                             "buffer stays mapped (no first-touch faults from 32 MiB)")
    parser.add_argument("--project-ranks", type=_power_of_two, nargs="+", default=[2 << i for i in range(10)])
    parser.add_argument("--per-node", type=_power_of_two, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or args.budget <= 0 or args.net_latency_us < 0 or args.net_gbps <= 0:
        parser.error("--repeats and --rounds must be >= 1, --budget and --net-gbps > 0, --net-latency-us >= 0")
    if args.max_size < FIT_MAX:
        parser.error(f"--max-size must be at least {human(FIT_MAX)} (the fit's range)")
    if args.measure:
        return measure(args)
    if args.all:
        return measure_all(args)
    return predict(args)


if __name__ == "__main__":
    sys.exit(main())
