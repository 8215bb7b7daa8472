"""A repeated ``all_reduce`` the shared-memory window reduce-scatters: the compiled reduce-scatter (``_lane.scatter``,
with the check's round for one array, without it for a step after the check) keeps every result, check and error of
the Python path (2 and 4 ranks)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError
from mpistrat.comm.agreement import lane
from mpistrat.comm.agreement.call import OVERLAP_MAX_BYTES
from mpistrat.comm.agreement.lane import CompiledScatter, StepScatter
from mpistrat.comm.communicator import RankCommunicator
from mpistrat.comm.plan import UNFUSED_MIN_BYTES
from mpistrat.comm.transport.base import NO_AGREEMENT
from mpistrat.comm.transport.shm.allreduce import ShmTransport

from helpers import run_all_reduce

# Chunks of 512 KiB (the strategy fixture's): one pass (above the one-synchronisation limit, 256 KiB at
# most, under a chunk); chunks with a short last chunk (reduced with one synchronisation); chunks with a
# long last chunk (reduce-scattered too).
SIZES = [300 << 10, (1 << 20) + 4160, (3 << 18) + 64]


def _one_node_window(monkeypatch, compiled: bool | None = None) -> None:
    """The default strategy's settings on one node (large arrays through the window transport, the check folded),
    in 512 KiB chunks whatever this machine's L2; with ``compiled``, the kernels on (True) or off (False)."""
    for name in ("MPISTRAT_SHM_MIN_BYTES", "MPISTRAT_PRETEND_NODES", "MPISTRAT_AGREEMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", str(512 << 10))
    if compiled is not None:
        monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1" if compiled else "0")


@pytest.fixture(params=["compiled", "python", "mixed"])
def lane_mode(request, monkeypatch, comm):
    """Every test with the compiled reduce-scatter, with the Python path, and with the kernel on rank 0 only
    (the two meet in the same rounds and epochs)."""
    on = request.param == "compiled" or (request.param == "mixed" and comm.rank == 0)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1" if on else "0")
    return "compiled" if on else "python"


@pytest.fixture
def strategy(comm, monkeypatch, lane_mode):
    """The default strategy on one node (:func:`_one_node_window`)."""
    _one_node_window(monkeypatch)
    return ms.MultiWorkerMirroredStrategy()


@pytest.fixture
def recorded(monkeypatch):
    """What every ``_lane.scatter`` call of this rank returned, in order: those that posted the check's round
    (``"round"``: ``CompiledScatter``) and those of a step whose check was done (``"step"``: ``StepScatter``)."""
    kernel = lane._lane
    seen: dict[str, list] = {"round": [], "step": []}

    class Recording:
        def __getattr__(self, name):
            return getattr(kernel, name)

        def scatter(self, *args):
            out = kernel.scatter(*args)
            seen["round" if args[0] else "step"].append(out)
            return out

    monkeypatch.setattr(lane, "_lane", Recording())
    return seen


@pytest.fixture
def returned(recorded):
    """What every ``_lane.scatter`` call of this rank that posted the check's round returned, in order."""
    return recorded["round"]


def _inputs(rng: np.random.Generator, count: int, dtype: type) -> np.ndarray:
    if np.dtype(dtype).kind == "f":  # sums whose bits depend on the order, infinities, NaN, subnormals
        x = (rng.standard_normal(count) * 10.0 ** rng.integers(-30, 30, count)).astype(dtype)
        x[:4] = [np.inf, -np.inf, np.nan, np.finfo(dtype).tiny / 3]
        return x
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)


def _expected(comm, x: np.ndarray, op: str) -> np.ndarray:
    every = comm.allgather(x)
    ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
    expected = ufunc(every[0], every[1])
    for y in every[2:]:
        expected = ufunc(expected, y)
    return expected


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float64, "sum"), (np.int32, "min"), (np.int64, "sum")])
def test_repeated_large_calls_give_numpys_bits_in_local_rank_order_and_keep_every_result(strategy, comm, lane_mode,
                                                                                       returned, dtype, op):
    # Every result a new array: the first ones in the transport's shared result blocks, later ones (the
    # caller holds every block) private; none written again by a later call, the inputs untouched.
    rng = np.random.default_rng(comm.rank)
    kept = []
    for nbytes in SIZES:
        for k in range(4):
            x = _inputs(rng, nbytes // np.dtype(dtype).itemsize, dtype)
            before = x.copy()
            out = run_all_reduce(strategy, op, x)
            expected = _expected(comm, x, op)
            assert out.tobytes() == expected.tobytes(), (lane_mode, nbytes, k)
            assert x.tobytes() == before.tobytes()
            kept.append((out, expected))
        plan = strategy.extended._communicator._planner.singles[(op, None, x.shape, x.dtype, np.ndarray)]
        transport = plan.steps[0].transport
        assert isinstance(transport, ShmTransport)
        assert isinstance(plan.lane, CompiledScatter) == (lane_mode == "compiled")
        assert transport.scatter_layout(x.size, x.dtype) is not None  # what the kernel reads: nothing left to make
    for out, expected in kept:
        assert out.tobytes() == expected.tobytes()
    if lane_mode == "compiled":  # the kernel ran (a peer late hands the rest to Python: None or an epoch's code)
        assert len(returned) == 3 * len(SIZES)
        assert all(r is True or r is None or type(r) is int for r in returned)
    else:
        assert returned == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("late_at, nbytes", [("round", SIZES[1]), ("first", SIZES[1]), ("tail", SIZES[1]),
                                             ("second", SIZES[2])])
def test_peers_late_at_the_check_or_at_a_chunks_synchronisation_hand_the_rest_to_the_python_path(comm, monkeypatch,
                                                                                                returned, late_at,
                                                                                                nbytes):
    # The last rank takes the Python path and is late (5 ms) at one synchronisation of every call: the check's
    # round (the kernel returns None), the first synchronisation of each chunk after the first (2 * chunk),
    # the short last chunk's one synchronisation only (4: the third chunk's) or the second synchronisation
    # of a chunk after the first (2 * chunk + 1). The kernel's ranks go on in Python from where it stopped,
    # to the same bits.
    late = comm.rank == comm.size - 1
    _one_node_window(monkeypatch, compiled=not late)
    strategy = ms.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(comm.rank)
    x = _inputs(rng, nbytes // 4, np.float32)
    for _ in range(2):
        run_all_reduce(strategy, "sum", x)  # planned: the next calls repeat it
    if late and late_at in ("first", "tail"):  # before staging a later chunk (or only the short last one)
        stage = ShmTransport._allreduce_contiguous

        def staging_late(self, source, out, op, hook, shared=None, offset=0):
            if offset and (late_at == "first" or out.nbytes <= self.direct_max_bytes):
                time.sleep(0.005)
            return stage(self, source, out, op, hook, shared, offset)

        monkeypatch.setattr(ShmTransport, "_allreduce_contiguous", staging_late)
    if late and late_at == "second":  # after a later chunk's first synchronisation, before its sums
        scatter = ShmTransport._reduce_scatter

        def summing_late(self, *args, **kwargs):
            if args[5] if len(args) > 5 else kwargs.get("synced"):
                return scatter(self, *args, **kwargs)  # chunk 0: the check stood for its first synchronisation
            wait = self._sync.wait

            def late_wait():
                wait()
                time.sleep(0.005)

            self._sync.wait = late_wait  # its first synchronisation, then late
            try:
                return scatter(self, *args, **kwargs)
            finally:
                del self._sync.wait
        monkeypatch.setattr(ShmTransport, "_reduce_scatter", summing_late)
    returned.clear()
    for k in range(8):
        x = _inputs(rng, x.size, np.float32)
        comm.Barrier()  # where ranks outnumber cores, a rank late at every round would hide the later cases
        if late and late_at == "round":
            time.sleep(0.005)
        out = run_all_reduce(strategy, "sum", x)
        assert out.tobytes() == _expected(comm, x, "sum").tobytes(), k
    if not late:
        assert len(returned) == 8
        if late_at == "round":
            assert None in returned, returned
        elif late_at == "first":
            assert any(type(r) is int and r >= 2 and r % 2 == 0 for r in returned), returned
        elif late_at == "tail":
            assert 4 in returned, returned
        else:
            assert any(type(r) is int and r >= 3 and r % 2 == 1 for r in returned), returned


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_against_a_repeated_large_call_raises_on_every_rank_and_leaves_the_strategy_usable(strategy, comm,
                                                                                                    lane_mode):
    a, b = np.ones(SIZES[1] // 4, np.float32), np.ones(SIZES[1] // 4 + 16, np.float32)
    for _ in range(2):  # both planned on every rank: each rank's next call is a repeat
        run_all_reduce(strategy, "sum", a)
        run_all_reduce(strategy, "sum", b)
    odd = comm.rank == comm.size - 1
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce shapes"):
        run_all_reduce(strategy, "sum", b if odd else a)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce op"):
        run_all_reduce(strategy, "max" if odd else "sum", a)
    for _ in range(2):
        assert np.all(run_all_reduce(strategy, "sum", a) == comm.size)
        assert np.all(run_all_reduce(strategy, "sum", b) == comm.size)


@pytest.mark.mpi(min_size=2)
def test_chunks_settled_after_a_size_was_laid_out_are_the_ones_every_rank_cuts(strategy, comm, lane_mode):
    # MPISTRAT_SHM_CHUNK_BYTES=auto settles the chunk size at the first array of 4 MiB or more, after
    # smaller arrays were reduce-scattered (and laid out for the kernel) in one pass: from then on the
    # kernel must cut the chunks reduce_in_chunks cuts, or ranks on the Python path would meet it at other
    # synchronisations. Set here as that measurement sets it, to a size that cuts this array.
    x = np.arange(SIZES[2] // 8, dtype=np.float64) * (comm.rank + 1)
    transport = strategy.extended._communicator.transports[1]
    assert isinstance(transport, ShmTransport)
    transport._set_chunk_bytes(0)
    for _ in range(3):
        assert np.array_equal(run_all_reduce(strategy, "sum", x), x / (comm.rank + 1) * (comm.size * (comm.size + 1) // 2))
    transport._set_chunk_bytes(512 << 10)  # on every rank, as calibration.measure_chunks decides
    assert transport.scatter_layout(x.size, x.dtype).chunk == 512 << 10
    for _ in range(3):
        assert np.array_equal(run_all_reduce(strategy, "sum", x), x / (comm.rank + 1) * (comm.size * (comm.size + 1) // 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_the_kernel_stages_its_data_before_it_posts_the_check(comm, monkeypatch):
    # What test_comm_check_overlap.py pins down for the Python path, seen from a peer here: by the time rank
    # 0's round of the check is visible, its segment holds this call's data in the slices its peers sum.
    last = comm.size - 1
    _one_node_window(monkeypatch, compiled=comm.rank == 0)
    strategy = ms.MultiWorkerMirroredStrategy()
    count = SIZES[0] // 4
    for _ in range(2):
        run_all_reduce(strategy, "sum", np.ones(count, np.float32))
    seen = []
    if comm.rank == last:  # on the Python path: its data staged, its round not yet posted
        gather = strategy.extended._communicator._guard.gather
        staged = ShmTransport._staged

        def watching(self, hook):
            current = gather._round + 1
            word = gather._rounds[current & 1][0]  # rank 0's round word
            until = time.monotonic() + 20
            while gather._items[word] != current and time.monotonic() < until:
                pass
            self._win_sync()
            lo, hi = self._own_slice(count, 4)
            seen.append(self._typed(self._bucket, np.dtype(np.float32))[0][lo:hi].copy())
            return staged(self, hook)

        monkeypatch.setattr(ShmTransport, "_staged", watching)
    for k in range(3):
        out = run_all_reduce(strategy, "sum", np.full(count, comm.rank + 1.0 + 10 * k, np.float32))
        assert np.all(out == comm.size * (comm.size + 1) / 2 + 10 * k * comm.size)
    if comm.rank == last:
        assert len(seen) == 3 and all(np.all(s == 1.0 + 10 * k) for k, s in enumerate(seen)), seen


# A list whose arrays are each reduced alone (from UNFUSED_MIN_BYTES), in chunks: a short last chunk (the
# check's step), a long last chunk, a short last chunk again (the window's bucket flipped after it), whole chunks.
LIST_SIZES = [SIZES[1], (1 << 20) + (300 << 10), SIZES[1], 1 << 20]
LATER = len(LIST_SIZES) - 1  # the arrays after the check's


def _list_plan(strategy, op: str, count: int):
    plan = strategy.extended._communicator._planner.lists[(op, None, count)][1]
    assert [len(s.members) for s in plan.steps] == [1] * count, "every array a step of its own"
    assert all(isinstance(s.transport, ShmTransport) for s in plan.steps)
    return plan


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float64, "sum"), (np.int32, "max"), (np.int64, "sum")])
def test_a_repeated_list_takes_the_kernel_with_the_round_at_its_first_array_and_without_after_to_numpys_bits(
        strategy, comm, lane_mode, recorded, dtype, op):
    # The list's check folds into its first array's reduce-scatter, which the kernel runs with the check's
    # round, as for one array; the kernel reduces the later arrays without a round of its own. Every result a
    # new array, none written again by a later call, the inputs untouched.
    rng = np.random.default_rng(comm.rank)
    itemsize = np.dtype(dtype).itemsize
    kept = []
    for k in range(4):
        xs = [_inputs(rng, n // itemsize, dtype) for n in LIST_SIZES]
        before = [x.copy() for x in xs]
        outs = run_all_reduce(strategy, op, xs)
        for x, b, out in zip(xs, before, outs):
            expected = _expected(comm, x, op)
            assert out.tobytes() == expected.tobytes(), (lane_mode, x.nbytes, k)
            assert x.tobytes() == b.tobytes()
            kept.append((out, expected))
    for out, expected in kept:
        assert out.tobytes() == expected.tobytes()
    plan = _list_plan(strategy, op, len(LIST_SIZES))
    assert all(isinstance(s.lane, StepScatter) == (lane_mode == "compiled") for s in plan.steps)
    assert isinstance(plan.lane, CompiledScatter) == (lane_mode == "compiled")
    if lane_mode == "compiled":  # the repeats at least (a peer late: None, or an epoch's code)
        assert len(recorded["round"]) >= 3, recorded["round"]
        assert all(r is True or r is None or type(r) is int for r in recorded["round"])
        assert len(recorded["step"]) >= LATER * 3, recorded["step"]
        assert all(r is True or type(r) is int for r in recorded["step"])
    else:
        assert recorded["round"] == recorded["step"] == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("first_lane", ["declines", "raises"])
def test_a_lists_first_step_the_kernel_declines_or_fails_before_its_round_keeps_every_rank_in_step(comm, monkeypatch,
                                                                                                first_lane):
    # Rank 0's first-step lane takes no call: "declines" (nothing done: its transport's Python path runs the
    # plan's check in the first synchronisation, which the other ranks' kernels meet), or "raises" before its
    # round is posted (the error travels in the check: every rank raises, none waits, and the next call works).
    _one_node_window(monkeypatch, compiled=True)
    strategy = ms.MultiWorkerMirroredStrategy()
    xs = [np.full(n // 4, comm.rank + 1.0, np.float32) for n in LIST_SIZES]
    total = comm.size * (comm.size + 1) / 2
    for _ in range(2):
        run_all_reduce(strategy, "sum", xs)  # planned and filed: the next calls repeat it
    plan = _list_plan(strategy, "sum", len(LIST_SIZES))
    assert isinstance(plan.lane, CompiledScatter)
    kernel = plan.lane
    if comm.rank == 0:
        def declining(src, dst):
            if first_lane == "raises":
                raise RuntimeError("the first step failed before its round")
            return False

        plan.lane = declining
    if first_lane == "declines":
        for k in range(3):
            outs = run_all_reduce(strategy, "sum", [x + k for x in xs])
            assert all(np.all(o == total + comm.size * k) for o in outs), k
    else:
        with pytest.raises(CollectiveMismatchError, match="the first step failed before its round"):
            run_all_reduce(strategy, "sum", xs)
    assert plan.folded.pending is False
    plan.lane = kernel
    assert all(np.all(o == total) for o in run_all_reduce(strategy, "sum", xs))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differs", ["later shape", "first shape", "op"])
def test_a_mismatch_against_a_repeated_list_whose_check_is_its_first_arrays_raises_on_every_rank(strategy, comm,
                                                                                               lane_mode, recorded,
                                                                                               differs):
    # The matched ranks run the first array's check in its reduce-scatter (the kernel's round, or the Python
    # path's first synchronisation) with the plan's fingerprint; the odd rank's call is another: every rank
    # raises before any data is combined, and the next calls are summed as before.
    xs = [np.full(n // 4, comm.rank + 1.0, np.float32) for n in LIST_SIZES]
    other = {"later shape": xs[:-1] + [np.ones(LIST_SIZES[-1] // 4 + 16, np.float32)],
             "first shape": [np.ones(LIST_SIZES[0] // 4 + 16, np.float32)] + xs[1:], "op": xs}[differs]
    for _ in range(2):  # both planned on every rank, xs filed last: the matched ranks' next call repeats it
        run_all_reduce(strategy, "sum", other)
        run_all_reduce(strategy, "sum", xs)
    odd = comm.rank == comm.size - 1
    recorded["round"].clear()
    recorded["step"].clear()
    with pytest.raises(CollectiveMismatchError, match="Mismatched allreduce op" if differs == "op" else
                       "Mismatched allreduce shapes"):
        run_all_reduce(strategy, "max" if odd and differs == "op" else "sum", other if odd else xs)
    assert recorded["step"] == []  # no later array was reduced
    if lane_mode == "compiled" and not odd:  # the kernel posted the round and found another call
        assert recorded["round"] in ([False], [None]), recorded["round"]
    total = comm.size * (comm.size + 1) / 2
    for _ in range(2):
        assert all(np.all(r == total) for r in run_all_reduce(strategy, "sum", xs))


@pytest.mark.mpi(min_size=2)
def test_a_repeated_array_above_the_folded_checks_limit_takes_the_kernel_after_its_own_check(strategy, comm,
                                                                                           lane_mode, recorded):
    # Above OVERLAP_MAX_BYTES the check is a round of its own before the transport: the kernel then reduces
    # the array without one.
    # A new input every call: a rank reading a peer's other bucket (its short last chunk flips it) would sum
    # the call before's data.
    base = np.arange((OVERLAP_MAX_BYTES + 4160) // 4, dtype=np.float32)
    factor = comm.size * (comm.size + 1) // 2
    for k in range(4):
        x = base * (comm.rank + 1) + k
        out = run_all_reduce(strategy, "sum", x)
        assert np.array_equal(out, base * factor + k * comm.size), k
    plan = strategy.extended._communicator._planner.singles[("sum", None, x.shape, x.dtype, np.ndarray)]
    assert plan.lane is None and isinstance(plan.steps[0].lane, StepScatter) == (lane_mode == "compiled")
    if lane_mode == "compiled":
        assert len(recorded["step"]) >= 2, recorded
        assert all(r is True or type(r) is int for r in recorded["step"])
    else:
        assert recorded["step"] == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("late_at", ["start", "chunk", "tail"])
def test_peers_late_at_a_steps_synchronisation_hand_the_rest_of_the_step_to_the_python_path(comm, monkeypatch,
                                                                                           recorded, late_at):
    # The last rank takes the Python path and is late (5 ms) before staging the first chunk of the list's later
    # arrays (the kernel returns 0: its first synchronisation), a later chunk (2 * chunk), or only a short last
    # chunk (4: the third chunk's one synchronisation). The kernel's ranks go on in Python from where it
    # stopped, to the same bits.
    late = comm.rank == comm.size - 1
    _one_node_window(monkeypatch, compiled=not late)
    strategy = ms.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(comm.rank)
    xs = [_inputs(rng, n // 4, np.float32) for n in LIST_SIZES]
    for _ in range(2):
        run_all_reduce(strategy, "sum", xs)  # planned: the next calls repeat it
    if late:
        stage = ShmTransport._allreduce_contiguous

        def staging_late(self, source, out, op, hook, shared=None, offset=0):
            # After the check (the first array's first chunk carries it); "chunk" delays the first array's later
            # chunks too, which the kernel's ranks reduce in Python anyway.
            at = {"start": offset == 0, "chunk": offset > 0, "tail": offset > 0 and out.nbytes <= self.direct_max_bytes}
            if hook is NO_AGREEMENT and at[late_at]:
                time.sleep(0.005)
            return stage(self, source, out, op, hook, shared, offset)

        monkeypatch.setattr(ShmTransport, "_allreduce_contiguous", staging_late)
    recorded["step"].clear()
    for k in range(6):
        xs = [_inputs(rng, x.size, np.float32) for x in xs]
        comm.Barrier()
        outs = run_all_reduce(strategy, "sum", xs)
        for x, out in zip(xs, outs):
            assert out.tobytes() == _expected(comm, x, "sum").tobytes(), k
    if not late:
        codes = recorded["step"]
        assert len(codes) == LATER * 6, codes
        if late_at == "start":
            assert 0 in codes, codes
        elif late_at == "chunk":
            assert any(type(r) is int and r >= 2 and r % 2 == 0 for r in codes), codes
        else:
            assert 4 in codes, codes


@pytest.mark.mpi(min_size=2)
def test_the_workers_calls_keep_off_the_step_kernel(comm, monkeypatch):
    # An asynchronous list all-reduce runs on the communicator's worker thread, where the kernel, which holds the
    # GIL while it copies and sums, would stall the caller's computation: only the caller's calls take it.
    _one_node_window(monkeypatch, compiled=True)
    communicator = RankCommunicator()
    try:
        shm = [t for t in communicator.transports if isinstance(t, ShmTransport)]
        if not shm:
            pytest.skip("no shared-memory window transport in this communicator's table")
        count = (max(UNFUSED_MIN_BYTES, shm[0].direct_max_bytes) + 4160) // 4  # each array a step of its own
        grads = [np.full(count, comm.rank + 1.0, np.float32), np.arange(count, dtype=np.float32) * (comm.rank + 1)]
        factor = comm.size * (comm.size + 1) // 2
        expected = [np.full(count, float(factor), np.float32), np.arange(count, dtype=np.float32) * factor]
        for _ in range(2):
            communicator.allreduce(grads, "sum")  # planned, result blocks made: the next calls repeat it
        plan = communicator._planner.lists[("sum", None, 2)][1]
        callers = []
        assert isinstance(plan.lane, CompiledScatter)  # the first step's, with the check's round
        first = plan.lane

        def recording_first(src, dst):
            callers.append(threading.get_ident())
            return first(src, dst)

        plan.lane = recording_first
        for step in plan.steps:
            assert isinstance(step.lane, StepScatter)
            kernel = step.lane

            def recording(src, dst, kernel=kernel):
                callers.append(threading.get_ident())
                return kernel(src, dst)

            step.lane = recording
        for _ in range(3):
            from_worker = communicator.allreduce_async(grads, "sum").result()
            assert communicator._worker is not None, "a worker thread exists (threads are allowed here)"
            from_caller = communicator.allreduce(grads, "sum")
            for got in (from_worker, from_caller):
                assert all(np.array_equal(g, e) for g, e in zip(got, expected))
        assert callers and set(callers) == {threading.get_ident()}, "the caller's calls only"
    finally:
        communicator.close()
