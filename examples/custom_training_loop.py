"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, ported to mpistrat.

The loop is the tutorial's (https://www.tensorflow.org/tutorials/distribute/custom_training)
with only the ``tf.distribute``, ``tf.nn`` and ``tf.data`` names changed to ``ms``,
``ms.nn`` and ``ms.data``. Two parts have no TensorFlow-free counterpart and are replaced:
the Keras model and ``tf.GradientTape`` by ``mpistrat.examples.mlp.MLP`` (a dense
network with a hand-written backward pass), and Fashion-MNIST by the UCI handwritten digits (shipped with the package).
``docs/porting.md`` shows the two programs side by side.

Run it on one rank or on several, with the same global batch:
``python examples/custom_training_loop.py`` or
``mpiexec -n 2 python examples/custom_training_loop.py``; both print the same losses.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any, Sequence

import numpy as np

import mpistrat as ms
from mpistrat.examples.mlp import MLP
from mpistrat.optimizers import Adam


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> "tuple[tuple, tuple]":
    """``((train_images, train_labels), (test_images, test_labels))``, pixels scaled to [0, 1]."""
    from mpistrat.examples.digits import load_digits  # noqa: PLC0415 - an example's data

    pixels, labels = load_digits()
    images = (pixels / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(images))
    num_test = int(round(len(images) * test_fraction))
    test, train = order[:num_test], order[num_test:]
    return (images[train], labels[train]), (images[test], labels[test])


def sparse_categorical_crossentropy(labels: Any, logits: Any) -> "tuple[Any, Any]":
    """Per-example loss of ``from_logits=True`` and its gradient w.r.t. ``logits`` (the tape's job)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    per_example_loss = np.log(total[:, 0]) - shifted[rows, labels]
    dlogits = exp / total
    dlogits[rows, labels] -= 1
    return per_example_loss, dlogits


def main(argv: Sequence[str] | None = None) -> dict:
    """Train, print one line per epoch, and return the losses and accuracies."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--output", help="write the per-step and per-epoch results here as JSON (rank 0)")
    args = parser.parse_args(argv)

    # One MPI rank is one worker; on one rank this is the tutorial's one-machine strategy.
    strategy = ms.MultiWorkerMirroredStrategy()

    (train_images, train_labels), (test_images, test_labels) = load_digits_split()
    BUFFER_SIZE = len(train_images)
    GLOBAL_BATCH_SIZE = args.global_batch_size
    EPOCHS = args.epochs

    # The tutorial's pipelines: a dataset of (image, label) tuples, shuffled, in global batches.
    train_dataset = ms.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(
        BUFFER_SIZE, seed=7).batch(GLOBAL_BATCH_SIZE)
    test_dataset = ms.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    with strategy.scope():
        def compute_loss(labels: Any, logits: Any) -> "tuple[Any, Any]":
            per_example_loss, dlogits = sparse_categorical_crossentropy(labels, logits)
            loss = ms.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            return loss, dlogits / GLOBAL_BATCH_SIZE  # d(loss)/d(logits), as the tape would give

    with strategy.scope():
        model = MLP([64, 128, 10], seed=1)  # create_model()
        optimizer = Adam(learning_rate=0.001)

    def train_step(inputs: Any) -> Any:
        images, labels = inputs
        logits, acts = model.forward(images)  # model(images, training=True)
        loss, dlogits = compute_loss(labels, logits)
        gradients = model.backward(acts, dlogits)  # tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # sums over replicas
        correct = np.sum(logits.argmax(axis=1) == labels)  # train_accuracy.update_state
        return loss, correct

    def test_step(inputs: Any) -> Any:
        images, labels = inputs
        logits, _ = model.forward(images)
        per_example_loss, _ = sparse_categorical_crossentropy(labels, logits)
        return per_example_loss.sum(), np.sum(logits.argmax(axis=1) == labels)

    def distributed_train_step(dataset_inputs: Any) -> "tuple[float, int]":
        per_replica_losses, per_replica_correct = strategy.run(train_step, args=(dataset_inputs,))
        return (float(strategy.reduce(ms.ReduceOp.SUM, per_replica_losses, axis=None)),
                int(strategy.reduce(ms.ReduceOp.SUM, per_replica_correct, axis=None)))

    def distributed_test_step(dataset_inputs: Any) -> "tuple[float, int]":
        losses, correct = strategy.run(test_step, args=(dataset_inputs,))
        return (float(strategy.reduce(ms.ReduceOp.SUM, losses, axis=None)),
                int(strategy.reduce(ms.ReduceOp.SUM, correct, axis=None)))

    results: dict = {"step_losses": [], "epochs": []}
    for epoch in range(EPOCHS):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        train_correct = 0
        for x in train_dist_dataset:
            step_loss, step_correct = distributed_train_step(x)
            results["step_losses"].append(step_loss)
            total_loss += step_loss
            train_correct += step_correct
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        test_loss_sum, test_correct = 0.0, 0
        for x in test_dist_dataset:
            batch_loss, batch_correct = distributed_test_step(x)
            test_loss_sum += batch_loss
            test_correct += batch_correct
        row = {"epoch": epoch + 1, "loss": train_loss, "accuracy": train_correct / len(train_images),
               "test_loss": test_loss_sum / len(test_images), "test_accuracy": test_correct / len(test_images)}
        results["epochs"].append(row)
        if strategy.cluster_resolver.task_id == 0:
            print("Epoch {epoch}, Loss: {loss:.6f}, Accuracy: {acc:.2f}, Test Loss: {tl:.6f}, Test Accuracy: {ta:.2f}".format(
                epoch=row["epoch"], loss=row["loss"], acc=row["accuracy"] * 100, tl=row["test_loss"],
                ta=row["test_accuracy"] * 100), flush=True)

    if args.output and strategy.cluster_resolver.task_id == 0:
        directory = os.path.dirname(os.path.abspath(args.output))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".results-")
        with os.fdopen(fd, "w") as f:
            json.dump(results, f)
        os.replace(tmp, args.output)
    return results


if __name__ == "__main__":
    main()
