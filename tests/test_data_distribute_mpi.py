"""Distributed datasets across MPI ranks (run under mpiexec -n 2 and -n 4).

Every rank checks its own per-replica values against a reference computed here
from the rules in DESIGN.md / mpistrat.data.splitting, and the ranks check
together (allgather) that the data is covered exactly once and that every rank
stopped at the same step.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

import mpistrat.data as D
from mpistrat.data import InputPipelineError, Options
from mpistrat.data.distribute import DistributedDataset, DistributedDatasetsFromFunction
from mpistrat.data.experimental import AutoShardPolicy
from mpistrat.distribute.input_options import InputOptions, InputWorkerInfo
from mpistrat.distribute.values import PerReplica

TF_DIR = Path(__file__).resolve().parent / "data" / "tfrecord"  # written by TensorFlow 2.21 (its README.md)


class _Adapter:
    """Stand-in with RankCommunicator's input-pipeline methods, used only if the real one is missing."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()

    def step_agreement(self, code, options=None):
        return np.array(self.comm.allgather(int(code)), dtype=np.int64)

    def allgather_object(self, obj, options=None):
        return self.comm.allgather(obj)

    def broadcast_object(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def close(self):
        pass


@pytest.fixture
def rank_comm(comm):
    try:
        from mpistrat.comm.communicator import RankCommunicator
    except ImportError:
        c = _Adapter(comm)
    else:
        c = RankCommunicator(comm)
    yield c
    c.close()


def worker_info(rc, num_local):
    devices = tuple(f"/cpu:{i}" for i in range(num_local))
    return InputWorkerInfo(rc.size, rc.rank, devices, rc.size * num_local, rc.rank * num_local, rc)


def with_policy(ds, policy):
    opts = Options()
    opts.experimental_distribute.auto_shard_policy = policy
    return ds.with_options(opts)


def per_replica(step):
    return list(step.values) if isinstance(step, PerReplica) else [step]


def gather_all(comm, arrays):
    local = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, np.int64)
    return comm.allgather(local)


OPTIONS = [InputOptions(experimental_per_replica_buffer_size=0), InputOptions()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_local", [1, 2])
@pytest.mark.parametrize("options", OPTIONS)
def test_data_policy_splits_each_global_batch(comm, rank_comm, num_local, options):
    W, R = comm.size, num_local
    N, B, n = W * R, 7, 7 * 3 + 5
    ds = with_policy(D.Dataset.range(n).batch(B), AutoShardPolicy.DATA)
    dist = DistributedDataset(ds, worker_info(rank_comm, R), options)
    assert dist.auto_shard_mode == "DATA"
    steps = [per_replica(s) for s in dist]
    batches = [np.arange(n)[i:i + B] for i in range(0, n, B)]
    assert len(steps) == len(batches)
    for t, batch in enumerate(batches):
        parts = np.array_split(batch, N)
        for r in range(R):
            assert steps[t][r].tolist() == parts[comm.rank * R + r].tolist()
            assert steps[t][r].dtype == np.int64
    everything = np.concatenate(gather_all(comm, [v for s in steps for v in s])).ravel()
    assert sorted(everything.tolist()) == list(range(n))


@pytest.mark.mpi(min_size=2)
def test_auto_falls_back_to_data_with_one_warning_on_rank_0(comm, rank_comm, caplog):
    ds = D.Dataset.from_tensor_slices(np.arange(12.0)).batch(4)
    with caplog.at_level(logging.WARNING, logger="mpistrat.data"):
        dist = DistributedDataset(ds, worker_info(rank_comm, 1), None)
        for _ in range(2):  # two epochs: no more warnings
            assert len(list(dist)) == 3
    warnings = [r for r in caplog.records if "AUTO sharding policy will apply DATA" in r.getMessage()]
    assert dist.auto_shard_mode == "DATA"
    assert len(warnings) == (1 if comm.rank == 0 else 0)


def write_npy_shards(comm, root, lengths, feat=3):
    files = [str(root / f"shard-{k:02d}.npy") for k in range(len(lengths))]
    if comm.rank == 0:
        start = 0
        for f, n in zip(files, lengths):
            np.save(f, (np.arange(start, start + n, dtype=np.float32)[:, None] * np.ones(feat, np.float32)))
            start += n
    comm.Barrier()
    return files


def reference_local_steps(stream, B, W, R, w):
    """TF's rule: each local batch cut by the rotated array_split sizes, R pieces per step."""
    steps = []
    batches = [stream[i:i + B] for i in range(0, len(stream), B)]
    for k, batch in enumerate(batches):
        base = [len(p) for p in np.array_split(np.arange(len(batch)), W * R)]
        sizes = base[w * R:] + base[:w * R]
        cuts = np.split(batch, np.cumsum(sizes)[:-1])
        mine = [cuts[s * R:(s + 1) * R] for s in range(W)]
        if k == len(batches) - 1:
            while mine and all(len(p) == 0 for p in mine[-1]):
                mine.pop()
        steps.extend(mine)
    return steps


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_local", [1, 2])
@pytest.mark.parametrize("options", OPTIONS)
def test_file_policy_npy_shards_uneven(comm, rank_comm, mpi_tmp_path, num_local, options):
    W, R, B = comm.size, num_local, 6
    lengths = [13 + 5 * k for k in range(2 * W)]  # worker w reads files w and w + W: uneven
    files = write_npy_shards(comm, mpi_tmp_path, lengths)
    ds = with_policy(D.NpyDataset(files).batch(B), AutoShardPolicy.FILE)
    dist = DistributedDataset(ds, worker_info(rank_comm, R), options)
    assert dist.auto_shard_mode == "FILE"
    steps = [per_replica(s) for s in dist]
    mine = np.concatenate([np.load(f) for f in files[comm.rank::W]])
    expected = reference_local_steps(mine, B, W, R, comm.rank)
    counts = comm.allgather(len(steps))
    assert len(set(counts)) == 1  # every rank stopped at the same step
    longest = max(comm.allgather(len(expected)))
    assert counts[0] == longest
    for t, step in enumerate(steps):
        for r, value in enumerate(step):
            want = expected[t][r] if t < len(expected) else np.zeros((0, 3), np.float32)
            assert value.dtype == np.float32 and value.shape[1:] == (3,)
            assert np.array_equal(value, want), (t, r)
    rows = np.concatenate(comm.allgather(np.concatenate([v for s in steps for v in s])))
    assert sorted(rows[:, 0].tolist()) == list(range(sum(lengths)))  # each row exactly once


@pytest.mark.mpi(min_size=2)
def test_file_policy_global_batch_per_step_is_the_global_batch_size(comm, rank_comm, mpi_tmp_path):
    W, R, B = comm.size, 2, 10
    files = write_npy_shards(comm, mpi_tmp_path, [40] * W)  # whole batches everywhere
    dist = DistributedDataset(D.NpyDataset(files).batch(B), worker_info(rank_comm, R), None)
    assert dist.auto_shard_mode == "FILE"  # AUTO found the files
    for step in dist:
        local_rows = sum(len(v) for v in per_replica(step))
        assert sum(comm.allgather(local_rows)) == B


@pytest.mark.mpi(min_size=2)
def test_file_policy_tensorflow_shards(comm, rank_comm):
    manifest = json.loads((TF_DIR / "MANIFEST.json").read_text())["files"]
    names = [f"raw-0000{k}-of-00004.tfrecord" for k in range(4)]
    files = [str(TF_DIR / n) for n in names]
    if comm.size > len(files):
        pytest.skip("more ranks than TensorFlow shards")
    ds = with_policy(D.TFRecordDataset(files).batch(2), AutoShardPolicy.FILE)
    steps = [per_replica(s) for s in DistributedDataset(ds, worker_info(rank_comm, 1), None)]
    got = [r.decode() for s in steps for v in s for r in v.tolist()]
    want = [r for n in names[comm.rank::comm.size] for r in manifest[n]["records_utf8"]]
    assert got == want
    assert len(set(comm.allgather(len(steps)))) == 1


@pytest.mark.mpi(min_size=2)
def test_file_policy_list_files_interleave(comm, rank_comm):
    ds = D.Dataset.list_files(str(TF_DIR / "raw-0000*-of-00004.tfrecord"), seed=5).interleave(D.TFRecordDataset, cycle_length=2)
    ds = with_policy(ds.batch(3), AutoShardPolicy.FILE)
    steps = [per_replica(s) for s in DistributedDataset(ds, worker_info(rank_comm, 1), None)] if comm.size <= 4 else []
    if comm.size > 4:
        pytest.skip("more ranks than files")
    records = [r for s in steps for v in s for r in v.tolist()]
    everything = sorted(r for rs in comm.allgather(records) for r in rs)
    manifest = json.loads((TF_DIR / "MANIFEST.json").read_text())["files"]
    assert everything == sorted(r.encode() for k in range(4) for r in manifest[f"raw-0000{k}-of-00004.tfrecord"]["records_utf8"])


@pytest.mark.mpi(min_size=2)
def test_file_policy_fewer_files_than_workers_fails_everywhere(comm, rank_comm):
    ds = with_policy(D.TFRecordDataset(str(TF_DIR / "raw-gzip.tfrecord"), "GZIP").batch(2), AutoShardPolicy.FILE)
    with pytest.raises(ValueError, match=f"there are 1 input files but {comm.size} workers"):
        DistributedDataset(ds, worker_info(rank_comm, 1), None)
    # AUTO falls back to DATA instead
    auto = DistributedDataset(D.TFRecordDataset(str(TF_DIR / "raw-gzip.tfrecord"), "GZIP").batch(4), worker_info(rank_comm, 1), None)
    assert auto.auto_shard_mode == "DATA"
    got = [r for s in auto for r in per_replica(s)[0].tolist()]
    everything = sorted(r for rs in comm.allgather(got) for r in rs)
    assert everything == [f"GZIP-{i}".encode() for i in range(7)]


@pytest.mark.mpi(min_size=2)
def test_file_policy_with_fewer_npy_shards_than_workers_names_both_counts(comm, rank_comm, mpi_tmp_path):
    files = write_npy_shards(comm, mpi_tmp_path, [6] * (comm.size - 1))
    ds = with_policy(D.NpyDataset(files).batch(2), AutoShardPolicy.FILE)
    with pytest.raises(ValueError, match=rf"there are {comm.size - 1} input files but {comm.size} workers"):
        DistributedDataset(ds, worker_info(rank_comm, 1), None)


@pytest.mark.mpi(min_size=2)
def test_off_policy_every_worker_sees_everything(comm, rank_comm):
    ds = with_policy(D.Dataset.range(20).batch(4), AutoShardPolicy.OFF)
    dist = DistributedDataset(ds, worker_info(rank_comm, 1), None)
    assert dist.auto_shard_mode == "OFF"
    seen = sorted(int(x) for s in dist for v in per_replica(s) for x in v)
    assert seen == list(range(20))


@pytest.mark.mpi(min_size=2)
def test_rank_without_any_data_gets_empty_batches_of_the_right_spec(comm, rank_comm, mpi_tmp_path):
    lengths = [9] + [0] * (comm.size - 1)
    files = write_npy_shards(comm, mpi_tmp_path, lengths, feat=2)
    dist = DistributedDataset(D.NpyDataset(files).batch(2), worker_info(rank_comm, 2), None)
    steps = [per_replica(s) for s in dist]
    assert len(set(comm.allgather(len(steps)))) == 1 and len(steps) >= 1
    if comm.rank != 0:
        for s in steps:
            for v in s:
                assert v.shape == (0, 2) and v.dtype == np.float32


@pytest.mark.mpi(min_size=2)
def test_unseeded_shuffle_under_data_policy_is_consistent_across_ranks(comm, rank_comm):
    ds = with_policy(D.Dataset.range(40).shuffle(40).batch(8), AutoShardPolicy.DATA)
    dist = DistributedDataset(ds, worker_info(rank_comm, 1), None)
    for _ in range(2):
        mine = [int(x) for s in dist for x in per_replica(s)[0]]
        everything = sorted(x for xs in comm.allgather(mine) for x in xs)
        assert everything == list(range(40))


def write_tfrecords(comm, root, n_files, n_records):
    files = [str(root / f"rec-{k}.tfrecord") for k in range(n_files)]
    if comm.rank == 0:
        for k, f in enumerate(files):
            with D.TFRecordWriter(f) as w:
                for i in range(n_records):
                    w.write(f"{k}:{i:04d}".encode())
    comm.Barrier()
    return files


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("options", OPTIONS)
def test_corrupt_file_on_one_rank_fails_every_rank(comm, rank_comm, mpi_tmp_path, options):
    files = write_tfrecords(comm, mpi_tmp_path, comm.size, 20)
    if comm.rank == 0:
        data = bytearray(Path(files[1]).read_bytes())
        data[10 * 22 + 15] ^= 0x40  # record 10 of rank 1's file (records are 12 + 6 + 4 bytes)
        Path(files[1]).write_bytes(bytes(data))
    comm.Barrier()
    ds = with_policy(D.TFRecordDataset(files).batch(4), AutoShardPolicy.FILE)
    it = iter(DistributedDataset(ds, worker_info(rank_comm, 1), options))
    got = 0
    with pytest.raises(InputPipelineError, match=r"failed on rank\(s\) \[1\].*rank 1: corrupted record at byte offset 220 in TFRecord file .*rec-1\.tfrecord"):
        for _ in it:
            got += 1
    # records 0-7 (two local batches, each feeding W steps under FILE) arrived everywhere;
    # the step that needed record 10 failed on every rank
    assert got == 2 * comm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("damage", ["truncated-record", "not-npy"])
def test_unreadable_file_on_the_last_rank_fails_every_rank(comm, rank_comm, mpi_tmp_path, damage):
    last = comm.size - 1
    if damage == "truncated-record":
        files = write_tfrecords(comm, mpi_tmp_path, comm.size, 20)
        ds = D.TFRecordDataset(files).batch(4)
        expected = rf"rank {last}: truncated record at byte offset 220 in TFRecord file .*rec-{last}\.tfrecord"
        cut = 10 * 22 + 15  # record 10's header and 3 of its 10 remaining bytes (records are 12 + 6 + 4 bytes)
    else:
        files = write_npy_shards(comm, mpi_tmp_path, [20] * comm.size, feat=2)
        ds = D.NpyDataset(files).batch(4)
        expected = rf"rank {last}: .*shard-0{last}\.npy' is not a \.npy file \(bad magic at byte offset 0\)"
    if comm.rank == 0:
        data = Path(files[last]).read_bytes()
        Path(files[last]).write_bytes(data[:cut] if damage == "truncated-record" else b"garbage, not an array" * 8)
    comm.Barrier()
    dist = DistributedDataset(with_policy(ds, AutoShardPolicy.FILE), worker_info(rank_comm, 1), None)
    with pytest.raises(InputPipelineError, match=rf"failed on rank\(s\) \[{last}\].*{expected}"):
        list(dist)


@pytest.mark.mpi(min_size=2)
def test_missing_file_on_one_rank_fails_every_rank(comm, rank_comm, mpi_tmp_path):
    files = write_tfrecords(comm, mpi_tmp_path, comm.size, 4)
    ds = with_policy(D.TFRecordDataset(files).batch(2), AutoShardPolicy.FILE)
    dist = DistributedDataset(ds, worker_info(rank_comm, 1), None)
    comm.Barrier()
    if comm.rank == 0:
        os.remove(files[comm.size - 1])
    comm.Barrier()
    last = comm.size - 1
    with pytest.raises(InputPipelineError, match=rf"failed on rank\(s\) \[{last}\].*rank {last}: TFRecord file .*rec-{last}\.tfrecord.* not found \(byte offset 0\)"):
        list(dist)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_local", [1, 2])
def test_datasets_from_function_uneven_shards_end_together(comm, rank_comm, num_local):
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        per_replica_batch = ctx.get_per_replica_batch_size(4 * comm.size * num_local)
        n = 10 + 7 * ctx.input_pipeline_id  # uneven
        return D.Dataset.range(1000 * ctx.input_pipeline_id, 1000 * ctx.input_pipeline_id + n).batch(per_replica_batch)

    dist = DistributedDatasetsFromFunction(dataset_fn, worker_info(rank_comm, num_local), None)
    assert contexts == [(comm.size, comm.rank, comm.size * num_local)]
    steps = [per_replica(s) for s in dist]
    assert len(set(comm.allgather(len(steps)))) == 1
    got = sorted(int(x) for s in steps for v in s for x in v)
    assert got == list(range(1000 * comm.rank, 1000 * comm.rank + 10 + 7 * comm.rank))
    assert all(v.dtype == np.int64 for s in steps for v in s)


@pytest.mark.mpi(min_size=2)
def test_dataset_fn_failing_on_one_rank_fails_every_rank(comm, rank_comm):
    def dataset_fn(ctx):
        if ctx.input_pipeline_id == 1:
            raise OSError("cannot reach the data on this node")
        return D.Dataset.range(4).batch(2)

    if comm.rank == 1:
        with pytest.raises(OSError, match="cannot reach the data"):
            DistributedDatasetsFromFunction(dataset_fn, worker_info(rank_comm, 1), None)
    else:
        with pytest.raises(InputPipelineError, match=r"rank\(s\) \[1\].*cannot reach the data"):
            DistributedDatasetsFromFunction(dataset_fn, worker_info(rank_comm, 1), None)


class _Counting:
    """Counts step agreements, forwarding everything to the real communicator."""

    def __init__(self, inner):
        self._inner, self.agreements = inner, 0

    def step_agreement(self, code, options=None):
        self.agreements += 1
        return self._inner.step_agreement(code, options)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.mpi(min_size=2)
def test_agreement_is_amortised_over_steps_held_in_memory(comm, rank_comm, mpi_tmp_path):
    counting = _Counting(rank_comm)
    info = InputWorkerInfo(comm.size, comm.rank, ("/cpu:0",), comm.size, comm.rank, counting)
    # uneven FILE shards: rank r has 30 + 10 r rows -> 30 + 10 r steps of one row (global batch = W)
    files = write_npy_shards(comm, mpi_tmp_path, [30 + 10 * r for r in range(comm.size)], feat=1)
    dist = DistributedDataset(D.NpyDataset(files).batch(comm.size), info,
                              InputOptions(experimental_per_replica_buffer_size=0))
    built = counting.agreements
    steps = [per_replica(s) for s in dist]
    longest = 30 + 10 * (comm.size - 1)
    assert len(steps) == longest
    assert sum(len(v) for s in steps for v in s) == 30 + 10 * comm.rank
    # one agreement per distinct shard length (each commits up to the next rank's end) and one for the end,
    # instead of one per step
    assert counting.agreements - built == comm.size + 1


@pytest.mark.mpi(min_size=2)
def test_truncated_npy_on_one_rank_fails_every_rank(comm, rank_comm, mpi_tmp_path):
    files = write_npy_shards(comm, mpi_tmp_path, [20] * comm.size, feat=4)
    last = comm.size - 1
    if comm.rank == 0:
        data = Path(files[last]).read_bytes()
        Path(files[last]).write_bytes(data[:-8])
    comm.Barrier()
    ds = with_policy(D.NpyDataset(files).batch(4), AutoShardPolicy.FILE)
    with pytest.raises(InputPipelineError, match=rf"rank\(s\) \[{last}\].*rank {last}: truncated \.npy file .*shard-0{last}\.npy.*byte offset 128"):
        list(DistributedDataset(ds, worker_info(rank_comm, 1), None))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_stuck_rank_makes_the_others_time_out_instead_of_hanging(comm):
    try:
        from mpistrat.comm.communicator import RankCommunicator
        from mpistrat.comm.options import CommunicationOptions
        from mpistrat.comm import CollectiveError
    except ImportError:
        pytest.skip("needs mpistrat.comm.communicator")
    import time

    rc = RankCommunicator(comm, CommunicationOptions(timeout_seconds=2.0))
    try:
        def slow(x):
            if comm.rank == 1 and int(x[0]) == 4:
                time.sleep(6)  # a stuck file system on rank 1
            return x

        ds = with_policy(D.Dataset.range(16).batch(2).map(slow), AutoShardPolicy.DATA)
        dist = DistributedDataset(ds, worker_info(rc, 1), InputOptions(experimental_per_replica_buffer_size=0))
        t0 = time.monotonic()
        with pytest.raises((CollectiveError, InputPipelineError)):
            list(dist)
        if comm.rank != 1:
            assert time.monotonic() - t0 < 5.5  # the waiting ranks gave up on their own, by the timeout
    finally:
        try:
            rc.close()
        except Exception:
            pass


@pytest.mark.mpi(min_size=2)
def test_agreement_thins_out_with_the_prefetch_thread(comm, rank_comm):
    counting = _Counting(rank_comm)
    info = InputWorkerInfo(comm.size, comm.rank, ("/cpu:0",), comm.size, comm.rank, counting)
    n_steps = 300
    ds = with_policy(D.Dataset.range(n_steps * comm.size).batch(comm.size), AutoShardPolicy.DATA)
    dist = DistributedDataset(ds, info, InputOptions(experimental_per_replica_buffer_size=16))
    built = counting.agreements
    assert sum(1 for _ in dist) == n_steps
    assert counting.agreements - built < n_steps // 4  # at most one per step, typically one per 16


@pytest.mark.mpi(min_size=2)
def test_agreement_thins_out_with_the_default_buffer_on_cpu(comm, rank_comm):
    """The default buffer (1) on CPU devices: the prefetch queue deepens, so far fewer agreements than steps,
    and every step still arrives in order on every rank."""
    counting = _Counting(rank_comm)
    info = InputWorkerInfo(comm.size, comm.rank, ("/cpu:0",), comm.size, comm.rank, counting)
    n_steps = 300
    ds = with_policy(D.Dataset.range(n_steps * comm.size).batch(comm.size), AutoShardPolicy.DATA)
    dist = DistributedDataset(ds, info, InputOptions())
    assert InputOptions().experimental_per_replica_buffer_size == 1
    built = counting.agreements
    got = [int(np.asarray(x)[0]) for x in dist]
    assert got == [s * comm.size + comm.rank for s in range(n_steps)]
    assert counting.agreements - built < n_steps // 8  # depth 1, 2, 4, ... 64: about a dozen agreements


@pytest.mark.mpi(min_size=2)
def test_deepened_prefetch_queue_is_bounded_in_bytes(comm, rank_comm):
    """Steps of 4-12 MiB after a tiny first one: the queue may deepen, but the bytes the thread holds
    never exceed AGREEMENT_BYTES (beyond the one step it may always hold), whatever the first step weighed."""
    from mpistrat.data.distribute import AGREEMENT_BYTES

    info = InputWorkerInfo(comm.size, comm.rank, ("/cpu:0",), comm.size, comm.rank, rank_comm)
    sizes = [1] + [(4 << 20) // 8 * (1 + k % 3) for k in range(23)]  # float64 rows: 8 B, then 4, 8, 12 MiB

    def rows(i):
        return np.full(sizes[int(i) // comm.size], i, np.float64)

    # global batch = one row per rank; every row of a step has the same size
    ds = with_policy(D.Dataset.range(24 * comm.size).map(rows).batch(comm.size), AutoShardPolicy.DATA)
    it = iter(DistributedDataset(ds, info, InputOptions()))
    budget = it._producer._budget
    assert budget is not None and budget.max_bytes == AGREEMENT_BYTES
    held = []
    for step, x in enumerate(it):
        assert np.asarray(x).shape == (1, sizes[step]) and float(np.asarray(x)[0, 0]) == step * comm.size + comm.rank
        held.append(budget.used)
    assert step == 23
    assert max(held) <= AGREEMENT_BYTES


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_slow_reader_makes_its_peers_wait_about_one_step_not_many(comm):
    """Rank 0 reads 0.1 s per step, the collective timeout is 1.5 s: an agreement waits for the steps a
    rank holds (plus a short patience), not for many, so the others never time out."""
    import time

    from mpistrat.comm.communicator import RankCommunicator
    from mpistrat.comm.options import CommunicationOptions

    rc = RankCommunicator(comm, CommunicationOptions(timeout_seconds=1.5))
    try:
        def slow(x):
            if comm.rank == 0:
                time.sleep(0.1)
            return x

        n_steps = 30
        ds = with_policy(D.Dataset.range(n_steps * comm.size).map(slow).batch(comm.size), AutoShardPolicy.DATA)
        got = [int(np.asarray(x)[0]) for x in DistributedDataset(ds, worker_info(rc, 1), InputOptions())]
        assert got == [s * comm.size + comm.rank for s in range(n_steps)]
    finally:
        rc.close()
