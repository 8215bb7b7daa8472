"""ReplicaContext.experimental_all_reduce_async and RankCommunicator.allreduce_async (1, 2 and 4 ranks).

Every test runs once per host transport layout (``backend_variants.py``). The asynchronous call must
give what the blocking one gives, keep the order of collectives on every rank, raise the blocking
call's errors from ``result()`` on every rank, finish by the end of ``strategy.run`` when nobody
reads it, and be in flight while the caller goes on.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from backend_variants import backend_variant  # noqa: F401  (autouse)
from mpi4py import MPI

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError, CollectiveTimeoutError, CommunicatorBrokenError, RankCommunicator
from mpistrat.distribute.replica_group import CollectiveOrderError
from mpistrat.experimental import CommunicationOptions


def world():
    return MPI.COMM_WORLD


@pytest.fixture(params=[1, 2], ids=["1local", "2local"])
def strategy(request):
    return ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(request.param)])


def replica_values(g):
    """A nested value that depends only on the global replica id: several dtypes, a scalar, and an
    array long enough for the window transport's chunked path (2 MiB)."""
    rng = np.random.default_rng(g)
    return {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "i": np.arange(7, dtype=np.int64) * (g + 1),
        "big": rng.standard_normal(1 << 18),
        "s": [float(g), np.float32(g + 0.5)],
    }


def flat(value):
    out = []

    def walk(v):
        if isinstance(v, dict):
            for k in sorted(v):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            out.append(np.asarray(v))

    walk(value)
    return out


def assert_same(a, b):
    """Same structure, same dtypes, same bits."""
    assert type(a) is type(b), (type(a), type(b))
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(x, y), (x, y)


# ---------------------------------------------------------------------------- results


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max"])
def test_results_equal_the_blocking_call_and_inputs_are_untouched(strategy, op):
    def step():
        ctx = ms.get_replica_context()
        value = replica_values(ctx.replica_id_in_sync_group)
        before = flat(value)
        before = [x.copy() for x in before]
        handle = ctx.experimental_all_reduce_async(op, value)
        blocking = ctx.all_reduce(op, value)
        result = handle.result()
        assert handle.done()
        for x, y in zip(flat(value), before):  # the inputs are untouched
            assert x.dtype == y.dtype and np.array_equal(x, y)
        return result, blocking

    for result, blocking in strategy.experimental_local_results(strategy.run(step)):
        assert_same(result, blocking)
        assert set(result) == {"w", "i", "big", "s"}


@pytest.mark.mpi(min_size=1)
def test_each_kind_of_value_comes_back_as_all_reduce_gives_it(strategy):
    values = [np.arange(6.0).reshape(2, 3), [np.ones(2), np.zeros(3, np.int32)], (np.ones(1), 3.0), 2.5, 4,
              {"a": {"b": np.ones(2, np.float32)}}]

    def step():
        ctx = ms.get_replica_context()
        handles = [ctx.experimental_all_reduce_async("sum", v) for v in values]
        return [h.result() for h in handles], [ctx.all_reduce("sum", v) for v in values]

    for results, blocking in strategy.experimental_local_results(strategy.run(step)):
        for r, b in zip(results, blocking):
            assert_same(r, b)


@pytest.mark.mpi(min_size=1)
def test_one_device_and_mirrored_in_one_process():
    for strategy in (ms.OneDeviceStrategy("/cpu:0"), ms.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])):
        def step():
            ctx = ms.get_replica_context()
            g = ctx.replica_id_in_sync_group
            value = {"x": np.full(4, g + 1.0), "n": np.int32(g)}
            handle = ctx.experimental_all_reduce_async("mean", value)
            assert handle.done()  # one process: nothing crosses ranks, the reduction is done in the call
            return handle.result(), ctx.all_reduce("mean", value)

        for result, blocking in strategy.experimental_local_results(strategy.run(step)):
            assert_same(result, blocking)


def test_local_replicas_must_start_the_same_collectives():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def step():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            return ctx.experimental_all_reduce_async("sum", np.ones(2)).result()
        return ctx.all_reduce("sum", np.ones(2))

    with pytest.raises(CollectiveOrderError, match="replica 0: experimental_all_reduce_async, replica 1: all_reduce"):
        strategy.run(step)

    def ops_differ():
        ctx = ms.get_replica_context()
        op = "sum" if ctx.replica_id_in_sync_group == 0 else "max"
        return ctx.experimental_all_reduce_async(op, np.ones(2)).result()

    with pytest.raises(ValueError, match="different reduce ops"):
        strategy.run(ops_differ)


# ---------------------------------------------------------------------------- order


@pytest.mark.mpi(min_size=1)
def test_order_is_kept_with_interleaved_blocking_calls(strategy):
    # Each call has its own shape: a collective run out of order on any rank would be a mismatch.
    n = strategy.num_replicas_in_sync

    def step():
        ctx = ms.get_replica_context()
        g = ctx.replica_id_in_sync_group
        h1 = ctx.experimental_all_reduce_async("sum", np.full(3, g, np.float64))
        h2 = ctx.experimental_all_reduce_async("max", np.full((2, 2), g, np.int64))
        gathered = ctx.all_gather(np.full((1, 2), g), axis=0)
        assert h1.done() and h2.done()  # the blocking call ran after both had finished
        h3 = ctx.experimental_all_reduce_async("sum", np.full(5, 1.0, np.float32))
        blocking = ctx.all_reduce("sum", np.full(4, g, np.float64))
        assert h3.done()
        h4 = ctx.experimental_all_reduce_async("min", np.full(6, g, np.int32))
        return h1.result(), h2.result(), gathered, h3.result(), blocking, h4.result()

    total = n * (n - 1) / 2
    for r1, r2, gathered, r3, blocking, r4 in strategy.experimental_local_results(strategy.run(step)):
        assert np.array_equal(r1, np.full(3, total))
        assert np.array_equal(r2, np.full((2, 2), n - 1)) and r2.dtype == np.int64
        assert np.array_equal(gathered[:, 0], np.arange(n))
        assert np.array_equal(r3, np.full(5, float(n), np.float32))
        assert np.array_equal(blocking, np.full(4, total))
        assert np.array_equal(r4, np.zeros(6, np.int32))
    # across steps, and with a cross-replica reduction between
    h = strategy.run(lambda: ms.get_replica_context().experimental_all_reduce_async("sum", np.ones(2)))
    assert float(strategy.reduce("sum", strategy.run(lambda: np.float64(1.0)), axis=None)) == n
    for handle in strategy.experimental_local_results(h):
        assert handle.done() and np.array_equal(handle.result(), np.full(2, float(n)))


@pytest.mark.mpi(min_size=2)
def test_async_on_one_rank_meets_the_blocking_call_on_another():
    # The same collective either way: the agreement sees one call.
    comm = world()
    strategy = ms.MultiWorkerMirroredStrategy()

    def step():
        ctx = ms.get_replica_context()
        value = np.arange(4.0) + comm.rank
        if comm.rank % 2 == 0:
            return ctx.experimental_all_reduce_async("sum", value).result()
        return ctx.all_reduce("sum", value)

    expected = np.arange(4.0) * comm.size + comm.size * (comm.size - 1) / 2
    assert np.array_equal(strategy.run(step), expected)


# ---------------------------------------------------------------------------- errors


@pytest.mark.mpi(min_size=2)
def test_mismatches_raise_from_result_on_every_rank():
    comm = world()
    strategy = ms.MultiWorkerMirroredStrategy()
    last = comm.size - 1

    def attempt(op, value):
        """The error result() raises, asked twice; run itself raises nothing (the error was read)."""
        def step():
            handle = ms.get_replica_context().experimental_all_reduce_async(op, value)
            with pytest.raises(CollectiveMismatchError) as info:
                handle.result()
            with pytest.raises(CollectiveMismatchError) as again:  # asked again: the same error
                handle.result()
            assert again.value is info.value and handle.done()
            return str(info.value)
        return strategy.run(step)

    text = attempt("sum", np.ones(4 if comm.rank == 0 else 5))
    assert text.startswith("Mismatched allreduce shapes") and "rank 0 sent [(4,), float64]" in text, text
    text = attempt("sum", np.ones(3, np.float32 if comm.rank == last else np.float64))
    assert f"rank {last} sent [(3,), float32]" in text, text
    text = attempt("max" if comm.rank == 1 else "sum", np.ones(3))
    assert text.startswith("Mismatched allreduce op") and "rank 1 sent op=max" in text, text
    # nothing was left half-done
    assert float(strategy.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))) == comm.size


@pytest.mark.mpi(min_size=2)
def test_an_unread_failed_reduction_raises_at_the_end_of_run_on_every_rank():
    comm = world()
    strategy = ms.MultiWorkerMirroredStrategy()

    def step():
        ctx = ms.get_replica_context()
        ctx.experimental_all_reduce_async("sum", np.ones(2 + (comm.rank == 0)))
        return "returned"

    with pytest.raises(CollectiveMismatchError, match="Mismatched allreduce shapes") as info:
        strategy.run(step)
    assert any("never asked for its result()" in note for note in info.value.__notes__)
    assert float(strategy.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))) == comm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
def test_a_timeout_in_the_background_reaches_the_caller(backend_variant):
    if backend_variant != "auto":
        pytest.skip("the timeout path does not depend on the transport")
    comm = world()
    strategy = ms.MultiWorkerMirroredStrategy()
    late = comm.size - 1
    per_call = CommunicationOptions(timeout_seconds=1.0)
    if comm.rank == late:
        time.sleep(3.0)  # busy past the others' timeout

    def step():
        handle = ms.get_replica_context().experimental_all_reduce_async("sum", np.ones(3), options=per_call)
        with pytest.raises(CollectiveTimeoutError) as info:
            handle.result()
        return info.value

    error = strategy.run(step)
    if comm.rank != late:
        assert error.missing_ranks == [late] and f"rank {late} never arrived" in str(error)
    with pytest.raises(CommunicatorBrokenError):  # no half-done collective can follow
        strategy.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))


# ---------------------------------------------------------------------------- unread handles


@pytest.mark.mpi(min_size=1)
def test_an_unread_handle_is_finished_by_the_end_of_run(strategy):
    n = strategy.num_replicas_in_sync

    def step():
        ctx = ms.get_replica_context()
        ctx.experimental_all_reduce_async("sum", np.full(1 << 16, 1.0))  # never read
        return ctx.experimental_all_reduce_async("sum", np.full(3, 2.0))  # read after run

    handles = strategy.experimental_local_results(strategy.run(step))
    for handle in handles:
        assert handle.done()
        assert np.array_equal(handle.result(), np.full(3, 2.0 * n))
    communicator = strategy.extended._communicator
    if communicator is not None and communicator.size > 1:
        assert communicator._worker is not None and not communicator._worker.busy()
    after = strategy.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))
    assert [float(x) for x in strategy.experimental_local_results(after)] == [n] * strategy.extended._num_local


# ---------------------------------------------------------------------------- overlap


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_reduction_is_in_flight_while_the_caller_computes():
    # Rank 0 starts its reduction, then tells the others (over COMM_WORLD, not the strategy's
    # communicator) to start theirs: until they do it cannot be done, so rank 0's call returned
    # before the reduction ran. Then rank 0 computes until done() is True, never calling result().
    comm = world()
    strategy = ms.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=60))
    n = strategy.num_replicas_in_sync
    value = np.full(1 << 20, 1.0, np.float32)  # 4 MiB
    a = np.random.default_rng(comm.rank).standard_normal((128, 128))

    def step():
        ctx = ms.get_replica_context()
        if comm.rank == 0:
            handle = ctx.experimental_all_reduce_async("sum", value)
            assert not handle.done()  # the others have not started yet
            for r in range(1, comm.size):
                comm.send("go", dest=r, tag=77)
            computed = 0
            while not handle.done():  # the caller computes while the reduction runs
                a @ a
                computed += 1
            return handle, computed
        assert comm.recv(source=0, tag=77) == "go"
        handle = ctx.experimental_all_reduce_async("sum", value)
        while not handle.done():
            a @ a
        return handle, 0

    handle, _ = strategy.run(step)
    assert np.array_equal(handle.result(), np.full(1 << 20, float(n), np.float32))
    assert np.array_equal(value, np.full(1 << 20, 1.0, np.float32))


@pytest.mark.mpi(min_size=2)
def test_the_worker_is_a_separate_thread_and_mpi_allows_it():
    comm = RankCommunicator()
    try:
        assert MPI.Query_thread() == MPI.THREAD_MULTIPLE  # mpi4py's default; the worker needs it
        handle = comm.allreduce_async([np.ones(3)], "sum")
        handle.result()
        seen = [t.name for t in threading.enumerate() if t.name.startswith("mpistrat-comm-")]
        assert seen and threading.current_thread().name not in seen
    finally:
        comm.close()


# ---------------------------------------------------------------------------- RankCommunicator


@pytest.mark.mpi(min_size=1)
def test_communicator_async_results_and_order():
    comm = RankCommunicator()
    size = comm.size
    try:
        arrays = [np.arange(10, dtype=np.float64) * (comm.rank + 1), np.full((2, 3), comm.rank, np.int32)]
        originals = [a.copy() for a in arrays]
        handles = [comm.allreduce_async(arrays, op) for op in ("sum", "max", "min")]
        gathered = comm.allgather(np.array([comm.rank]))  # runs after the three
        assert all(h.done() for h in handles)
        assert np.array_equal(gathered, np.arange(size))
        expected = [comm.allreduce(arrays, op) for op in ("sum", "max", "min")]
        for h, e in zip(handles, expected):
            for x, y in zip(h.result(), e):
                assert x.dtype == y.dtype and np.array_equal(x, y)
        for a, o in zip(arrays, originals):
            assert np.array_equal(a, o)
        # in place: the inputs become the results once the handle is done
        mine = [np.full(4, comm.rank + 1.0)]
        result = comm.allreduce_async(mine, "sum", inplace=True).result()
        assert result[0] is mine[0] and np.array_equal(mine[0], np.full(4, size * (size + 1) / 2))
        # a broadcast, barrier and step agreement wait for what was started before them
        h = comm.allreduce_async([np.ones(5)], "sum")
        out = comm.broadcast([np.full(2, comm.rank, np.float64)], root=0)
        assert h.done() and np.array_equal(out[0], np.zeros(2))
        h = comm.allreduce_async([np.ones(5)], "sum")
        comm.barrier()
        assert h.done()
        h = comm.allreduce_async([np.ones(5)], "sum")
        assert list(comm.step_agreement(7)) == [7] * size and h.done()
        # a local argument error travels like the blocking call's: raised by result() on every rank
        bad = comm.allreduce_async([np.ones(2)], "median")
        with pytest.raises((CollectiveMismatchError, ValueError), match="median"):
            bad.result()
    finally:
        comm.close()


@pytest.mark.mpi(min_size=2)
def test_repeated_blocking_calls_keep_the_lean_path_after_an_async_call_and_wait_for_it():
    """Once a communicator has run an asynchronous call, a repeated blocking all-reduce (one array, or a list
    of NumPy arrays) still takes the repeat path, not the general one, after what was started before it;
    the worker's own repeats take it too, but not the compiled lane, which holds the GIL."""
    comm = RankCommunicator()
    try:
        single = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
        grads = [np.full(300, comm.rank + 1.0, np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)]
        expected = [comm.allreduce([single], "sum"), comm.allreduce(grads, "sum")]  # planned
        comm.allreduce_async([np.ones(5)], "sum").result()
        assert comm._worker is not None, "the asynchronous call ran on the communicator's worker"
        general = []
        planned = comm._allreduce

        def counted(*args, **kwargs):
            general.append(args)
            return planned(*args, **kwargs)

        comm._allreduce = counted  # the general path (plan, agreement, execute), called by allreduce
        plan = next(p for key, p in comm._planner.singles.items() if key[2] == single.shape)
        lane_threads = []
        if plan.lane is not None:  # the compiled lane of this layout: record the threads calling it
            compiled = plan.lane

            def lane(src, dst):
                lane_threads.append(threading.get_ident())
                return compiled(src, dst)

            plan.lane = lane
        for _ in range(3):
            from_worker = comm.allreduce_async([single], "sum")
            assert np.array_equal(from_worker.result()[0], expected[0][0])
            started = comm.allreduce_async([np.full(1 << 16, 2.0)], "sum")
            got = comm.allreduce([single], "sum")
            assert started.done(), "the blocking call ran after the one started before it"
            later = comm.allreduce_async([np.full(7, 3.0)], "max")
            got_list = comm.allreduce(grads, "sum")
            assert later.done()
            assert np.array_equal(got[0], expected[0][0])
            assert all(np.array_equal(x, y) for x, y in zip(got_list, expected[1]))
        # only the first asynchronous call of each signature plans; every repeat takes the repeat path
        assert [args[1] for args in general] == ["sum", "max"]
        if plan.lane is not None:
            assert lane_threads and set(lane_threads) == {threading.get_ident()}, "the caller's calls only"
    finally:
        comm.close()


@pytest.mark.mpi(min_size=1)
def test_close_finishes_what_was_started():
    comm = RankCommunicator()
    handles = [comm.allreduce_async([np.full(1 << 14, float(i))], "sum") for i in range(8)]
    comm.close()
    assert all(h.done() for h in handles)
    for i, h in enumerate(handles):
        assert np.array_equal(h.result()[0], np.full(1 << 14, float(i) * comm.size))
    if comm.size > 1:
        with pytest.raises(RuntimeError, match="closed"):
            comm.allreduce_async([np.ones(2)], "sum")


# ---------------------------------------------------------------------------- processes


PROGRAM = textwrap.dedent("""
    import sys
    import mpi4py
    if sys.argv[1] == "serialized":
        mpi4py.rc.thread_level = "serialized"
    import numpy as np
    from mpi4py import MPI
    import mpistrat as ms
    from mpistrat.comm import RankCommunicator

    comm = RankCommunicator()
    handle = comm.allreduce_async([np.ones(1 << 16)], "sum")
    if sys.argv[1] == "serialized":
        assert MPI.Query_thread() < MPI.THREAD_MULTIPLE
        assert handle.done()  # no worker thread: it ran in the call
        assert handle.result()[0][0] == comm.size
    strategy = ms.MultiWorkerMirroredStrategy()
    strategy.run(lambda: ms.get_replica_context().experimental_all_reduce_async("sum", np.ones(8)))
    # the communicator's handle is never read and nothing is closed: the program just ends
    print("rank", MPI.COMM_WORLD.rank, "ends")
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["multiple", "serialized"])
def test_a_program_ends_with_unread_handles_and_below_thread_multiple(tmp_path, level, backend_variant):
    if world().size > 1 or backend_variant != "auto":
        pytest.skip("starts its own mpiexec from one process")
    sys.path.insert(0, os.path.dirname(__file__))
    from mpirun import clean_env, run_job

    script = tmp_path / "unread.py"
    script.write_text(PROGRAM)
    job = run_job([str(script), level], ranks=2, limit=90, env=clean_env(MPISTRAT_TIMEOUT_SECONDS="30"))
    assert job.returncode == 0, job.output
    assert job.output.count("ends") == 2, job.output
    assert "Traceback" not in job.output and "exited" not in job.output, job.output


@pytest.mark.mpi(min_size=2)
def test_mean_against_sum_is_a_mismatch_as_for_the_blocking_call():
    # The check covers the logical op: MEAN (a sum and its divisor) is not SUM.
    comm = world()
    strategy = ms.MultiWorkerMirroredStrategy()
    op = "mean" if comm.rank == 0 else "sum"

    def step():
        handle = ms.get_replica_context().experimental_all_reduce_async(op, np.ones(3))
        with pytest.raises(CollectiveMismatchError, match="Mismatched allreduce") as info:
            handle.result()
        with pytest.raises(CollectiveMismatchError) as blocking:
            ms.get_replica_context().all_reduce(op, np.ones(3))
        return str(info.value).split(": ", 1)[1], str(blocking.value).split(": ", 1)[1]

    asynchronous, blocking = strategy.run(step)
    assert asynchronous == blocking and "mean" in asynchronous, (asynchronous, blocking)
