"""Data-parallel training of an MLP on scikit-learn's digits, the tf.distribute way, on MPI.

Run it as ``python examples/train.py``, ``python -m mpistrat.examples.train``,
``mpiexec -n 4 python examples/train.py`` or ``srun --mpi=pmi2 python
examples/train.py``; ``--help`` lists the flags. One MPI rank is one worker of a
``MultiWorkerMirroredStrategy``; ``--devices /cpu:0,/cpu:1`` gives each rank
several replicas (logical CPUs, or ``/gpu:K``).

What happens:

1. The digits data (bundled with scikit-learn, no download) is written once
   into ``--data-dir`` as ``S`` train and ``S`` test ``.npy`` shards (rows of 64
   features + the label). On each node the first rank writes into a temporary
   directory and renames it into place; the other ranks wait, so several ranks
   and several jobs may share the directory.
2. Each epoch a pipeline ``list_files -> interleave(NpyDataset(f).shuffle)
   -> batch(global batch) -> map(split x/y)`` goes through
   ``strategy.experimental_distribute_dataset`` with FILE auto-sharding (rank
   ``w`` reads shards ``w, w+W, ...``) and per-device prefetch.
3. A step: every replica computes summed loss and gradients of its slice by
   hand (``mlp.py``), the gradients and the example count go through ONE fused
   ``all_reduce``, and the optimizer (SGD with momentum, or Adam) updates the
   mirrored variables in ``merge_call`` through ``extended.update``. Loss and
   accuracy accumulate in sync-on-read variables, read in cross-replica
   context at the end of the epoch; held-out accuracy is evaluated the same way.
4. The chief checkpoints every ``--checkpoint-every`` epochs (``mpistrat.checkpoint``);
   ``--resume`` continues from the newest checkpoint.

Why every layout trains the same weights: example ``i`` of the (fixed, seeded)
training order is stored as row ``i // S`` of shard ``i % S`` and all shards
have the same length. Interleaving the shards row by row (block length 1)
therefore reads the examples in order, and a worker holding shards ``w, w+W,
...`` reads exactly its share of every global batch: under TF's FILE batch
rule (a worker's batch of B rows feeds W consecutive steps) step ``t`` of any
layout uses rows ``t*B/S ... (t+1)*B/S - 1`` of every shard. Each epoch all
shards are shuffled with the same seed (``seed``, ``epoch``), i.e. by the same
row permutation, which keeps that property, and only full global batches are
used (``steps = rows // B``; the stream repeats so that a rank's last batch is
full too, the repeated rows are never consumed), so 1 rank x 4 replicas, 2 x 2, 4 x 1 and 1 x 1
see the same global batches and, since the reduced gradient is a sum divided
by the global count, end with the same weights up to floating-point summation
order. This needs ``S`` divisible by the number of ranks (checked) and the
global batch divisible by ``S`` and by the number of replicas (otherwise
training is still correct, only not layout-independent; a note says so). A
resumed run continues with the same shuffles, so it matches an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

__all__ = ["main", "parse_args", "prepare_digits", "train_dataset", "test_dataset", "DigitsData"]

NUM_FEATURES = 64
NUM_CLASSES = 10
DATA_SEED = 20261122  # fixes the train/test split and the stored order; not --seed
TEST_FRACTION = 0.2
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples", "data")


# ----------------------------------------------------------------------------- flags
def _devices(text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("--devices needs a comma-separated list, e.g. /cpu:0,/cpu:1")
    from mpistrat import devices as dev  # noqa: PLC0415

    for d in devices:
        try:
            dev.parse_device(d)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return devices


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="train.py", description="Data-parallel MLP training on scikit-learn's digits with mpistrat "
        "(MultiWorkerMirroredStrategy over MPI ranks).")
    p.add_argument("--epochs", type=_positive(int), default=10, help="epochs to train in total (default 10)")
    p.add_argument("--global-batch-size", type=_positive(int), default=64,
                   help="examples per step over all replicas (default 64)")
    p.add_argument("--learning-rate", type=_positive(float), default=None,
                   help="default 0.05 for sgd, 0.005 for adam")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="sgd (momentum 0.9) or adam")
    p.add_argument("--hidden", type=_positive(int), nargs="+", default=[64], help="hidden layer sizes (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the epoch shuffles")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="parameter dtype")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the digits shards are written once "
                   "(default examples/data; must be shared by the ranks of a node)")
    p.add_argument("--num-shards", type=_positive(int), default=None,
                   help="shard files per split (default: the smallest multiple of the rank count >= 8)")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (default: no checkpoints)")
    p.add_argument("--checkpoint-every", type=_positive(int), default=1,
                   help="save every N epochs (and after the last one; default 1)")
    p.add_argument("--keep-checkpoints", type=_positive(int), default=3, help="keep the newest K (default 3)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--devices", type=_devices, default=None,
                   help="this rank's replica devices, comma-separated, e.g. /cpu:0,/cpu:1 or /gpu:0 "
                        "(default: the GPU bound to the rank, else /cpu:0)")
    p.add_argument("--strategy", choices=["multi_worker", "mirrored"], default="multi_worker",
                   help="multi_worker (default; MPI ranks) or mirrored (one process, no MPI)")
    p.add_argument("--prefetch", type=int, default=2, help="batches prefetched per replica (0: off; default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway without a TTY)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.prefetch < 0:
        p.error(f"--prefetch must be >= 0, got {args.prefetch}")
    if args.learning_rate is None:
        args.learning_rate = 0.05 if args.optimizer == "sgd" else 0.005
    return args


# ----------------------------------------------------------------------------- data
class DigitsData:
    """The shard files of one prepared data directory (read from its manifest)."""

    def __init__(self, directory: str):
        self.directory = directory
        path = os.path.join(directory, "manifest.json")
        try:
            with open(path) as f:
                manifest = json.load(f)
            self.num_shards = int(manifest["num_shards"])
            self.rows_per_shard = int(manifest["rows_per_shard"])
            self.num_train = int(manifest["num_train"])
            self.num_test = int(manifest["num_test"])
            self.train_files = [os.path.join(directory, n) for n in manifest["train_files"]]
            self.test_files = [os.path.join(directory, n) for n in manifest["test_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"Data directory {directory!r} has no valid manifest ({path}): {exc}; "
                               "remove the directory to have it written again") from None
        missing = [f for f in self.train_files + self.test_files if not os.path.isfile(f)]
        if missing:
            raise RuntimeError(f"Data directory {directory!r} lacks shard files {missing}; remove it to rewrite it")


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())


def _write_digits(target: str, num_shards: int) -> None:
    from sklearn.datasets import load_digits  # noqa: PLC0415

    digits = load_digits()
    rows = np.hstack([digits.data / 16.0, digits.target[:, None]]).astype(np.float32)
    order = np.random.default_rng(DATA_SEED).permutation(len(rows))
    num_test = int(round(len(rows) * TEST_FRACTION))
    test, train = rows[order[:num_test]], rows[order[num_test:]]
    per_shard = len(train) // num_shards
    if per_shard < 1:
        raise ValueError(f"{num_shards} shards are more than the {len(train)} training examples")
    train = train[:per_shard * num_shards]
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=parent)
    try:
        names = {"train_files": [], "test_files": []}
        for k in range(num_shards):
            name = f"train-{k:05d}-of-{num_shards:05d}.npy"
            _save_npy(os.path.join(tmp, name), np.ascontiguousarray(train[k::num_shards]))  # example i -> shard i % S
            names["train_files"].append(name)
        for k, part in enumerate(np.array_split(test, num_shards)):
            name = f"test-{k:05d}-of-{num_shards:05d}.npy"
            _save_npy(os.path.join(tmp, name), part)
            names["test_files"].append(name)
        manifest = {"dataset": "sklearn.datasets.load_digits", "data_seed": DATA_SEED, "num_shards": num_shards,
                    "rows_per_shard": per_shard, "num_train": len(train), "num_test": len(test),
                    "num_features": NUM_FEATURES, "num_classes": NUM_CLASSES, "columns": "64 pixels / 16, label", **names}
        _save_npy_json(os.path.join(tmp, "manifest.json"), manifest)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isdir(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another writer finished first; keep theirs
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _save_npy_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def prepare_digits(data_dir: str, num_shards: int, comm: Any = None) -> DigitsData:
    """Write the digits shards into ``data_dir`` unless present; collective over ``comm`` (mpi4py) if given.

    The first rank of each node writes (atomically: a temporary directory
    renamed into place); the others wait. An error on any rank is raised on
    every rank.
    """
    target = os.path.join(os.path.abspath(data_dir), f"digits-{num_shards}shards")
    node = None
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI  # noqa: PLC0415

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    error = None
    if node is None or node.Get_rank() == 0:
        try:
            if not os.path.isfile(os.path.join(target, "manifest.json")):
                _write_digits(target, num_shards)
            DigitsData(target)
        except Exception as exc:  # raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    if node is not None:
        error = node.bcast(error, root=0)
        node.Free()
        errors = comm.allgather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            error = "; ".join(f"rank {r}: {e}" for r, e in failed)
    if error:
        raise RuntimeError(f"Preparing the digits data in {target!r} failed: {error}")
    return DigitsData(target)


def _split_xy(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return batch[:, :NUM_FEATURES], batch[:, NUM_FEATURES].astype(np.int32)


def _file_sharded(ds: Any) -> Any:
    from mpistrat.data import AutoShardPolicy, Options  # noqa: PLC0415

    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    return ds.with_options(options)


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch`` (the same on every rank and in a resumed run)."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch]).generate_state(1)[0])


def train_dataset(data: DigitsData, global_batch_size: int, seed: int, epoch: int) -> Any:
    """The epoch's training pipeline (see the module docstring for why every layout sees the same batches)."""
    from mpistrat.data import Dataset, NpyDataset  # noqa: PLC0415

    shuffle_seed = epoch_seed(seed, epoch)
    rows = data.rows_per_shard
    ds = Dataset.list_files(data.train_files, shuffle=False)
    ds = ds.interleave(lambda f: NpyDataset(f).shuffle(rows, seed=shuffle_seed, reshuffle_each_iteration=False),
                       cycle_length=data.num_shards, block_length=1)
    # repeat() keeps every local batch full: a rank's last batch of the epoch feeds W steps (FILE rule), and
    # only full batches are cut into equal pieces; the repeated rows are never used (steps = rows // B).
    return _file_sharded(ds.repeat().batch(global_batch_size).map(_split_xy))


def test_dataset(data: DigitsData, global_batch_size: int) -> Any:
    """The held-out pipeline: every test shard once, FILE-sharded."""
    from mpistrat.data import Dataset, NpyDataset  # noqa: PLC0415

    ds = Dataset.list_files(data.test_files, shuffle=False).interleave(
        lambda f: NpyDataset(f), cycle_length=1, block_length=1)
    return _file_sharded(ds.batch(global_batch_size).map(_split_xy))


# ----------------------------------------------------------------------------- training
def _make_strategy(args: argparse.Namespace) -> Any:
    import mpistrat as ms  # noqa: PLC0415

    if args.strategy == "mirrored":
        return ms.MirroredStrategy(args.devices)
    return ms.MultiWorkerMirroredStrategy(local_devices=args.devices)


def _world_comm(strategy: Any) -> Any:
    resolver = strategy.cluster_resolver
    if resolver is None:
        return None
    from mpi4py import MPI  # noqa: PLC0415

    return getattr(resolver, "comm", None) or MPI.COMM_WORLD


class _Metrics:
    """Sum-aggregated sync-on-read variables: each replica adds to its own copy."""

    def __init__(self, names: Sequence[str]):
        import mpistrat as ms  # noqa: PLC0415

        self.vars = {n: ms.Variable(np.float64(0.0), name=f"metrics/{n}", trainable=False,
                                    synchronization=ms.VariableSynchronization.ON_READ,
                                    aggregation=ms.VariableAggregation.SUM) for n in names}

    def add(self, **values: Any) -> None:
        """In replica context: add this replica's values."""
        for name, value in values.items():
            self.vars[name].assign_add(value)

    def result(self) -> dict:
        """In cross-replica context: the sums over all replicas of all ranks (collective)."""
        return {n: float(np.asarray(v.numpy())) for n, v in self.vars.items()}

    def reset(self) -> None:
        for v in self.vars.values():
            v.assign(0.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Train; rank 0 prints one line per epoch. Returns the exit code."""
    args = parse_args(argv)
    import mpistrat as ms  # noqa: PLC0415
    from mpistrat import devices as dev  # noqa: PLC0415
    from mpistrat.checkpoint import Checkpoint, CheckpointManager  # noqa: PLC0415
    from mpistrat.examples.mlp import MLP  # noqa: PLC0415
    from mpistrat.optimizers import get as get_optimizer  # noqa: PLC0415

    t_start = time.perf_counter()
    strategy = _make_strategy(args)
    ext = strategy.extended
    num_workers = ext._num_workers
    is_chief = ext.should_checkpoint
    replicas = strategy.num_replicas_in_sync
    log = (lambda *a: print(*a, flush=True)) if is_chief else (lambda *a: None)

    num_shards = args.num_shards or num_workers * math.ceil(8 / num_workers)
    if num_shards % num_workers:
        raise ValueError(f"--num-shards {num_shards} is not a multiple of the {num_workers} ranks: FILE sharding "
                         "gives every rank the same number of shards; pick a multiple of the rank count")
    data = prepare_digits(args.data_dir, num_shards, _world_comm(strategy))
    batch = args.global_batch_size
    steps_per_epoch = data.num_train // batch
    if steps_per_epoch < 1:
        raise ValueError(f"--global-batch-size {batch} is larger than the {data.num_train} training examples")
    log(f"mpistrat train: {num_workers} workers x {len(ext.worker_devices)} replicas = {replicas} replicas "
        f"({', '.join(dev.parse_device(d).device_type + ':' + str(dev.parse_device(d).device_index) for d in ext.worker_devices)} per worker); "
        f"{data.num_train} train / {data.num_test} test examples in {num_shards}+{num_shards} shards; "
        f"global batch {batch}, {steps_per_epoch} steps/epoch; {args.optimizer} lr {args.learning_rate}")
    if batch % num_shards or batch % replicas:
        log(f"note: global batch {batch} is not a multiple of {num_shards} shards and {replicas} replicas: "
            "training is correct but the weights depend on the rank/replica layout")

    with strategy.scope():
        model = MLP([NUM_FEATURES, *args.hidden, NUM_CLASSES], seed=args.seed, dtype=args.dtype)
        optimizer = get_optimizer(args.optimizer, args.learning_rate)
        optimizer.build(model.trainable_variables)
        epoch_var = ms.Variable(np.int64(0), name="epoch", trainable=False)
        train_metrics = _Metrics(["loss", "correct", "count"])
        test_metrics = _Metrics(["correct", "count"])

    checkpoint = manager = None
    if args.checkpoint_dir:
        checkpoint = Checkpoint(model=model, optimizer=optimizer, epoch=epoch_var)
        manager = CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=args.keep_checkpoints)
        if args.resume:
            path = manager.restore_or_initialize()
            log(f"resumed from {path} (epoch {int(epoch_var.numpy())})" if path else
                f"no checkpoint in {args.checkpoint_dir}: starting from scratch")

    input_options = ms.InputOptions(experimental_fetch_to_device=True,
                                    experimental_per_replica_buffer_size=args.prefetch)
    dist_test = strategy.experimental_distribute_dataset(test_dataset(data, batch), input_options)
    variables = model.trainable_variables

    def train_step(inputs: Any) -> None:
        x, y = inputs
        loss, correct, grads = model.loss_and_gradients(x, y)
        xp = dev.array_module(dev.device_of(loss))
        count = xp.asarray([x.shape[0]], dtype=model.dtype)
        # One fused all-reduce per step: every gradient and the global example count.
        total = ms.get_replica_context().all_reduce(ms.ReduceOp.SUM, {"grads": grads, "count": count})
        scale = 1.0 / total["count"][0]
        optimizer.apply_gradients([(g * scale, v) for g, v in zip(total["grads"], variables)],
                                  experimental_aggregate_gradients=False)
        train_metrics.add(loss=loss, correct=correct, count=x.shape[0])

    def test_step(inputs: Any) -> None:
        x, y = inputs
        predictions = model.predict(x)
        test_metrics.add(correct=(predictions == y.astype(predictions.dtype)).sum(), count=x.shape[0])

    def evaluate() -> float:
        with strategy.scope():
            test_metrics.reset()
        for inputs in dist_test:
            strategy.run(test_step, args=(inputs,))
        with strategy.scope():
            test = test_metrics.result()
        return test["correct"] / max(test["count"], 1.0)

    show_bar = is_chief and not args.no_progress and sys.stderr.isatty()
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:  # the bar is optional
        tqdm = None
    first_epoch = int(epoch_var.numpy())
    if first_epoch >= args.epochs:
        log(f"already trained {first_epoch} epochs (--epochs {args.epochs}): evaluating only")
        test_acc = evaluate()
    for epoch in range(first_epoch, args.epochs):
        with strategy.scope():
            train_metrics.reset()
        dist_train = strategy.experimental_distribute_dataset(
            train_dataset(data, batch, args.seed, epoch), input_options)
        bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stderr,
                   leave=False, disable=not show_bar) if tqdm is not None else None
        t0 = time.perf_counter()
        iterator = iter(dist_train)
        try:
            for _ in range(steps_per_epoch):  # full global batches only (see the module docstring)
                strategy.run(train_step, args=(next(iterator),))
                if bar is not None:
                    bar.update(1)
        finally:
            iterator.close()
            if bar is not None:
                bar.close()
        train_seconds = time.perf_counter() - t0
        test_acc = evaluate()
        with strategy.scope():
            epoch_var.assign(epoch + 1)
            train = train_metrics.result()
        log(f"epoch {epoch + 1}/{args.epochs}  loss {train['loss'] / train['count']:.4f}  "
            f"accuracy {train['correct'] / train['count']:.4f}  test accuracy {test_acc:.4f}  "
            f"{train['count'] / train_seconds:.0f} examples/s")
        if manager is not None and ((epoch + 1) % args.checkpoint_every == 0 or epoch + 1 == args.epochs):
            path = manager.save(checkpoint_number=epoch + 1, metadata={"epoch": epoch + 1, "seed": args.seed})
            log(f"saved checkpoint {path}")
    log(f"final test accuracy {test_acc:.4f} after {args.epochs} epochs on {num_workers} workers x "
        f"{len(ext.worker_devices)} replicas ({time.perf_counter() - t_start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
