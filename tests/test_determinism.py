"""Deterministic by default (issue 24): whatever a run decides at start-up, an all-reduce gives the same bits.

What a run decides at start-up, and may decide differently on another run of the same program on the
same ranks: whether its ranks outnumber their cores (the affinity the launcher gave them), whether long
arrays go in chunks (``MPISTRAT_SHM_CHUNK_BYTES=auto`` times it), the L2 size behind the default block
and chunk, where the agreement check runs. None of these may change the order in which values are
summed; the window's size threshold, which does, is a rule of the bucket size (docs/reliability.md,
"Reproducibility"). Each test forces every outcome and compares the bits with one summation order,
on data where another order gives other bits.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat import config
from mpistrat.comm import CommunicationOptions, RankCommunicator
from mpistrat.comm.runtime.topology import topology
from mpistrat.comm.transport import table
from mpistrat.comm.transport.base import NO_AGREEMENT, TransportContext
from mpistrat.comm.transport.shm import allreduce as shm_allreduce
from mpistrat.comm.transport.shm import calibration

REPO = Path(__file__).resolve().parents[1]

# Items per array, so that the arrays cross every size boundary of the host paths: below the window's
# threshold (16 KiB), between it and the one-synchronisation sizes (64 KiB, 256 KiB where ranks outnumber
# cores), the reduce-scatter, and at least CHUNK_MEASURE_MIN (4 MiB), where chunks are measured under auto.
COUNTS = (100, 5_000, 25_000, 150_000, calibration.CHUNK_MEASURE_MIN // 4 + 12_345)

# The settings each start-up outcome leaves (the measurement's two answers: none, or the node's chunk, here
# that of two ranks per machine; an L2 cache of 128 KiB or of 8 MiB behind the default block and chunk; the
# agreement check over MPI; the window at every size).
OUTCOMES = {
    "default": {},
    "chunks-measured": {"MPISTRAT_SHM_CHUNK_BYTES": "auto"},
    "chunks-measured-off": {"MPISTRAT_SHM_CHUNK_BYTES": "0"},
    "chunks-measured-on": {"MPISTRAT_SHM_CHUNK_BYTES": str(config.node_chunk_bytes(2))},
    "small-l2": {"MPISTRAT_SHM_BLOCK_BYTES": "16K", "MPISTRAT_SHM_CHUNK_BYTES": "256K"},
    "large-l2": {"MPISTRAT_SHM_BLOCK_BYTES": "1M", "MPISTRAT_SHM_CHUNK_BYTES": "4M"},
    "agreement-over-mpi": {"MPISTRAT_AGREEMENT": "mpi"},
    "window-at-every-size": {"MPISTRAT_SHM_MIN_BYTES": "0"},
}


def _inputs(rank: int) -> list[np.ndarray]:
    """This rank's float32 arrays: normal values times powers of ten from 1e-3 to 1e3, so that most sums
    round, and round differently when the terms come in another order."""
    rng = np.random.default_rng(2024 + rank)
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for n in COUNTS]


def _in_order(terms: list[np.ndarray]) -> np.ndarray:
    """``((t0 + t1) + t2) + ...`` in float32."""
    out = terms[0] + terms[1]
    for t in terms[2:]:
        out = out + t
    return out


def _pairwise(terms: list[np.ndarray]) -> np.ndarray:
    """Neighbours first: ``(t0 + t1) + (t2 + t3)`` for four terms (MPICH's recursive doubling)."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _one_node(comm: MPI.Comm) -> bool:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


@pytest.fixture
def references(comm):
    """Per array: every rank's data summed in rank order (the node's local-rank order on one node)."""
    if not _one_node(comm):
        pytest.skip("the reference is the local-rank order of one node")
    everyone = comm.allgather(_inputs(comm.rank))
    return [_in_order([mine[i] for mine in everyone]) for i in range(len(COUNTS))]


@pytest.fixture
def defaults(monkeypatch):
    """The library's defaults: no MPISTRAT_SHM_* or pretend nodes from the caller."""
    for name in list(os.environ):
        if name.startswith("MPISTRAT_SHM_") or name in ("MPISTRAT_PRETEND_NODES", "MPISTRAT_AGREEMENT"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(calibration, "CHUNK_DECISIONS", {})  # measured afresh, as in a new run
    return monkeypatch


@pytest.mark.mpi(min_size=2)
def test_the_data_show_a_change_of_order(comm):
    """Another order of the same float32 terms gives other bits for every array here (with three ranks or
    more; with two, every order of a two-term sum is the same: IEEE addition is commutative)."""
    everyone = comm.allgather(_inputs(comm.rank))
    for i in range(len(COUNTS)):
        terms = [mine[i] for mine in everyone]
        in_order, backwards = _in_order(terms), _in_order(terms[::-1])
        if comm.size >= 3:
            assert not np.array_equal(in_order, backwards), COUNTS[i]
        else:
            assert np.array_equal(in_order, backwards)
        if comm.size >= 4:
            assert not np.array_equal(in_order, _pairwise(terms)), COUNTS[i]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_every_start_up_outcome_gives_the_same_bits(comm, defaults, references, outcome):
    """Through the communicator (planning, agreement, transports): one array at a time, and the same
    arrays as packed buckets of two; every outcome gives the local-rank order's bits."""
    for name, value in OUTCOMES[outcome].items():
        defaults.setenv(name, value)
    mine = _inputs(comm.rank)
    with RankCommunicator(comm) as c:
        for x, want in zip(mine, references):
            got = c.allreduce([x], "sum")[0]
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (outcome, x.size, "single")
            half = x.size // 2
            got = np.concatenate(c.allreduce([x[:half], x[half:]], "sum"))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (outcome, x.size, "packed")
            again = x.copy()
            c.allreduce([again], "sum", inplace=True)
            assert np.array_equal(again.view(np.uint32), want.view(np.uint32)), (outcome, x.size, "in place")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("outnumbered", [False, True])
def test_both_answers_of_the_core_count_give_the_same_bits(comm, defaults, references, outnumbered):
    """Whether the ranks outnumber their cores (the launcher's affinity, found at start-up) moves the
    small-bucket transport's limit and the window's one-synchronisation size (256 KiB where they outnumber
    the cores or two share the node, else 64 KiB), never the window's threshold, and never the order: the
    AUTO row built from either answer gives the same bits. Each bucket goes to the first transport of the
    row that takes it, as the planner gives it."""
    split = topology(comm)
    forced = dataclasses.replace(split, oversubscribed=outnumbered)
    dup = comm.Dup()
    ctx = TransportContext(dup, CommunicationOptions(), config.settings(), forced, 60.0)
    transports = table.select(ctx, table.HOST)
    try:
        assert [t.name for t in transports] == ["shm-small", "shm", "mpi"]
        window = transports[1]
        assert window.min_bytes == shm_allreduce.MIN_BYTES
        want_direct = 256 << 10 if outnumbered or forced.layout.local_size == 2 else 64 << 10
        assert transports[0].max_bytes == window.direct_max_bytes == want_direct
        for x, want in zip(_inputs(comm.rank), references):
            chosen = next(t for t in transports if t.enabled(x.nbytes, x.dtype, "sum"))
            assert chosen.name != "mpi", x.nbytes  # every size here stays in local-rank order
            buf = chosen.pack_buffer(x.size, x.dtype)
            buf[...] = x
            packed = np.array(chosen.allreduce_packed(x.size, x.dtype, "sum", NO_AGREEMENT))
            single = np.empty_like(x)
            chosen.allreduce_array(x, single, "sum", NO_AGREEMENT)
            for got in (packed, single):
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (outnumbered, chosen.name, x.size)
    finally:
        for t in transports:
            t.close()
        dup.Free()
        split.free()


def _weights(path: Path) -> dict[str, bytes]:
    """A checkpoint's members (the variables' .npy bytes and the manifest)."""
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name) for name in sorted(z.namelist())}


@pytest.mark.timeout(150)
def test_two_runs_of_the_main_job_give_identical_weights(tmp_path):
    """examples/train.py at 4 ranks (what ``bash scripts/main_job.sh`` runs), twice, with checkpoints: the
    second run with every rank on one CPU (so its ranks outnumber their cores whatever the machine, and
    every timing changes). The saved weights are the same bytes."""
    launcher = Path(sys.executable).with_name("mpiexec")
    if not launcher.exists():
        pytest.skip("no mpiexec next to the Python interpreter (install mpistrat[mpich])")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "MPI_", "SLURM_", "MPISTRAT_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    cpu = min(os.sched_getaffinity(0))
    saved = []
    for run, pin in enumerate((False, True)):
        ckpt = tmp_path / f"ckpt{run}"
        cmd = [str(launcher), "-n", "4", sys.executable, str(REPO / "examples" / "train.py"), "--epochs", "3",
               "--data-dir", str(tmp_path / "data"), "--checkpoint-dir", str(ckpt), "--no-progress"]
        t0 = time.monotonic()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
                                preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if pin else None)
        assert result.returncode == 0, result.stdout + result.stderr
        print(f"run {run} ({'one CPU' if pin else 'as launched'}): {time.monotonic() - t0:.1f} s")
        saved.append(_weights(ckpt / "ckpt-3.npz"))
    assert saved[0].keys() == saved[1].keys() and len(saved[0]) > 1
    for name in saved[0]:
        assert saved[0][name] == saved[1][name], name
