"""Data-parallel training of an MLP on the UCI handwritten digits, the tf.distribute way, on MPI.

Run it as ``python examples/train.py``, ``python -m mpistrat.examples.train``,
``mpiexec -n 4 python examples/train.py`` or ``srun --mpi=pmi2 python
examples/train.py``; ``--help`` lists the flags. One MPI rank is one worker of a
``MultiWorkerMirroredStrategy``; ``--devices /cpu:0,/cpu:1`` gives each rank
several replicas (logical CPUs, or ``/gpu:K``). :func:`main` walks through a run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

import mpistrat as ms
from mpistrat import devices as dev
from mpistrat.checkpoint import Checkpoint, CheckpointManager
from mpistrat.examples.digits import NUM_CLASSES, NUM_FEATURES, DigitsData, prepare_digits, test_dataset, train_dataset
from mpistrat.examples.mlp import MLP
from mpistrat.optimizers import get as get_optimizer
from mpistrat.train.checkpoint_file import read_manifest
from mpistrat.train.preemption import PreemptionCheckpointHandler

__all__ = ["main", "parse_args", "Trainer"]

DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples", "data")


# ----------------------------------------------------------------------------- flags
def _devices(text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("--devices needs a comma-separated list, e.g. /cpu:0,/cpu:1")
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
        prog="train.py", description="Data-parallel MLP training on the UCI handwritten digits with mpistrat "
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
    p.add_argument("--progress", action="store_true",
                   help="show rank 0's progress bar even when its stderr is not a terminal (under mpiexec/srun the "
                        "ranks write to pipes: scripts/main_job.sh passes this when it runs in a terminal)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.prefetch < 0:
        p.error(f"--prefetch must be >= 0, got {args.prefetch}")
    if args.learning_rate is None:
        args.learning_rate = 0.05 if args.optimizer == "sgd" else 0.005
    return args


# ----------------------------------------------------------------------------- training
def _make_strategy(args: argparse.Namespace) -> ms.Strategy:
    if args.strategy == "mirrored":
        return ms.MirroredStrategy(args.devices)
    return ms.MultiWorkerMirroredStrategy(local_devices=args.devices)


def _world_comm(strategy: ms.Strategy) -> Any:
    """The mpi4py communicator of a multi-worker strategy's ranks (None for one process)."""
    resolver = strategy.cluster_resolver
    if resolver is None:
        return None
    from mpi4py import MPI  # noqa: PLC0415

    return getattr(resolver, "comm", None) or MPI.COMM_WORLD


class _Metrics:
    """Sum-aggregated sync-on-read variables: each replica adds to its own copy."""

    def __init__(self, names: Sequence[str]):
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
        """In cross-replica context: back to zero."""
        for v in self.vars.values():
            v.assign(0.0)


class Trainer:
    """The model, optimizer, metrics and checkpoints of one run, and its train/test steps."""

    def __init__(self, strategy: ms.Strategy, args: argparse.Namespace, data: DigitsData):
        self.strategy, self.args, self.data = strategy, args, data
        self.steps_per_epoch = data.num_train // args.global_batch_size
        with strategy.scope():
            self.model = MLP([NUM_FEATURES, *args.hidden, NUM_CLASSES], seed=args.seed, dtype=args.dtype)
            self.optimizer = get_optimizer(args.optimizer, args.learning_rate)
            self.optimizer.build(self.model.trainable_variables)
            self.epoch = ms.Variable(np.int64(0), name="epoch", trainable=False)
            self.train_metrics = _Metrics(["loss", "correct", "count"])
            self.test_metrics = _Metrics(["correct", "count"])
        self.manager = None
        self.checkpoint = Checkpoint(model=self.model, optimizer=self.optimizer, epoch=self.epoch)
        if args.checkpoint_dir:
            self.manager = CheckpointManager(self.checkpoint, args.checkpoint_dir, max_to_keep=args.keep_checkpoints)
        self.input_options = ms.InputOptions(experimental_fetch_to_device=True,
                                             experimental_per_replica_buffer_size=args.prefetch)
        self.dist_test = strategy.experimental_distribute_dataset(
            test_dataset(data, args.global_batch_size), self.input_options)

    # -- replica functions (inside strategy.run) ----------------------------------------
    def train_step(self, inputs: Any) -> None:
        """One replica's part of a step: local sums, one fused all-reduce, the optimizer's merge_call."""
        x, y = inputs
        loss, correct, grads = self.model.loss_and_gradients(x, y)
        xp = dev.array_module(dev.device_of(loss))
        count = xp.asarray([x.shape[0]], dtype=self.model.dtype)
        total = ms.get_replica_context().all_reduce(ms.ReduceOp.SUM, {"grads": grads, "count": count})
        scale = 1.0 / total["count"][0]  # mean over the global batch
        self.optimizer.apply_gradients(
            [(g * scale, v) for g, v in zip(total["grads"], self.model.trainable_variables)],
            experimental_aggregate_gradients=False)
        self.train_metrics.add(loss=loss, correct=correct, count=x.shape[0])

    def test_step(self, inputs: Any) -> None:
        """One replica's held-out counts."""
        x, y = inputs
        predictions = self.model.predict(x)
        self.test_metrics.add(correct=(predictions == y.astype(predictions.dtype)).sum(), count=x.shape[0])

    # -- cross-replica driver ---------------------------------------------------------------
    def train_epoch(self, epoch: int, bar: Any, skip: int = 0, handler: Any = None) -> tuple[dict, float]:
        """Run one epoch's full global batches (the first ``skip`` already trained before a preemption: read,
        not trained on), each through ``handler.run`` where there is a preemption handler; the summed
        metrics and the seconds taken."""
        strategy = self.strategy
        with strategy.scope():
            self.train_metrics.reset()
        dataset = train_dataset(self.data, self.args.global_batch_size, self.args.seed, epoch)
        dist_train = strategy.experimental_distribute_dataset(dataset, self.input_options)
        t0 = time.perf_counter()
        iterator = iter(dist_train)
        try:
            for step in range(self.steps_per_epoch):  # full global batches only (see digits.py)
                batch = next(iterator)
                if step < skip:
                    continue
                if handler is None:
                    strategy.run(self.train_step, args=(batch,))
                else:
                    handler.run(strategy.run, self.train_step, args=(batch,))
                if bar is not None:
                    bar.update(1)
        finally:
            iterator.close()
        seconds = time.perf_counter() - t0
        with strategy.scope():
            self.epoch.assign(epoch + 1)
            return self.train_metrics.result(), seconds

    def evaluate(self) -> float:
        """Accuracy on the held-out shards (every rank reads its own)."""
        with self.strategy.scope():
            self.test_metrics.reset()
        for inputs in self.dist_test:
            self.strategy.run(self.test_step, args=(inputs,))
        with self.strategy.scope():
            test = self.test_metrics.result()
        return test["correct"] / max(test["count"], 1.0)


def _progress_bar(show: bool, total: int, desc: str) -> Any:
    """A tqdm bar on stderr (None when not shown or tqdm is missing)."""
    if not show:
        return None
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:  # the bar is optional
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def saved_steps(path: str, steps_per_epoch: int) -> int:
    """Training steps a checkpoint of this program holds (its metadata; epochs x steps for older files)."""
    metadata = read_manifest(path)["metadata"]
    return int(metadata.get("steps", int(metadata.get("epoch", 0)) * steps_per_epoch))


def main(argv: Sequence[str] | None = None) -> int:
    """Train; rank 0 prints one line per epoch. Returns the exit code.

    What happens:

    1. The digits data is written once into ``--data-dir`` as sharded ``.npy``
       files (``digits.py``; safe when many ranks and jobs share the directory).
    2. Each epoch a pipeline ``list_files -> interleave(NpyDataset(f).shuffle)
       -> batch(global batch) -> map(split x/y)`` goes through
       ``strategy.experimental_distribute_dataset`` with FILE auto-sharding (rank
       ``w`` reads shards ``w, w+W, ...``) and per-device prefetch.
    3. A step: every replica computes the summed loss and gradients of its slice
       by hand (``mlp.py``); the gradients and the example count go through ONE
       fused ``all_reduce``; the optimizer (SGD with momentum, or Adam) updates the
       mirrored variables in ``merge_call`` through ``extended.update``. Loss and
       accuracy accumulate in sync-on-read variables, read in cross-replica
       context at the end of the epoch; held-out accuracy is measured the same way.
    4. The chief checkpoints every ``--checkpoint-every`` epochs
       (``mpistrat.checkpoint``); ``--resume`` continues from the newest one.

    With the same ``--seed`` and ``--global-batch-size``, every layout of ranks and
    replicas (1 x 1, 1 x 4, 2 x 2, 4 x 1, ...) trains the same weights up to
    floating-point summation order, and a resumed run the same as an uninterrupted
    one: ``digits.train_dataset`` explains the data layout that makes FILE sharding exact.
    """
    args = parse_args(argv)
    t_start = time.perf_counter()
    strategy = _make_strategy(args)
    devices = strategy.extended.worker_devices
    replicas = strategy.num_replicas_in_sync
    num_workers = replicas // len(devices)
    is_chief = strategy.extended.should_checkpoint
    log = (lambda *a: print(*a, flush=True)) if is_chief else (lambda *a: None)

    num_shards = args.num_shards or num_workers * math.ceil(8 / num_workers)
    if num_shards % num_workers:
        raise ValueError(f"--num-shards {num_shards} is not a multiple of the {num_workers} ranks: FILE sharding "
                         "gives every rank the same number of shards; pick a multiple of the rank count")
    data = prepare_digits(args.data_dir, num_shards, _world_comm(strategy))
    batch = args.global_batch_size
    if data.num_train < batch:
        raise ValueError(f"--global-batch-size {batch} is larger than the {data.num_train} training examples")
    trainer = Trainer(strategy, args, data)
    names = ", ".join(f"{dev.parse_device(d).device_type}:{dev.parse_device(d).device_index}" for d in devices)
    log(f"mpistrat train: {num_workers} workers x {len(devices)} replicas = {replicas} replicas ({names} per "
        f"worker); {data.num_train} train / {data.num_test} test examples in {num_shards}+{num_shards} shards; "
        f"global batch {batch}, {trainer.steps_per_epoch} steps/epoch; {args.optimizer} lr {args.learning_rate}")
    if batch % num_shards or batch % replicas:
        log(f"note: global batch {batch} is not a multiple of {num_shards} shards and {replicas} replicas: "
            "training is correct but the weights depend on the rank/replica layout")
    handler = None
    if trainer.manager is not None:
        # SIGTERM or SIGUSR1 (Slurm's --signal) on any rank: every rank saves at the next step and exits 42.
        # Its checkpoint (kept apart from the epoch ones) is restored here if there is one.
        handler = PreemptionCheckpointHandler(strategy.cluster_resolver, trainer.checkpoint,
                                              os.path.join(args.checkpoint_dir, "preemption"))
        if handler.total_run_calls:
            log(f"resumed from the preemption checkpoint after {int(trainer.optimizer.iterations.numpy())} steps")
    if trainer.manager is not None and args.resume:
        latest = trainer.manager.latest_checkpoint
        steps = int(trainer.optimizer.iterations.numpy())
        if latest is not None and saved_steps(latest, trainer.steps_per_epoch) > steps:
            trainer.manager.checkpoint.restore(latest)
            log(f"resumed from {latest} (epoch {int(trainer.epoch.numpy())})")
        elif latest is None and not steps:
            log(f"no checkpoint in {args.checkpoint_dir}: starting from scratch")

    done = int(trainer.optimizer.iterations.numpy())  # steps trained: one optimizer update each
    first_epoch, skip = divmod(done, trainer.steps_per_epoch)
    test_acc = float("nan")
    if first_epoch >= args.epochs:
        log(f"already trained {first_epoch} epochs (--epochs {args.epochs}): evaluating only")
        test_acc = trainer.evaluate()
    show_bar = is_chief and not args.no_progress and (args.progress or sys.stderr.isatty())
    for epoch in range(first_epoch, args.epochs):
        bar = _progress_bar(show_bar, trainer.steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}")
        try:
            train, seconds = trainer.train_epoch(epoch, bar, skip if epoch == first_epoch else 0, handler)
        finally:
            if bar is not None:
                bar.close()
        test_acc = trainer.evaluate()
        log(f"epoch {epoch + 1}/{args.epochs}  loss {train['loss'] / train['count']:.4f}  "
            f"accuracy {train['correct'] / train['count']:.4f}  test accuracy {test_acc:.4f}  "
            f"{train['count'] / seconds:.0f} examples/s")
        if trainer.manager is not None and ((epoch + 1) % args.checkpoint_every == 0 or epoch + 1 == args.epochs):
            path = trainer.manager.save(checkpoint_number=epoch + 1, metadata={
                "epoch": epoch + 1, "seed": args.seed, "steps": (epoch + 1) * trainer.steps_per_epoch})
            log(f"saved checkpoint {path}")
    log(f"final test accuracy {test_acc:.4f} after {args.epochs} epochs on {num_workers} workers x "
        f"{len(devices)} replicas ({time.perf_counter() - t_start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
