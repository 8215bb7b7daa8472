"""Distributed datasets on one worker: batch splitting, options, iterators, prefetch lifecycle."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import mpistrat.data as D
from mpistrat.data import InputPipelineError, InvalidArgumentError, OutOfRangeError, TensorSpec
from mpistrat.data.distribute import DistributedDataset, DistributedDatasetsFromFunction
from mpistrat.data.prefetch import live_producer_threads
from mpistrat.data.spec import PerReplicaSpec
from mpistrat.data.splitting import rotated_sizes, split_sizes
from mpistrat.distribute.input_options import InputContext, InputOptions, InputReplicationMode, InputWorkerInfo
from mpistrat.distribute.values import PerReplica

ONE = InputWorkerInfo.single(("/cpu:0",))
TWO = InputWorkerInfo.single(("/cpu:0", "/cpu:1"))
THREE = InputWorkerInfo.single(("/cpu:0", "/cpu:1", "/cpu:2"))
BUFFERS = [InputOptions(experimental_per_replica_buffer_size=0), InputOptions(), InputOptions(experimental_per_replica_buffer_size=3),
           InputOptions(experimental_fetch_to_device=False)]


def values(x):
    return [v.tolist() for v in x.values] if isinstance(x, PerReplica) else [x.tolist()]


def wait_threads(n, timeout=5.0):
    deadline = time.time() + timeout
    while len(live_producer_threads()) > n and time.time() < deadline:
        time.sleep(0.01)
    return len(live_producer_threads())


def test_split_sizes_match_numpy_array_split_and_tf_rotation():
    for n in range(0, 12):
        for parts in range(1, 6):
            assert split_sizes(n, parts) == [len(a) for a in np.array_split(np.arange(n), parts)]
    # tf batch_sizes_for_worker docstring: G=7, W=2, R=2 -> worker 0 [2,2,2,1], worker 1 [2,1,2,2]
    assert rotated_sizes(7, 2, 2, 0) == [2, 2, 2, 1]
    assert rotated_sizes(7, 2, 2, 1) == [2, 1, 2, 2]


@pytest.mark.parametrize("options", BUFFERS)
def test_one_replica_gets_whole_batches(options):
    dist = DistributedDataset(D.Dataset.range(7).batch(3), ONE, options)
    assert [values(x) for x in dist] == [[[0, 1, 2]], [[3, 4, 5]], [[6]]]
    assert [values(x) for x in dist] == [[[0, 1, 2]], [[3, 4, 5]], [[6]]]  # a new pass each iter


@pytest.mark.parametrize("options", BUFFERS)
def test_two_local_replicas_array_split_and_empty_batches(options):
    ds = D.Dataset.from_tensor_slices((np.arange(7, dtype=np.float32).reshape(7, 1), np.arange(7))).batch(3)
    steps = list(DistributedDataset(ds, TWO, options))
    # TF: a tuple element yields a tuple of PerReplica leaves (input_lib._create_per_replica)
    assert len(steps) == 3 and all(type(s) is tuple and all(isinstance(v, PerReplica) for v in s) for s in steps)
    feats = [[v[:, 0].tolist() for v in s[0].values] for s in steps]
    assert feats == [[[0, 1], [2]], [[3, 4], [5]], [[6], []]]
    features, labels = steps[2]
    empty_x, empty_y = features.values[1], labels.values[1]
    assert empty_x.shape == (0, 1) and empty_x.dtype == np.float32 and empty_y.shape == (0,) and empty_y.dtype == np.int64


def test_three_replicas_partial_batch_smaller_than_replicas():
    steps = list(DistributedDataset(D.Dataset.range(5).batch(4), THREE, None))
    assert [values(s) for s in steps] == [[[0, 1], [2], [3]], [[4], [], []]]


def test_dict_elements_and_bytes():
    ds = D.Dataset.from_tensor_slices({"x": np.arange(4), "s": [b"a", b"b", b"c", b"d"]}).batch(4)
    (step,) = list(DistributedDataset(ds, TWO, None))
    assert step["s"].values[0].tolist() == [b"a", b"b"] and step["x"].values[1].tolist() == [2, 3]


def test_element_spec_and_iterator_api():
    dist = DistributedDataset(D.Dataset.range(4).batch(2), TWO, None)
    spec = TensorSpec((None,), np.dtype(np.int64))
    assert dist.element_spec == PerReplicaSpec((spec, spec))
    single = DistributedDataset(D.Dataset.range(4).batch(2, drop_remainder=True), ONE, None)
    static = TensorSpec((2,), np.dtype(np.int64))  # TF: one replica in sync keeps the dataset's spec
    assert single.element_spec == static
    it = iter(single)
    assert it.element_spec == static
    assert it.get_next().tolist() == [0, 1]
    opt = it.get_next_as_optional()
    assert opt.has_value() and opt.get_value().tolist() == [2, 3]
    end = it.get_next_as_optional()
    assert not end.has_value() and end.element_spec == static
    with pytest.raises(InvalidArgumentError, match="The given optional does not have a value"):
        end.get_value()
    with pytest.raises(OutOfRangeError, match="End of sequence"):
        it.get_next()
    with pytest.raises(StopIteration):
        next(it)


def test_reduce():
    dist = DistributedDataset(D.Dataset.range(10).batch(4), TWO, None)
    total = dist.reduce(0, lambda s, x: s + sum(int(v.sum()) for v in x.values))
    assert total == 45
    steps = dist.reduce(0, lambda s, x: s + 1)
    assert steps == 3


def test_transformations_after_distribution_raise():
    dist = DistributedDataset(D.Dataset.range(4).batch(2), ONE, None)
    for name in ["map", "batch", "shuffle", "repeat", "filter", "prefetch"]:
        with pytest.raises(AttributeError, match=f"cannot be transformed. Apply .{name}"):
            getattr(dist, name)


def test_unbatched_dataset_is_rejected_with_a_clear_error():
    with pytest.raises(InputPipelineError, match="call .batch"):
        list(DistributedDataset(D.Dataset.range(4), TWO, None))


def test_bad_arguments():
    with pytest.raises(TypeError, match="mpistrat.data.Dataset"):
        DistributedDataset([1, 2, 3], ONE, None)
    with pytest.raises(TypeError, match="InputWorkerInfo"):
        DistributedDataset(D.Dataset.range(2).batch(1), object(), None)
    with pytest.raises(NotImplementedError, match="PER_REPLICA is only supported in `distribute_datasets_from_function`"):
        DistributedDataset(D.Dataset.range(2).batch(1), ONE,
                           InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA))
    with pytest.raises(ValueError, match="experimental_per_replica_buffer_size"):
        DistributedDataset(D.Dataset.range(2).batch(1), ONE, InputOptions(experimental_per_replica_buffer_size=-1))
    with pytest.raises(ValueError, match="must also specify `PER_REPLICA`"):
        DistributedDatasetsFromFunction(lambda c: D.Dataset.range(1), ONE, InputOptions(experimental_place_dataset_on_device=True))
    with pytest.raises(ValueError, match="can not be set to True when experimental_fetch_to_device is True"):
        DistributedDatasetsFromFunction(lambda c: D.Dataset.range(1), ONE, InputOptions(
            experimental_place_dataset_on_device=True, experimental_replication_mode=InputReplicationMode.PER_REPLICA))
    with pytest.raises(TypeError, match="dataset_fn must return"):
        DistributedDatasetsFromFunction(lambda c: [1], ONE, None)


def test_input_options_defaults_and_context():
    o = InputOptions()
    assert o.experimental_fetch_to_device is True  # TF: None means True (tf.distribute.InputOptions.__new__)
    assert o.experimental_replication_mode == InputReplicationMode.PER_WORKER
    assert o.experimental_place_dataset_on_device is False and o.experimental_per_replica_buffer_size == 1
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 4)
    assert ctx.get_per_replica_batch_size(8) == 2
    with pytest.raises(ValueError, match=r"The `global_batch_size` 6 is not divisible by `num_replicas_in_sync` 4 "):
        ctx.get_per_replica_batch_size(6)
    assert str(ctx) == "mpistrat.InputContext(input pipeline id 1, total: 2)"
    with pytest.raises(ValueError, match="num_replicas_in_sync"):
        InputWorkerInfo(1, 0, ("/cpu:0",), 2, 0, None)
    with pytest.raises(ValueError, match="need a communicator"):
        InputWorkerInfo(2, 0, ("/cpu:0",), 2, 0, None)


def test_datasets_from_function_per_worker_and_per_replica():
    seen = []

    def fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return D.Dataset.range(ctx.input_pipeline_id * 100, ctx.input_pipeline_id * 100 + 5).batch(ctx.get_per_replica_batch_size(4))

    dist = DistributedDatasetsFromFunction(fn, TWO, None)
    assert seen == [(1, 0, 2)]
    # one dataset feeds both replicas: two batches dequeued per step
    assert [values(s) for s in dist] == [[[0, 1], [2, 3]], [[4], []]]
    seen.clear()
    per_rep = DistributedDatasetsFromFunction(
        fn, TWO, InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA))
    assert seen == [(2, 0, 2), (2, 1, 2)]
    assert [values(s) for s in per_rep] == [[[0, 1], [100, 101]], [[2, 3], [102, 103]], [[4], [104]]]
    assert per_rep.element_spec == PerReplicaSpec((TensorSpec((None,), np.dtype(np.int64)),) * 2)


def test_prefetch_thread_runs_ahead_and_stops_with_the_iterator():
    before = len(live_producer_threads())
    produced = []

    def note(x):
        produced.append(int(x[0]))
        return x

    ds = D.Dataset.range(1000).batch(2).map(note)
    it = iter(DistributedDataset(ds, ONE, InputOptions(experimental_per_replica_buffer_size=2)))
    assert next(it).tolist() == [0, 1]
    deadline = time.time() + 5
    while len(produced) < 4 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(produced) >= 3  # the thread prepared batches ahead of the consumer
    # but only buffer_size ahead: 1 handed out + <= buffer queued + 1 being made
    assert len(produced) <= 1 + 2 + 1
    assert len(live_producer_threads()) == before + 1
    it.close()
    assert wait_threads(before) == before
    with pytest.raises(StopIteration):
        next(it)
    # no thread without prefetch
    it = iter(DistributedDataset(ds, ONE, InputOptions(experimental_per_replica_buffer_size=0)))
    next(it)
    assert len(live_producer_threads()) == before
    # a finished pass leaves no thread
    list(DistributedDataset(D.Dataset.range(6).batch(2), TWO, None))
    assert wait_threads(before) == before
    # an abandoned iterator's thread ends too
    it = iter(DistributedDataset(D.Dataset.range(10**6).batch(2), TWO, None))
    next(it)
    del it
    assert wait_threads(before) == before


@pytest.mark.parametrize("buffer", [0, 1, 2])
def test_prefetch_prepares_the_next_step_while_the_current_one_computes(buffer):
    """Overlap without timing: during step t's "compute" the input of step t + 1 is (or is not) made."""
    made = {i: threading.Event() for i in range(8)}

    def note(x):
        made[int(x[0])].set()
        return x

    ds = D.Dataset.range(8).batch(1).map(note)
    overlapped = []
    for step, x in enumerate(DistributedDataset(ds, ONE, InputOptions(experimental_per_replica_buffer_size=buffer))):
        assert x.tolist() == [step]
        if step + 1 < 8:  # "compute": wait for the next step's input to be made meanwhile
            overlapped.append(made[step + 1].wait(timeout=10 if buffer else 0.05))
    # with a prefetch thread, every next input is made during the current step; without it, none is
    assert overlapped == [bool(buffer)] * 7


@pytest.mark.parametrize("buffer", [0, 2])
def test_read_error_propagates_to_consumer(tmp_path, buffer):
    path = tmp_path / "d.tfrecord"
    with D.TFRecordWriter(path) as w:
        for i in range(6):
            w.write(bytes([i]) * 8)
    data = bytearray(path.read_bytes())
    data[3 * 24 + 14] ^= 1  # record 3's data
    path.write_bytes(bytes(data))
    ds = D.TFRecordDataset(str(path)).map(lambda r: np.frombuffer(r, np.uint8)).batch(2)
    before = len(live_producer_threads())
    it = iter(DistributedDataset(ds, ONE, InputOptions(experimental_per_replica_buffer_size=buffer)))
    assert next(it).shape == (2, 8)
    with pytest.raises(InputPipelineError, match=r"failed on rank\(s\) \[0\].*DataLossError.*byte offset 72.*d\.tfrecord") as info:
        next(it)
    assert isinstance(info.value.__cause__, D.DataLossError)
    with pytest.raises(InputPipelineError):
        next(it)  # stays failed
    assert wait_threads(before) == before  # the failed pass left no thread behind


def test_missing_file_error_names_file(tmp_path):
    ds = D.TFRecordDataset(str(tmp_path / "gone.tfrecord")).batch(2)
    with pytest.raises(InputPipelineError, match=r"rank 0: TFRecord file .*gone\.tfrecord.* not found \(byte offset 0\)"):
        list(DistributedDataset(ds, TWO, None))


def test_interpreter_exits_with_an_unfinished_prefetching_iterator(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "import mpistrat.data as D\n"
        "from mpistrat.data.distribute import DistributedDataset\n"
        "from mpistrat.distribute.input_options import InputOptions, InputWorkerInfo\n"
        "ds = D.Dataset.range(10).repeat().batch(2).prefetch(2)\n"
        "it = iter(DistributedDataset(ds, InputWorkerInfo.single(('/cpu:0', '/cpu:1')), InputOptions(experimental_per_replica_buffer_size=4)))\n"
        "next(it)\n"
        "keep = it\n"
        "print('done')\n"
    )
    t0 = time.time()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert time.time() - t0 < 30


def test_place_dataset_on_device_per_replica_hands_out_without_a_thread():
    before = len(live_producer_threads())
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
                           experimental_fetch_to_device=False, experimental_place_dataset_on_device=True)
    it = iter(DistributedDatasetsFromFunction(lambda ctx: D.Dataset.range(4).batch(2), TWO, options))
    assert values(next(it)) == [[0, 1], [0, 1]]  # one dataset per replica, placed on its (CPU) device
    assert len(live_producer_threads()) == before
    assert [values(s) for s in it] == [[[2, 3], [2, 3]]]


def test_byte_budget_bounds_what_the_prefetch_thread_holds():
    """A producer with a byte budget holds at most its min_items, or more only while they fit."""
    from mpistrat.data.prefetch import BackgroundProducer, ByteBudget

    budget = ByteBudget(max_bytes=100, min_items=2, sizeof=len)
    items = [b"x" * 60, b"y" * 60, b"z" * 10, b"w" * 90]
    producer = BackgroundProducer(lambda: iter(items), 10, budget=budget)
    try:
        deadline = time.time() + 5
        while not budget.blocked and time.time() < deadline:
            time.sleep(0.01)
        assert budget.blocked and budget.used == 120  # two items (min_items) although they exceed 100
        assert producer.wait_ready(4) == 2  # waiting for more would wait forever: it returns what is there
        assert next(producer) == items[0]  # frees 60: z (10) fits beside y, w (90) does not
        while budget.used != 70 and time.time() < deadline:
            time.sleep(0.01)
        assert budget.used == 70 and budget.blocked
        assert list(producer) == items[1:]
        assert budget.used == 0
    finally:
        producer.close()


def test_wait_ready_with_patience_returns_what_it_has():
    from mpistrat.data.prefetch import BackgroundProducer

    def slow():
        yield 0
        time.sleep(1.0)
        yield 1

    producer = BackgroundProducer(slow, 4)
    try:
        t0 = time.monotonic()
        assert producer.wait_ready(3, patience=0.05) == 1  # one step, then at most the patience
        assert time.monotonic() - t0 < 0.8
        assert list(producer) == [0, 1]
    finally:
        producer.close()


@pytest.mark.timeout(30)
def test_wait_ready_returns_when_the_budget_fills_while_it_waits():
    """The thread blocks on the byte budget after wait_ready began waiting: wait_ready must notice
    (it used to check once, then wait forever for an item the thread would never make)."""
    from mpistrat.data.prefetch import BackgroundProducer, ByteBudget

    def slow_items():
        for i in range(20):
            time.sleep(0.05)
            yield bytes([i]) * 100

    budget = ByteBudget(max_bytes=300, min_items=1, sizeof=len)
    producer = BackgroundProducer(slow_items, 8, budget=budget)
    try:
        t0 = time.monotonic()
        ready = producer.wait_ready(8)  # 8 would need 800 bytes: the budget stops the thread at 3 items
        assert ready == 3 and budget.blocked
        assert time.monotonic() - t0 < 5
        assert [x[0] for x in producer] == list(range(20))
    finally:
        producer.close()
