"""CommunicationOptions(deterministic=True) (issue 24): the same sum bits for every layout of the replicas.

The same 8 global replica values are all-reduced as 1 rank x 8 logical devices (one process), 2 x 4 and
4 x 2 (``mpiexec -n 2`` and ``-n 4``, the MPI runs of scripts/test.sh), 8 x 1 (a serial test launches
``mpiexec -n 8``), each also as two pretend nodes; every result is compared with the scheme of
docs/internals.md ("Deterministic all-reduce") computed here element by element in plain Python, and
the data are checked to give other bits in another layout on the default path. Run as a program
(``mpiexec -n N python tests/test_deterministic_option.py``) it checks the layout N x 8/N and prints OK.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.comm import (
    CollectiveMismatchError,
    CommunicationOptions,
    RankCommunicator,
    reproducible_sum,
)

GLOBAL_REPLICAS = 8
DET = CommunicationOptions(deterministic=True)


def replica_values(count: int = GLOBAL_REPLICAS, size: int = 256, dtype: object = np.float32,
                   seed: int = 24) -> list[np.ndarray]:
    """One array per global replica: normal values times powers of ten from 1e-4 to 1e4 (mixed magnitudes,
    so that a sum's bits depend on the order of its terms)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-4, 5, size)).astype(dtype) for _ in range(count)]


def reference_sum(values: list[np.ndarray]) -> np.ndarray:
    """The documented scheme, element by element in Python: E the largest frexp exponent (at least the
    smallest normal one), each value rounded to an integer multiple of 2**(E - K) (K = 62 - ceil(log2 n),
    at most 50 for float16/32), the integers summed exactly, the sum rounded to float64, scaled back and
    cast to the dtype; non-finite elements as the plain sum."""
    first = np.asarray(values[0])
    dtype, n = first.dtype, len(values)
    real = first.real.dtype if dtype.kind == "c" else dtype
    flat = [np.ascontiguousarray(v).reshape(-1).view(real) for v in values]
    k = 62 - (n - 1).bit_length() if real == np.float64 else min(50, 62 - (n - 1).bit_length())
    floor = int(np.finfo(real).minexp)  # zeros and subnormals: |x| < 2**minexp
    out = []
    for e in range(flat[0].size):
        xs = [float(f[e]) for f in flat]
        if not all(math.isfinite(x) for x in xs):
            nan = any(math.isnan(x) for x in xs) or (math.inf in xs and -math.inf in xs)
            out.append(math.nan if nan else (math.inf if math.inf in xs else -math.inf))
            continue
        top = max(max(math.frexp(x)[1] for x in xs), floor)
        total = sum(round(math.ldexp(x, k - top)) for x in xs)  # round(): half to even, an exact int
        try:
            out.append(math.ldexp(float(total), top - k))
        except OverflowError:
            out.append(math.copysign(math.inf, total))
    with np.errstate(over="ignore"):
        result = np.array(out, np.float64).astype(real)
    return result.view(dtype).reshape(first.shape)


def plain_sum(values: list[np.ndarray], groups: int) -> np.ndarray:
    """The default path's sum on one node: each of ``groups`` ranks sums its replicas in order, then the
    ranks' sums in rank order."""
    per = len(values) // groups
    partial = []
    for g in range(groups):
        acc = values[g * per].copy()
        for v in values[g * per + 1:(g + 1) * per]:
            acc += v
        partial.append(acc)
    acc = partial[0].copy()
    for p in partial[1:]:
        acc += p
    return acc


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def layout_results(strategy: ms.Strategy, values: list[np.ndarray], options: CommunicationOptions | None) -> dict:
    """SUM and MEAN of the replicas' values through ``all_reduce`` in ``run`` (SUM also started
    asynchronously), on every local replica, and SUM through ``extended.reduce_to``."""
    def step():
        ctx = ms.get_replica_context()
        x = values[ctx.replica_id_in_sync_group]
        handle = ctx.experimental_all_reduce_async("sum", x, options=options)
        return ctx.all_reduce("sum", x, options=options), ctx.all_reduce("mean", x, options=options), handle.result()

    sums, means, started = strategy.run(step)
    per_replica = strategy.run(lambda: values[ms.get_replica_context().replica_id_in_sync_group])
    reduced = strategy.extended.reduce_to("sum", per_replica, "/cpu:0", options=options)
    local = strategy.experimental_local_results
    return {"sum": local(sums), "mean": local(means), "async": local(started), "reduce_to": [reduced]}


def check_layout(strategy: ms.Strategy) -> bool:
    """Every deterministic result has the reference bits; where ranks hold several replicas, the default
    path's sum differs from the one-process order (the data discriminate). Whether the default differed."""
    values = replica_values()
    expected = reference_sum(values)
    got = layout_results(strategy, values, DET)
    for name in ("sum", "async", "reduce_to"):
        for r in got[name]:
            assert same_bits(r, expected), f"{name}: {np.flatnonzero(np.asarray(r) != expected)[:5]}"
    for r in got["mean"]:
        assert same_bits(r, expected / np.float32(GLOBAL_REPLICAS))
    default = layout_results(strategy, values, None)["sum"][0]
    one_process = plain_sum(values, 1)
    local = strategy.extended._num_local
    if local == GLOBAL_REPLICAS:  # 1 x 8: the default sums in replica order
        assert same_bits(default, one_process)
    elif local > 1:  # the default sums the local replicas first, then the ranks' sums: other bits here
        assert not same_bits(default, one_process), "the data do not discriminate between layouts"
    # 8 x 1 on one node: the window sums in local-rank order, the one-process order (the same bits or not)
    assert np.allclose(default, expected, rtol=1e-5, atol=1e-3)
    return not same_bits(default, one_process)


def multi_worker(size: int) -> ms.MultiWorkerMirroredStrategy:
    local = GLOBAL_REPLICAS // size
    return ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(local)])


# ---------------------------------------------------------------------------------------------- one process


def test_reference_is_the_exact_sum_rounded_and_the_data_discriminate():
    values = replica_values()
    expected = reference_sum(values)
    exact = sum(np.asarray(v, np.float64) for v in values)  # float32 terms: float64 holds these sums nearly
    assert np.allclose(expected, exact, rtol=1e-6, atol=1e-6)
    layouts = {g: plain_sum(values, g) for g in (1, 2, 4, 8)}
    assert len({layouts[g].tobytes() for g in layouts}) > 1  # the plain sum's bits depend on the layout
    assert same_bits(reproducible_sum([[v] for v in values], GLOBAL_REPLICAS)[0], expected)
    # The order of the replicas does not matter either (the integers' sum is exact).
    assert same_bits(reproducible_sum([[v] for v in reversed(values)], GLOBAL_REPLICAS)[0], expected)


def test_one_process_eight_logical_devices():
    """1 x 8: MirroredStrategy takes the option per call (all_reduce, reduce_to)."""
    check_layout(ms.MirroredStrategy([f"/cpu:{i}" for i in range(GLOBAL_REPLICAS)]))


def test_eight_ranks_and_pretend_nodes():
    """8 x 1 and 8 x 1 as two pretend nodes: ``mpiexec -n 8`` of this file (oversubscribed: about 3 s each)."""
    from mpirun import clean_env, run_job

    for extra in ({}, {"MPISTRAT_PRETEND_NODES": "2"}):
        job = run_job([__file__], 8, 120, clean_env(MPISTRAT_NO_ABORT_HOOK="0", **extra))
        assert job.returncode == 0 and job.output.count("OK") == 8, job.output


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64, np.complex128])
def test_float_dtypes_match_the_reference(dtype):
    values = replica_values(6, 100, np.float64, seed=3)
    if np.dtype(dtype).kind == "c":
        values = [(a + 1j * b[::-1]) for a, b in zip(values, values)]
    values = [v.astype(dtype) for v in values]
    got = reproducible_sum([[v] for v in values], 6)
    assert got[0].dtype == np.dtype(dtype) and same_bits(got[0], reference_sum(values))
    assert same_bits(reproducible_sum([[v] for v in values[::-1]], 6)[0], got[0])  # any order


def test_integers_sum_as_they_are_and_wrap():
    values = [np.array([2**62, -5, 7], np.int64), np.array([2**62, 3, -1], np.int64)]
    got = reproducible_sum([[v] for v in values], 2)[0]
    assert got.dtype == np.int64 and got.tolist() == [-(2**63), -2, 6]


def test_non_finite_and_zeros_as_the_plain_sum():
    inf, nan = np.inf, np.nan
    a = np.array([nan, inf, inf, -inf, 1.0, 0.0, -0.0, 3e38, 1.0], np.float32)
    b = np.array([1.0, 2.0, -inf, -inf, nan, 0.0, -0.0, 3e38, -1.0], np.float32)
    got = reproducible_sum([[a], [b]], 2)[0]
    assert same_bits(got, reference_sum([a, b]))
    # NaN, +Inf, NaN (+Inf and -Inf), -Inf, NaN, +0, +0 (zeros sum to +0), +Inf (overflow), +0
    assert np.array_equal(got, np.array([nan, inf, nan, -inf, nan, 0, 0, inf, 0], np.float32), equal_nan=True)
    assert not np.signbit(got[6])


def test_options_validate_merge_and_print():
    with pytest.raises(ValueError, match="deterministic"):
        CommunicationOptions(deterministic=1)
    assert CommunicationOptions().merge(DET).deterministic and DET.merge(CommunicationOptions()).deterministic
    assert DET != CommunicationOptions() and "deterministic=True" in repr(DET)


def test_min_max_mean_in_one_process():
    values = replica_values(4, 50)
    strategy = ms.MirroredStrategy([f"/cpu:{i}" for i in range(4)])

    def step(op):
        x = values[ms.get_replica_context().replica_id_in_sync_group]
        return ms.get_replica_context().all_reduce(op, x, options=DET)

    results = {op: strategy.experimental_local_results(strategy.run(step, args=(op,)))[0]
               for op in ("min", "max", "mean")}
    assert same_bits(results["min"], np.minimum.reduce(values))
    assert same_bits(results["max"], np.maximum.reduce(values))
    assert same_bits(results["mean"], reference_sum(values) / np.float32(4))


@pytest.mark.gpu
def test_cupy_arrays_give_the_numpy_bits():
    """The scheme on a GPU (CuPy, in one piece) gives the host's bits (NumPy, in pieces), NaN and Inf too;
    MirroredStrategy on /gpu:0 takes it per call."""
    import cupy

    for dtype in (np.float16, np.float32, np.float64, np.complex64):
        values = [v.astype(dtype) for v in replica_values(4, 70_000, np.float64, seed=5)]
        values[1][:3] = [np.nan, np.inf, -np.inf]
        values[2][1] = -np.inf
        host = reproducible_sum([[v] for v in values], 4)[0]
        device = reproducible_sum([[cupy.asarray(v)] for v in values], 4)[0]
        assert isinstance(device, cupy.ndarray) and same_bits(cupy.asnumpy(device), host), dtype
    values = replica_values(1, 1000)
    strategy = ms.MirroredStrategy(["/gpu:0"])
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("sum", cupy.asarray(values[0]), options=DET))
    assert same_bits(cupy.asnumpy(strategy.experimental_local_results(out)[0]), values[0])


# --------------------------------------------------------------------------------------------------- MPI


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pretend", [None, "2"])
def test_layout_over_ranks(monkeypatch, pretend):
    """2 x 4 at 2 ranks, 4 x 2 at 4 ranks, each on one node and on two pretend nodes: the reference bits."""
    from mpi4py import MPI

    size = MPI.COMM_WORLD.size
    if GLOBAL_REPLICAS % size:
        pytest.skip(f"{GLOBAL_REPLICAS} replicas do not spread evenly over {size} ranks")
    if pretend is not None:
        monkeypatch.setenv("MPISTRAT_PRETEND_NODES", pretend)
    check_layout(multi_worker(size))


@pytest.mark.mpi(min_size=2)
def test_strategy_option_and_dtypes_through_the_communicator():
    """deterministic=True as the strategy's communication_options reaches strategy.reduce; the communicator
    alone reduces each dtype to the reference bits (MIN, MAX and integers as always)."""
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    strategy = ms.MultiWorkerMirroredStrategy(communication_options=DET)
    values = replica_values(size, 64)
    per_replica = strategy.run(lambda: values[ms.get_replica_context().replica_id_in_sync_group])
    assert same_bits(strategy.reduce("sum", per_replica, axis=None), reference_sum(values))
    with RankCommunicator(options=DET) as comm:
        for dtype in (np.float16, np.float32, np.float64, np.complex64):
            mine = values[rank].astype(dtype)
            everyone = [v.astype(dtype) for v in values]
            assert same_bits(comm.allreduce([mine], "sum")[0], reference_sum(everyone))
        ints = [np.arange(5, dtype=np.int32) * (r + 1) for r in range(size)]
        assert same_bits(comm.allreduce([ints[rank]], "sum")[0], np.sum(ints, axis=0, dtype=np.int32))
        assert same_bits(comm.allreduce([values[rank]], "min")[0], np.minimum.reduce(values))
        assert same_bits(comm.allreduce([values[rank]], "max")[0], np.maximum.reduce(values))
        out = values[rank].copy()
        assert comm.allreduce([out], "sum", inplace=True)[0] is out and same_bits(out, reference_sum(values))


@pytest.mark.mpi(min_size=2)
def test_flag_mismatch_raises_on_every_rank():
    """Rank 0 asks deterministic=True, the others not: every rank raises, whatever the op or dtype."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    options = DET if rank == 0 else None
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    with RankCommunicator() as comm:
        for op, x in (("sum", np.ones(3, np.float32)), ("sum", np.ones(3, np.int64)), ("max", np.ones(3))):
            with pytest.raises(CollectiveMismatchError, match="deterministic"):
                comm.allreduce([x], op, options)
        comm.barrier()  # still usable after the mismatches
    with pytest.raises(CollectiveMismatchError, match="deterministic"):
        strategy.run(lambda: ms.get_replica_context().all_reduce("mean", np.ones(2), options=options))


if __name__ == "__main__":
    from mpi4py import MPI

    differs = check_layout(multi_worker(MPI.COMM_WORLD.size))
    sys.stdout.write(f"OK rank {MPI.COMM_WORLD.rank} of {MPI.COMM_WORLD.size}, pretend nodes "
                     f"{os.environ.get('MPISTRAT_PRETEND_NODES')}: deterministic = reference bits; default "
                     f"{'differs from' if differs else 'equals'} the one-process order\n")


@pytest.mark.mpi(min_size=2)
def test_empty_or_uneven_calls_raise_on_every_rank_instead_of_waiting_or_differing():
    # Found in review: a rank with nothing to reduce returned at once while its peers waited until the
    # timeout; ranks with different local replica counts scaled by different n and got different sums.
    from mpi4py import MPI

    from mpistrat.comm import CollectiveMismatchError, RankCommunicator

    rank = MPI.COMM_WORLD.Get_rank()
    x = np.array([1.0, 0.1])
    with RankCommunicator(MPI.COMM_WORLD) as comm:
        with pytest.raises(CollectiveMismatchError):
            comm.deterministic_sum([[]] if rank == 0 else [[x]])
        with pytest.raises(CollectiveMismatchError, match="deterministic"):
            comm.deterministic_sum([[x]] if rank == 0 else [[x], [x]])
        (out,) = comm.deterministic_sum([[x], [x]])  # the communicator is still usable
        assert out.tolist() == (2 * comm.size * x).tolist()
