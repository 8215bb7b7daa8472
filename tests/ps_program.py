"""A parameter-server job for tests/test_parameter_server.py: ``mpiexec -n 4|5 python tests/ps_program.py CASES``.

Laid out as TensorFlow's parameter-server tutorial: ps and worker ranks call ``Server(...).join()`` near the
top; the chief defines its functions in ``__main__`` after that branch (so they travel by value). The chief
checks each case and prints ``ok <case>``; a failed check raises (the job aborts, the test sees it).
"""

import os
import signal
import sys
import time

import numpy as np

import mpistrat as ms

resolver = ms.cluster_resolver.MPIClusterResolver(num_ps=int(os.environ.get("PS_COUNT", "1")))
if resolver.task_type in ("ps", "worker"):
    if resolver.task_type == "ps" and os.environ.get("PS_PID_DIR"):
        with open(os.path.join(os.environ["PS_PID_DIR"], f"ps{resolver.task_id}"), "w") as f:
            f.write(str(os.getpid()))
    server = ms.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id)
    server.join()
    print(f"{resolver.task_type} {resolver.task_id} returned from join", flush=True)
    sys.exit(0)

from mpistrat.coordinator import (
    ClusterCoordinator,
    experimental_get_current_worker_index,
)
from mpistrat.errors import CancelledError, UnavailableError

cases = sys.argv[1].split(",")
num_ps = resolver.num_ps
strategy = ms.ParameterServerStrategy(resolver, timeout_seconds=float(os.environ.get("PS_TIMEOUT", "30")))
coordinator = ClusterCoordinator(strategy)
num_workers = len(resolver.cluster_spec().as_dict()["worker"])


def ok(case):
    print(f"ok {case}", flush=True)


if "placement" in cases:
    with strategy.scope():
        vs = [ms.Variable(float(i), name=f"v{i}") for i in range(4)]
    assert [v.device for v in vs] == [f"/job:ps/replica:0/task:{i % num_ps}/device:CPU:0" for i in range(4)], \
        [v.device for v in vs]
    outside = ms.Variable(1.0)  # outside scope(): stays on the coordinator
    assert type(outside).__name__ == "Variable" and float(outside.numpy()) == 1.0
    ok("placement")

if "count" in cases:
    with strategy.scope():
        counter = ms.Variable(0, dtype="int64", name="counter")

    def add_one():
        counter.assign_add(1)

    for _ in range(100):
        coordinator.schedule(add_one)
    coordinator.join()
    assert int(counter.numpy()) == 100, counter.numpy()
    ok("count")

if "remote_value" in cases:  # TF's RemoteValue example
    with strategy.scope():
        v1 = ms.Variable(initial_value=0.0)
        v2 = ms.Variable(initial_value=1.0)

    def worker_fn():
        v1.assign_add(0.1)
        v2.assign_sub(0.2)
        return v1.read_value() / v2.read_value()

    result = coordinator.schedule(worker_fn)
    assert result.fetch() == 0.125, result.fetch()
    for _ in range(10):
        result = coordinator.schedule(worker_fn)
    coordinator.join()
    # eleven runs in all, each atomic per variable; the last returned value depends on the interleaving
    assert np.isclose(float(v1.numpy()), 1.1) and np.isclose(float(v2.numpy()), 1.0 - 2.2)
    assert np.shape(coordinator.fetch([result])[0]) == ()
    ok("remote_value")

if "shards" in cases:
    partitioner = ms.experimental.partitioners.FixedShardsPartitioner(5)
    sharded_strategy = strategy
    sharded_strategy.extended._variable_partitioner = partitioner
    with sharded_strategy.scope():
        table = ms.Variable(np.arange(13 * 2, dtype=np.float32).reshape(13, 2), name="table")
    sharded_strategy.extended._variable_partitioner = None
    rows = [v.shape[0] for v in table.variables]
    assert rows == [3, 3, 3, 2, 2], rows  # TF's split of 13 rows over 5 shards
    tasks = [int(v.device.split("task:")[1].split("/")[0]) for v in table.variables]
    assert tasks == [(tasks[0] + i) % num_ps for i in range(5)], tasks  # the shards go round-robin too
    np.testing.assert_array_equal(np.concatenate([v.numpy() for v in table.variables]),
                                  np.arange(26, dtype=np.float32).reshape(13, 2))
    ok("shards")

if "errors" in cases:
    with strategy.scope():
        progress = ms.Variable(0, dtype="int64")

    def step(i):
        if i == 4:
            raise KeyError(f"step {i} failed")
        time.sleep(0.05)
        progress.assign_add(1)
        return i

    values = [coordinator.schedule(step, args=(i,)) for i in range(10)]
    try:
        coordinator.join()
    except KeyError as exc:
        assert "step 4 failed" in str(exc) and any("traceback" in n for n in getattr(exc, "__notes__", [])), exc
    else:
        raise AssertionError("join() did not raise the scheduled function's error")
    fetched = cancelled = 0
    for i, value in enumerate(values):
        if i == 4:
            continue
        try:
            assert value.fetch() == i
            fetched += 1
        except CancelledError:
            cancelled += 1
    assert fetched + cancelled == 9 and cancelled >= 1, (fetched, cancelled)
    try:
        values[4].fetch()
        raise AssertionError("the failed function's value did not raise")
    except KeyError:
        pass
    coordinator.join()  # the error was raised once: the next join is clean
    assert coordinator.done()
    exiting = coordinator.schedule(sys.exit, args=(3,))  # a function's SystemExit is its error; the worker serves on
    try:
        coordinator.join()
        raise AssertionError("SystemExit in a scheduled function was not raised")
    except SystemExit as exc:
        assert exc.code == 3
    assert coordinator.schedule(lambda: 7).fetch() == 7 and coordinator.schedule(lambda: 8).fetch() == 8
    del exiting
    ok("errors")

if "remote_value_argument" in cases:
    first = coordinator.schedule(lambda: 1)
    try:
        coordinator.schedule(lambda x: x, args=(first,))
        raise AssertionError("a RemoteValue argument was accepted")
    except ValueError as exc:
        assert "RemoteValue` used as an input to scheduled function is not yet supported" in str(exc)
    coordinator.join()
    ok("remote_value_argument")

if "worker_index" in cases:
    seen = {coordinator.schedule(experimental_get_current_worker_index).fetch() for _ in range(8 * num_workers)}
    assert seen <= set(range(num_workers)) and seen, seen
    try:
        experimental_get_current_worker_index()
        raise AssertionError("the worker index was given outside a scheduled function")
    except ValueError:
        pass
    ok("worker_index")

if "datasets" in cases:  # each worker reads its own shard (InputContext(num_workers, worker index)), in order

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(
            lambda ctx: ms.data.Dataset.range(8).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2).repeat())

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    def take(iterator):
        return experimental_get_current_worker_index(), np.asarray(next(iterator)).tolist()

    got = [coordinator.schedule(take, args=(per_worker_iterator,)) for _ in range(4 * num_workers)]
    coordinator.join()
    by_worker = {}
    for index, batch in (v.fetch() for v in got):
        by_worker.setdefault(index, []).append(batch)
    for index, batches in by_worker.items():
        shard = list(range(index, 8, num_workers))
        expected = [shard[k:k + 2] for k in range(0, len(shard), 2)]
        assert batches == [expected[k % len(expected)] for k in range(len(batches))], (index, batches)
    ok("datasets")

if "staleness" in cases:  # staleness 0: synchronous rounds, so a slow worker runs as many functions as a fast one
    from mpistrat.distribute.parameter_server.coordinator import (
        ClusterCoordinator as CC,
    )

    strategy._coordinator = None
    ssp = CC(strategy, staleness=0)

    def record(k):
        index = experimental_get_current_worker_index()
        time.sleep(0.02 * (index + 1) ** 2)  # worker 1 is 4 times as slow as worker 0
        return index

    ran = [ssp.schedule(record, args=(k,)) for k in range(6 * num_workers)]
    ssp.join()
    counts = np.bincount([v.fetch() for v in ran], minlength=num_workers).tolist()
    assert counts == [6] * num_workers, counts
    strategy._coordinator = None
    bounded = CC(strategy, staleness=1)  # a worker starts its function k only after every worker finished k - 2
    ran = [bounded.schedule(record, args=(k,)) for k in range(6 * num_workers)]
    bounded.join()
    counts = np.bincount([v.fetch() for v in ran], minlength=num_workers).tolist()
    assert max(counts) - min(counts) <= 2, counts  # at most s + 1 apart; unbounded, the fast worker runs far more
    strategy._coordinator = None
    free = CC(strategy)  # TF's asynchronous scheduling: the fast worker runs more of them
    ran = [free.schedule(record, args=(k,)) for k in range(6 * num_workers)]
    free.join()
    counts = np.bincount([v.fetch() for v in ran], minlength=num_workers).tolist()
    assert counts[0] > counts[-1], counts
    coordinator = free
    ok("staleness")

if "unavailable" in cases:  # a ps stopped for real (SIGSTOP): the coordinator's request times out, no hang
    from mpistrat.distribute.parameter_server import protocol

    with strategy.scope():
        w = ms.Variable(1.0)  # on ps 0 (the placement counter restarted with this run's variables)
    w_ps = int(w.device.split("task:")[1].split("/")[0])
    with open(os.path.join(os.environ["PS_PID_DIR"], f"ps{w_ps}")) as f:
        pid = int(f.read())
    rt = protocol.runtime()
    rt.timeout_seconds, saved = 2.0, rt.timeout_seconds
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        try:
            w.numpy()
            raise AssertionError("a stopped ps answered")
        except UnavailableError as exc:
            elapsed = time.monotonic() - start
            assert 1.5 < elapsed < 10 and "did not answer within 2 s" in str(exc), (elapsed, exc)
    finally:
        os.kill(pid, signal.SIGCONT)
    rt.timeout_seconds = saved
    assert float(w.numpy()) == 1.0  # answered again; the late answer of the timed-out read was dropped
    ok("unavailable")

if "optimizer" in cases:  # slots and iterations built on the chief live on the ps: momentum and Adam as locally
    grads = [np.full(3, g, np.float32) for g in (0.5, -1.0, 2.0, 0.25, 1.0)]
    for make in (lambda: ms.optimizers.SGD(0.1, momentum=0.9), lambda: ms.optimizers.Adam(0.01)):
        with strategy.scope():
            w = ms.Variable(np.ones(3, np.float32))
            opt = make()
            opt.build([w])
        assert all(type(v).__name__ == "RemoteVariable" for v in opt.variables), opt.variables

        def apply(g, opt=opt, w=w):
            opt.apply_gradients([(g, w)])

        for g in grads:  # one at a time, so the expected values are a sequential run's
            coordinator.schedule(apply, args=(g,)).fetch()
        local_w, local_opt = ms.Variable(np.ones(3, np.float32)), make()
        for g in grads:
            local_opt.apply_gradients([(g, local_w)])
        np.testing.assert_allclose(w.numpy(), local_w.numpy(), rtol=1e-6)
        assert int(opt.iterations.numpy()) == len(grads)

    def make_variable():
        ms.Variable(1.0, name="made_on_a_worker")

    try:
        coordinator.schedule(make_variable)
        coordinator.join()
        raise AssertionError("a variable was created on a worker")
    except RuntimeError as exc:
        assert "'made_on_a_worker' created in a function scheduled on a worker" in str(exc), exc
    ok("optimizer")

if "save" in cases or "restore" in cases:  # a checkpoint of ps-held variables, the sharded one included
    shards = int(os.environ.get("PS_SHARDS", "3"))
    strategy.extended._variable_partitioner = ms.experimental.partitioners.FixedShardsPartitioner(shards)
    with strategy.scope():
        emb = ms.Variable(np.zeros((13, 2), np.float32), name="emb")
    strategy.extended._variable_partitioner = None
    with strategy.scope():
        steps = ms.Variable(0, dtype="int64", name="steps")

    def train_step():
        emb.assign_add(np.ones((13, 2), np.float32))
        steps.assign_add(1)

    ckpt = ms.Checkpoint(emb=emb, steps=steps)
    path = os.path.join(os.environ["PS_CKPT_DIR"], "ps.npz")
    if "restore" in cases:
        manager = ms.CheckpointManager(ckpt, os.path.join(os.environ["PS_CKPT_DIR"], "managed"), max_to_keep=2)
        ckpt.restore(manager.latest_checkpoint)  # the manager's copy of the same state
        assert int(steps.numpy()) == 10 and (emb.numpy() == 10).all(), (steps.numpy(), emb.numpy())
        emb.assign(np.zeros((13, 2), np.float32))
        steps.assign(0)
        ckpt.restore(path)
        assert int(steps.numpy()) == 10 and (emb.numpy() == 10).all(), (steps.numpy(), emb.numpy())
    for _ in range(10):
        coordinator.schedule(train_step)
    coordinator.join()
    if "save" in cases:
        ckpt.write(path)
        manager = ms.CheckpointManager(ckpt, os.path.join(os.environ["PS_CKPT_DIR"], "managed"), max_to_keep=2)
        saved = manager.save()
        assert manager.latest_checkpoint == saved, (manager.latest_checkpoint, saved)
    done = 20 if "restore" in cases else 10
    assert int(steps.numpy()) == done and (emb.numpy() == done).all()
    ok("restore" if "restore" in cases else "save")

print("chief done", flush=True)
