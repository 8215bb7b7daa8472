"""The training example's input: the UCI handwritten digits stored as ``.npy`` shards, read by FILE-sharded pipelines.

The shards are laid out so that every layout of ranks and replicas sees the
same global batches (:func:`train_dataset` says how).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

__all__ = ["DigitsData", "prepare_digits", "load_digits", "train_dataset", "test_dataset", "epoch_seed",
           "NUM_FEATURES", "NUM_CLASSES"]

NUM_FEATURES = 64
NUM_CLASSES = 10
DATA_SEED = 20261122  # fixes the train/test split and the stored order; not --seed
TEST_FRACTION = 0.2


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


# The 1,797 8x8 images of the UCI "Optical Recognition of Handwritten Digits" test set (E. Alpaydin,
# C. Kaynak, 1998; CC BY 4.0), pixel counts 0..16, as scikit-learn bundles them (sklearn.datasets.load_digits),
# stored here as uint8 so that the example needs no scikit-learn.
DIGITS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: float64 pixel counts 0..16, shape (1797, 64), and int64 labels 0..9."""
    with np.load(DIGITS_FILE) as data:
        return data["images"].astype(np.float64), data["labels"].astype(np.int64)


def _write_digits(target: str, num_shards: int) -> None:
    images, labels = load_digits()
    rows = np.hstack([images / 16.0, labels[:, None]]).astype(np.float32)
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
        manifest = {"dataset": "UCI optical handwritten digits (mpistrat/examples/digits.npz)", "data_seed": DATA_SEED, "num_shards": num_shards,
                    "rows_per_shard": per_shard, "num_train": len(train), "num_test": len(test),
                    "num_features": NUM_FEATURES, "num_classes": NUM_CLASSES, "columns": "64 pixels / 16, label", **names}
        _save_json(os.path.join(tmp, "manifest.json"), manifest)
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


def _save_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def prepare_digits(data_dir: str, num_shards: int, comm: Any = None) -> DigitsData:
    """Write the digits shards into ``data_dir`` unless present; collective over ``comm`` (mpi4py) if given.

    The bundled digits (``digits.npz``, no download) become ``S`` train and ``S``
    test shards, each row 64 pixel values / 16 and the label. The first rank
    of each node writes (atomically: a temporary directory renamed into
    place); the others wait, so several ranks and several jobs may share the
    directory. An error on any rank is raised on every rank.
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
    """The epoch's training pipeline: the same global batches under every rank/replica layout.

    Example ``i`` of the (fixed, seeded) training order is stored as row
    ``i // S`` of shard ``i % S``, and all train shards have the same length.
    Interleaving the shards row by row (block length 1) reads the examples in
    order, and a rank holding shards ``w, w+W, ...`` (FILE auto-sharding)
    reads exactly its share of every global batch: under TF's FILE batch rule
    (a rank's batch of B rows feeds W consecutive steps) step ``t`` of any
    layout uses rows ``t*B/S ... (t+1)*B/S - 1`` of every shard. Each epoch
    every shard is shuffled with the same seed (from ``seed`` and the epoch),
    i.e. by the same row permutation, which keeps that property; the stream
    repeats so that a rank's last batch of the epoch is full too, and the
    caller runs only ``rows // B`` steps, so the repeated rows are never
    consumed. Hence 1 rank x 4 replicas, 2 x 2, 4 x 1 and 1 x 1 see the same
    global batches and, as the reduced gradient is a sum divided by the
    global count, train the same weights up to floating-point summation
    order. This needs ``S`` divisible by the number of ranks and the global
    batch divisible by ``S`` and by the number of replicas (otherwise
    training is still correct, only not layout-independent). A resumed run
    reshuffles exactly as an uninterrupted one.
    """
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
