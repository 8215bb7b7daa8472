"""A repeated ``all_reduce`` of one array inside ``strategy.run``: the lean path keeps every result, check and error (2 and 4 ranks)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError, CollectiveTimeoutError, CommunicationOptions

from helpers import run_all_reduce


@pytest.fixture(params=["compiled", "python", "mixed"])
def lane_mode(request, monkeypatch, comm):
    """Every test three times: with the compiled lane (agreement/lane.py, ``_lane.c``), with the Python path,
    and with the lane on rank 0 only (the two meet in the same rounds)."""
    on = request.param == "compiled" or (request.param == "mixed" and comm.rank == 0)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1" if on else "0")
    return "compiled" if on else "python"


@pytest.fixture
def strategy(comm, monkeypatch, lane_mode):
    """The default strategy on one node: small arrays go through ``shm-small`` with the check folded."""
    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    monkeypatch.delenv("MPISTRAT_AGREEMENT", raising=False)
    return ms.MultiWorkerMirroredStrategy()


def _plan(strategy, x):
    rc = strategy.extended._communicator
    return rc._planner.singles[("sum", None, x.shape, x.dtype, np.ndarray)]


@pytest.mark.mpi(min_size=2)
def test_a_repeated_list_whose_first_array_is_a_step_alone_folds_its_check_into_that_steps_lane(strategy, comm,
                                                                                               lane_mode):
    # Two dtypes: two steps of one array each on shm-small; the list's check is the first step's handshake (the
    # compiled lane's round where it is on), the second step is reduced after it.
    rc = strategy.extended._communicator
    xs = [np.full(300, comm.rank + 1.0, np.float32), np.arange(50, dtype=np.float64) * (comm.rank + 1)]
    run_all_reduce(strategy, "sum", xs)
    plan = rc._planner.lists[("sum", None, 2)][1]
    assert [len(s.members) for s in plan.steps] == [1, 1] and plan.folded is not None
    assert (plan.lane is not None) == (lane_mode == "compiled")
    lane = plan.lane
    calls = []
    if lane is not None:
        def counted(src, dst):
            calls.append(lane(src, dst))
            return calls[-1]

        plan.lane = counted
    total = comm.size * (comm.size + 1) / 2
    held = []
    for k in range(4):
        xs[0][:] = comm.rank + 1.0 + k
        out = run_all_reduce(strategy, "sum", xs)
        assert np.all(out[0] == total + comm.size * k) and np.array_equal(out[1], np.arange(50) * total)
        assert np.all(xs[0] == comm.rank + 1.0 + k)  # the input untouched
        held.append(out[0])
    assert all(np.all(r == total + comm.size * k) for k, r in enumerate(held))
    assert plan.folded.pending is False
    if lane is not None:
        assert calls == [True] * 4
    odd = comm.rank == comm.size - 1
    with pytest.raises(CollectiveMismatchError, match="Mismatched allreduce"):
        run_all_reduce(strategy, "sum", [xs[0], xs[1][:49]] if odd else xs)
    assert np.all(run_all_reduce(strategy, "sum", xs)[0] == total + comm.size * 3)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("as_list", [False, True])
def test_repeats_take_the_lean_path_and_every_result_is_a_new_array_kept(strategy, comm, as_list, lane_mode):
    x = np.full(1000, comm.rank + 1.0, np.float32)
    first = run_all_reduce(strategy, "sum", [x] if as_list else x)
    plan = _plan(strategy, x)
    assert plan.folded is not None  # a one-array call folded into shm-small's handshake
    assert (plan.lane is not None) == (lane_mode == "compiled")
    total = comm.size * (comm.size + 1) / 2
    held = []
    for k in range(6):
        x[:] = comm.rank + 1.0 + k
        out = run_all_reduce(strategy, "sum", [x] if as_list else x)
        assert type(out) is (list if as_list else np.ndarray)
        r = out[0] if as_list else out
        assert r is not x and np.all(x == comm.rank + 1.0 + k)  # the input untouched
        assert np.all(r == total + comm.size * k)
        held.append(r)
    for k, r in enumerate(held):  # no later call wrote into a result the caller holds
        assert np.all(r == total + comm.size * k)
    assert np.all((first[0] if as_list else first) == total)
    assert plan.folded.pending is False


@pytest.mark.mpi(min_size=2)
def test_min_max_and_a_non_contiguous_input_on_the_lean_path(strategy, comm):
    base = np.arange(2000, dtype=np.float64).reshape(1000, 2) * (comm.rank + 1)
    x = base[:, 0]  # strided
    for _ in range(3):
        assert np.array_equal(run_all_reduce(strategy, "max", x), np.arange(0, 2000, 2.0) * comm.size)
        assert np.array_equal(run_all_reduce(strategy, "min", x), np.arange(0, 2000, 2.0))
    assert np.array_equal(x, np.arange(0, 2000, 2.0) * (comm.rank + 1))


@pytest.mark.mpi(min_size=2)
def test_each_rank_sums_its_own_term_from_its_source_or_in_place_from_its_slot(strategy, comm, lane_mode):
    # The compiled lane reads this rank's term from its source instead of its slot (the same bytes), but not
    # where the source overlaps the result: the first sum overwrites it before a rank after the first two
    # reads its term. Called in place on a plan's lane (compiled) or its transport (Python), every rank
    # must still get the rank-order sum, bit for bit.
    rng = np.random.default_rng(7 + comm.rank)
    x = (rng.standard_normal(3000) * 10.0 ** rng.integers(-6, 6, 3000)).astype(np.float32)
    every = comm.allgather(x)
    expected = every[0] + every[1]
    for y in every[2:]:
        expected = expected + y
    out = run_all_reduce(strategy, "sum", x)  # makes the plan; the source and a new result
    assert out.tobytes() == expected.tobytes() and np.array_equal(x, every[comm.rank])
    plan = _plan(strategy, x)
    for _ in range(2):
        y = x.copy()
        plan.folded.pending = True  # what the communicator sets before either
        if plan.lane is not None:
            assert plan.lane(y, y) is True
        else:
            plan.steps[0].transport.allreduce_prepared(plan.prepared, y, y, plan.folded.staged)
        assert y.tobytes() == expected.tobytes(), lane_mode
    again = run_all_reduce(strategy, "sum", x)  # the strategy's path after both
    assert again.tobytes() == expected.tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_source_written_while_the_lane_yields_still_gives_every_rank_the_same_result(strategy, comm, lane_mode):
    # Rank 0's lane copies its source into its slot, then yields the GIL while rank 1 is late; a thread of
    # rank 0 writes the source meanwhile (a race in the program, as writing an MPI send buffer during the
    # call is). The peers sum the slot's bytes: so must rank 0, or the ranks' results differ.
    x = np.full(3000, float(comm.rank + 1), np.float32)
    run_all_reduce(strategy, "sum", x)  # makes the plan (and the lane)
    stop = threading.Event()

    def write() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            x[:100] = k  # a new value each time this thread gets the GIL (NumPy keeps it for so few items)
            time.sleep(0)  # and hands the GIL back

    writer = threading.Thread(target=write, daemon=True) if comm.rank == 0 else None
    results = []
    try:
        if writer is not None:
            writer.start()
        for _ in range(30):
            comm.Barrier()
            if comm.rank == 1:
                time.sleep(0.0003)  # late by less than the lane's 1 ms of yields
            results.append(run_all_reduce(strategy, "sum", x).copy())
    finally:
        stop.set()
        if writer is not None:
            writer.join()
    every = comm.allgather(results)
    for call in range(30):
        assert all(r[call].tobytes() == every[0][call].tobytes() for r in every), (lane_mode, call)


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_against_a_repeated_call_raises_on_every_rank_and_leaves_the_strategy_usable(strategy, comm):
    x = np.ones(300, np.float32)
    for _ in range(3):
        run_all_reduce(strategy, "sum", x)
    odd = comm.rank == comm.size - 1
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce shapes"):
        run_all_reduce(strategy, "sum", np.ones(301, np.float32) if odd else x)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce op"):
        run_all_reduce(strategy, "max" if odd else "sum", x)
    with pytest.raises(CollectiveMismatchError):  # SUM against MEAN: the logical op is checked too
        run_all_reduce(strategy, "mean" if odd else "sum", x)
    assert np.all(run_all_reduce(strategy, "sum", x) == comm.size)


@pytest.mark.mpi(min_size=2)
def test_an_error_before_the_check_on_one_rank_raises_on_every_rank(strategy, comm):
    x = np.ones(500, np.float32)
    for _ in range(2):
        run_all_reduce(strategy, "sum", x)
    pool = _plan(strategy, x).steps[0].pool
    if comm.rank == 0:
        def broken():
            raise MemoryError("no result memory")
        pool.get = broken  # this rank fails while staging, before its check
    try:  # every rank raises, naming rank 0's error: no rank waits for the data
        with pytest.raises(CollectiveMismatchError, match="rank 0 sent error=MemoryError: no result memory"):
            run_all_reduce(strategy, "sum", x)
    finally:
        pool.__dict__.pop("get", None)
    assert np.all(run_all_reduce(strategy, "sum", x) == comm.size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_late_rank_times_out_the_ranks_waiting_on_the_lean_path(comm, monkeypatch, lane_mode):
    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    strategy = ms.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=1.0))
    x = np.ones(64, np.float32)
    for _ in range(2):
        run_all_reduce(strategy, "sum", x)
    assert _plan(strategy, x).folded is not None or strategy.extended._communicator._guard.transport != "shm"
    late = comm.size - 1
    if comm.rank == late:
        time.sleep(3.0)  # past the others' timeout and grace period
    with pytest.raises(CollectiveTimeoutError) as info:
        run_all_reduce(strategy, "sum", x)
    if comm.rank != late:
        assert info.value.missing_ranks == [late]
    MPI.COMM_WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_run_from_a_merge_function_inside_a_lone_replica_step_still_gets_its_own_group(strategy, comm):
    x = np.ones(8, np.float32)

    def merge_fn(s):
        return s.run(lambda: ms.get_replica_context().all_reduce("sum", x))

    out = strategy.run(lambda: ms.get_replica_context().merge_call(merge_fn))
    assert np.all(np.asarray(out) == comm.size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_an_interrupt_right_after_posting_the_folded_check_breaks_that_rank_only_after_its_peers_finish(comm,
                                                                                                       monkeypatch):
    # The lean check posts its round and spins in one call (ShmAllgather.exchange): an interrupt there
    # leaves the round out, so the rank must refuse every later call, as after an interrupted wait.
    from mpistrat.comm import RankCommunicator

    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    monkeypatch.delenv("MPISTRAT_AGREEMENT", raising=False)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "0")  # the Python exchange (the compiled lane: the next test)
    rc = RankCommunicator(comm, CommunicationOptions(timeout_seconds=2))
    try:
        for _ in range(2):
            rc.allreduce([np.ones(256)], "sum")  # planned: the next calls take the lean check
        guard = rc._guard
        if guard._exchange is None:
            pytest.skip("the check goes over MPI here (MPISTRAT_AGREEMENT=mpi)")
        exchange = guard._exchange

        def interrupted(h, aux, deadline, spins):
            exchange(h, aux, deadline, -1)  # posted, not yet complete
            raise KeyboardInterrupt

        _interrupt_rank_one(comm, rc, lambda: setattr(guard, "_exchange", interrupted), barrier=False)
    finally:
        rc.close()  # every guard is broken by now: local clean-up only


def _interrupt_rank_one(comm, rc, interrupt, barrier, error=KeyboardInterrupt):
    """Rank 1 calls ``interrupt()`` (it patches where its next call is interrupted), then that call raises
    ``error`` and breaks its communicator; the other ranks' call still gets rank 1's data (posted
    before the interrupt), their next one times out naming rank 1. ``barrier``: the others call only once
    rank 1 gave up."""
    from mpistrat.comm.errors import CommunicatorBrokenError

    if comm.rank == 1:
        interrupt()
        with pytest.raises(error):
            rc.allreduce([np.full(256, 10.0)], "sum")
        assert rc._guard.broken and "interrupted on rank 1" in rc._guard.broken
        with pytest.raises(CommunicatorBrokenError, match="interrupted on rank 1"):
            rc.allreduce([np.ones(256)], "sum")
    if barrier:
        comm.Barrier()
    if comm.rank != 1:
        expected = 10 + sum(1.0 for r in range(comm.size) if r != 1)
        assert np.all(rc.allreduce([np.ones(256)], "sum")[0] == expected)
        with pytest.raises(CollectiveTimeoutError, match="rank 1"):
            rc.allreduce([np.ones(256)], "sum")


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("as_list", [False, True])
def test_a_repeated_cupy_all_reduce_takes_the_lean_path_on_the_replicas_gpu(strategy, comm, monkeypatch, as_list):
    # One CuPy array on the replica's GPU goes from ReplicaContext.all_reduce straight to the communicator,
    # as a NumPy array does: the general path (_all_reduce_alone) is not entered after the first call.
    import cupy

    ext = strategy.extended
    device = ext.worker_devices[0]
    assert ms.devices.is_gpu(device)
    general = []
    alone = ext._cross_device_ops._all_reduce_alone

    def counted(*args, **kwargs):
        general.append(args[0])
        return alone(*args, **kwargs)

    monkeypatch.setattr(ext._cross_device_ops, "_all_reduce_alone", counted)
    total = comm.size * (comm.size + 1) / 2
    held = []
    with cupy.cuda.Device(ms.devices.device_index(device)):
        x = cupy.full(5000, comm.rank + 1.0, cupy.float32)
        for k in range(5):
            x[:] = comm.rank + 1.0 + k
            out = run_all_reduce(strategy, "sum", [x] if as_list else x)
            r = out[0] if as_list else out
            assert type(r) is cupy.ndarray and r is not x and r.device.id == x.device.id
            assert bool(cupy.all(x == comm.rank + 1.0 + k))  # the input untouched
            held.append(r)
        for k, r in enumerate(held):  # every result is kept: no later call wrote into it
            assert bool(cupy.all(r == total + comm.size * k)), (k, float(r[0]))
        assert len(general) == 1  # the first call planned through the general path; the repeats took the lean one
        for _ in range(2):
            m = run_all_reduce(strategy, "max", [x] if as_list else x)
            assert float((m[0] if as_list else m)[0]) == comm.size + 4.0
    assert len(general) == 2  # a new op is a new plan: its first call only


def test_the_compiled_lane_is_built_by_the_install():
    # pip builds the extension wherever a C compiler is (this machine has one): a lane that silently fell
    # back to the Python path would pass every other test here.
    from mpistrat.comm.agreement import lane

    assert lane._lane is not None, "mpistrat.comm.agreement._lane was not built: pip install -e . with a C compiler"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float64, "sum"), (np.int32, "sum"), (np.int64, "sum"),
                                       (np.int32, "min"), (np.int64, "max"), (np.float32, "max")])
def test_repeated_calls_give_numpys_bits_in_local_rank_order(strategy, comm, lane_mode, dtype, op):
    # Each element is ((x0 + x1) + x2) + ... in rank order, as NumPy's ufunc computes it: floats with
    # infinities, NaN, subnormals and values whose sum depends on the order; integers that wrap.
    rng = np.random.default_rng(comm.rank)
    for k in range(4):
        if np.dtype(dtype).kind == "f":
            x = (rng.standard_normal(1500) * 10.0 ** rng.integers(-30, 30, 1500)).astype(dtype)
            x[:4] = [np.inf, -np.inf, np.nan, np.finfo(dtype).tiny / 3]
        else:
            info = np.iinfo(dtype)
            x = rng.integers(info.min, info.max, 1500, dtype=dtype, endpoint=True)
        out = run_all_reduce(strategy, op, x)
        every = comm.allgather(x)
        ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
        expected = ufunc(every[0], every[1])
        for y in every[2:]:
            expected = ufunc(expected, y)
        assert out.dtype == x.dtype and out.tobytes() == expected.tobytes(), (lane_mode, dtype, op, k)
    plan = strategy.extended._communicator._planner.singles[(op, None, x.shape, x.dtype, np.ndarray)]
    compiled = lane_mode == "compiled" and not (np.dtype(dtype).kind == "f" and op != "sum")  # NumPy's rules
    assert (plan.lane is not None) == compiled


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_an_error_raised_as_the_compiled_lane_returns_after_posting_breaks_that_rank_only(comm, monkeypatch, lane_rc,
                                                                                         error):
    # A signal handled as the kernel returns (or any error after its post) loses what it returned: the
    # round is out, maybe summed by the peers, so this rank must not undo it, nor tell its peers over a
    # round they finished (that would mismatch and wait): the guard is broken, as for an interrupted check.
    from mpistrat.comm.agreement import lane

    kernel = lane._lane

    class RaisingAfterPost:
        def __getattr__(self, name):
            return getattr(kernel, name)

        def run(self, *args):
            kernel.run(*args)
            raise error

    def interrupt():
        monkeypatch.setattr(lane, "_lane", RaisingAfterPost())

    _interrupt_rank_one(comm, lane_rc, interrupt, barrier=False, error=error)


@pytest.fixture
def lane_rc(comm, monkeypatch):
    """A communicator (2 s timeout) whose repeated call of 256 float64 takes the compiled lane."""
    from mpistrat.comm import RankCommunicator

    for name in ("MPISTRAT_SHM_MIN_BYTES", "MPISTRAT_PRETEND_NODES", "MPISTRAT_AGREEMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1")
    rc = RankCommunicator(comm, CommunicationOptions(timeout_seconds=2))
    try:
        for _ in range(2):
            rc.allreduce([np.ones(256)], "sum")  # planned: the next calls take the lane
        assert rc._planner.singles[("sum", None, (256,), np.dtype(np.float64), np.ndarray)].lane is not None
        yield rc
    finally:
        rc.close()  # every guard is broken by the tests using it: local clean-up only


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_an_interrupt_while_the_compiled_lane_waits_for_a_late_peer_breaks_that_rank_only(comm, lane_rc):
    # The lane posts and spins in C; a peer later than the spin hands the round to the guard's wait, and an
    # interrupt there leaves the round out: the rank refuses every later call, its peers finish this one.
    def interrupted(*args):
        raise KeyboardInterrupt

    # The others wait at the barrier, so rank 1's lane returns without them and the guard's wait is next.
    _interrupt_rank_one(comm, lane_rc, lambda: setattr(lane_rc._guard, "_wait", interrupted), barrier=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_an_interrupt_between_a_completed_round_and_its_verdict_breaks_that_rank_only(comm, monkeypatch):
    # The Python path's round completes inside ShmAllgather.exchange; a signal handled right after (at the
    # verdict's clock reading) leaves a round the peers judged and went on from: this rank is broken.
    import time as real_time

    from mpistrat.comm import RankCommunicator
    from mpistrat.comm.agreement import guard as guard_module

    for name in ("MPISTRAT_SHM_MIN_BYTES", "MPISTRAT_PRETEND_NODES", "MPISTRAT_AGREEMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "0")
    rc = RankCommunicator(comm, CommunicationOptions(timeout_seconds=2))

    class Clock:  # time.time raises at its second reading of a call: the verdict's, after the round
        calls = 0

        def __getattr__(self, name):
            return getattr(real_time, name)

        def time(self):
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt
            return real_time.time()

    def interrupt():
        real_time.sleep(0.3)  # the others are waiting: this rank's round completes at its post
        monkeypatch.setattr(guard_module, "time", Clock())

    try:
        for _ in range(2):
            rc.allreduce([np.ones(256)], "sum")
        if rc._guard._exchange is None:
            pytest.skip("the check goes over MPI here")
        _interrupt_rank_one(comm, rc, interrupt, barrier=False)
    finally:
        rc.close()
