#!/usr/bin/env python3
"""Asynchronous training of the digits model with ParameterServerStrategy (TensorFlow's parameter-server tutorial).

    mpiexec -n 4 python examples/train_ps.py              # 1 chief, 1 ps, 2 workers
    mpiexec -n 5 python examples/train_ps.py --num-ps 2   # 1 chief, 2 ps, 2 workers

Rank 0 is the chief (the coordinator), the next ``--num-ps`` ranks hold the variables, the rest are
workers. The ps and worker ranks start their servers at the top and serve until the chief is done; the
chief builds the model in the strategy's scope (its variables go to the ps), makes a per-worker dataset
(each worker its own shard of the training examples, reshuffled each epoch), schedules one function per
global batch on whichever worker is free, and evaluates on the held-out examples after every epoch. The
model and data are ``examples/train.py``'s (an MLP on the UCI digits; same split); the update is plain
SGD applied by the ps as each worker's gradients come in, no momentum (see the README on optimizers), its
learning rate decayed linearly over the epochs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without install
import numpy as np  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.examples.digits import DATA_SEED, NUM_CLASSES, NUM_FEATURES, TEST_FRACTION, load_digits  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-ps", type=int, default=1, help="parameter-server ranks (default 1)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=64, help="examples per scheduled step")
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--hidden", type=int, nargs="+", default=[64])
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the shuffles")
    p.add_argument("--staleness", type=int, default=None, help="bound the staleness (0: synchronous rounds)")
    return p.parse_args()


def split_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``examples/train.py``'s split: the same held-out fifth, pixels scaled to [0, 1]."""
    images, labels = load_digits()
    order = np.random.default_rng(DATA_SEED).permutation(len(images))
    num_test = int(round(len(images) * TEST_FRACTION))
    x, y = (images / 16.0).astype(np.float32), labels.astype(np.int64)
    return x[order[num_test:]], y[order[num_test:]], x[order[:num_test]], y[order[:num_test]]


args = parse_args()
resolver = ms.cluster_resolver.MPIClusterResolver(num_ps=args.num_ps)
if resolver.task_type in ("ps", "worker"):
    ms.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    sys.exit(0)

from mpistrat.examples.mlp import MLP  # noqa: E402

strategy = ms.ParameterServerStrategy(resolver)
coordinator = ms.coordinator.ClusterCoordinator(strategy, staleness=args.staleness)
x_train, y_train, x_test, y_test = split_digits()
num_workers = len(resolver.cluster_spec().as_dict()["worker"])
steps_per_epoch = len(x_train) // args.global_batch_size

with strategy.scope():  # the model's and the optimizer's variables live on the ps
    model = MLP([NUM_FEATURES, *args.hidden, NUM_CLASSES], seed=args.seed)
    optimizer = ms.optimizers.SGD(args.learning_rate)
    optimizer.build(model.trainable_variables)


def dataset_fn(input_context: ms.InputContext) -> ms.data.Dataset:
    """This worker's shard of the training examples, reshuffled each epoch, batches of the global size."""
    ds = ms.data.Dataset.from_tensor_slices((x_train, y_train))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.shuffle(len(x_train), seed=args.seed + input_context.input_pipeline_id).repeat().batch(
        args.global_batch_size)


def per_worker_dataset_fn() -> ms.DistributedDataset:
    return strategy.distribute_datasets_from_function(dataset_fn)


def step_fn(iterator) -> tuple[float, int]:
    """One step on a worker: the batch's mean gradient, applied to the ps-held variables."""

    def replica_fn(x, y):
        loss, correct, grads = model.loss_and_gradients(x, y)
        scale = 1.0 / len(x)
        optimizer.apply_gradients([(g * scale, v) for g, v in zip(grads, model.trainable_variables)])
        return loss * scale, correct

    x, y = next(iterator)
    loss, correct = strategy.run(replica_fn, args=(x, y))
    return float(loss), int(correct)


per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
print(f"ParameterServerStrategy: 1 chief, {args.num_ps} ps, {num_workers} workers; {steps_per_epoch} steps of "
      f"{args.global_batch_size} per epoch, SGD lr {args.learning_rate}", flush=True)
start = time.perf_counter()
for epoch in range(args.epochs):
    # Linear decay to a tenth: the late, stale updates of asynchronous training then move the weights less.
    optimizer.learning_rate = args.learning_rate * max(0.1, 1.0 - epoch / args.epochs)
    results = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(steps_per_epoch)]
    coordinator.join()
    losses, correct = zip(*(r.fetch() for r in results))
    accuracy = float((model.predict(x_test) == y_test).mean())
    print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses):.4f}, train accuracy "
          f"{sum(correct) / (steps_per_epoch * args.global_batch_size):.4f}, test accuracy {accuracy:.4f}", flush=True)
seconds = time.perf_counter() - start
print(f"final test accuracy {accuracy:.4f} after {args.epochs} epochs ({seconds:.1f} s, "
      f"{args.epochs * steps_per_epoch * args.global_batch_size / seconds:.0f} examples/s)", flush=True)
