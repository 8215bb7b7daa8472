"""The input pipeline through the strategies' public methods (seed 000's examples)."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms


def test_one_device_strategy_distribute_dataset_seed_example():
    strategy = ms.OneDeviceStrategy("/cpu:0")
    dataset = ms.data.Dataset.range(10).batch(2)
    dist = strategy.experimental_distribute_dataset(dataset)
    assert [x.tolist() for x in dist] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_one_device_strategy_datasets_from_function_seed_example():
    strategy = ms.OneDeviceStrategy("/cpu:0")
    global_batch_size = 4

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        d = ms.data.Dataset.from_tensors([[1.0]]).repeat().batch(batch_size)
        return d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    inputs = strategy.distribute_datasets_from_function(dataset_fn)
    batch = next(iter(inputs))
    assert batch.shape == (4, 1, 1) and float(batch.sum()) == 4.0


def test_mirrored_strategy_splits_the_global_batch_and_sums():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    dist = strategy.experimental_distribute_dataset(ms.data.Dataset.range(21).batch(8))
    total = 0
    for x in dist:
        assert isinstance(x, ms.PerReplica)
        per_replica = strategy.run(lambda v: np.sum(v), args=(x,))
        total += int(strategy.reduce(ms.ReduceOp.SUM, per_replica, axis=None))
    assert total == sum(range(21))


@pytest.mark.mpi(min_size=2)
def test_multi_worker_strategy_end_to_end(comm):
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    n = 8 * comm.size * 3 + 5
    dist = strategy.experimental_distribute_dataset(ms.data.Dataset.range(n).batch(8 * comm.size))
    total = 0
    steps = 0
    for x in dist:
        per_replica = strategy.run(lambda v: np.sum(v), args=(x,))
        total += int(strategy.reduce(ms.ReduceOp.SUM, per_replica, axis=None))
        steps += 1
    assert total == n * (n - 1) // 2  # DATA fallback: every example once across all ranks
    assert steps == 4


def test_mirrored_strategy_datasets_from_function_per_worker_and_per_replica():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        start = 100 * ctx.input_pipeline_id
        return ms.data.Dataset.range(start, start + 5).batch(ctx.get_per_replica_batch_size(4))

    def local(dist):
        return [[v.tolist() for v in strategy.experimental_local_results(x)] for x in dist]

    # the lists TensorFlow 2.21's MirroredStrategy over two logical CPUs gives for the same dataset_fn
    assert local(strategy.distribute_datasets_from_function(dataset_fn)) == [[[0, 1], [2, 3]], [[4], []]]
    assert contexts == [(1, 0, 2)]
    per_replica = ms.InputOptions(experimental_replication_mode=ms.InputReplicationMode.PER_REPLICA)
    assert local(strategy.distribute_datasets_from_function(dataset_fn, per_replica)) == [
        [[0, 1], [100, 101]], [[2, 3], [102, 103]], [[4], [104]]]
    assert contexts[1:] == [(2, 0, 2), (2, 1, 2)]
    with pytest.raises(ValueError, match="The `global_batch_size` 3 is not divisible by `num_replicas_in_sync` 2"):
        strategy.distribute_datasets_from_function(
            lambda ctx: ms.data.Dataset.range(3).batch(ctx.get_per_replica_batch_size(3)))


@pytest.mark.mpi(min_size=2)
def test_multi_worker_strategy_file_sharding_of_npy_shards(comm, mpi_tmp_path):
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    files = [str(mpi_tmp_path / f"part-{k}.npy") for k in range(2 * comm.size)]
    if comm.rank == 0:
        for k, f in enumerate(files):
            np.save(f, np.arange(10 * k, 10 * k + 10, dtype=np.float32)[:, None])
    comm.Barrier()
    dist = strategy.experimental_distribute_dataset(ms.data.NpyDataset(files).batch(4 * comm.size))
    assert dist.auto_shard_mode == "FILE"  # AUTO found enough files
    mine = []
    for x in dist:
        per_replica = strategy.experimental_local_results(x)
        assert len(per_replica) == 2 and all(v.shape[1:] == (1,) for v in per_replica)
        mine.extend(int(r) for v in per_replica for r in v[:, 0])
    assert sorted(mine) == [r for k in range(comm.rank, len(files), comm.size) for r in range(10 * k, 10 * k + 10)]
    assert sorted(r for rows in comm.allgather(mine) for r in rows) == list(range(20 * comm.size))
