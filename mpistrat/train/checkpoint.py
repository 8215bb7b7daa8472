"""Checkpoints of variables as ``tf.train`` has them: the chief writes atomically, every rank restores.

``Checkpoint(**objects)`` with ``write``/``restore``, ``CheckpointManager``
(numbered checkpoints, ``max_to_keep``) and ``latest_checkpoint(directory)``;
a checkpoint is one ``.npz`` file with a JSON manifest, never pickled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from mpistrat.data.iterator_state import SaveableIterator
from mpistrat.distribute import context
from mpistrat.train.checkpoint_file import (
    CheckpointError,
    check_variables,
    fsync_directory,
    read_file,
    write_file,
)

__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager", "latest_checkpoint"]


ITERATORS_KEY = "mpistrat.iterators"  # the metadata entry holding tracked iterators' positions


def _is_variable(x: Any) -> bool:
    return getattr(x, "_is_variable", False)


def _collect(prefix: str, obj: Any, out: dict) -> None:
    """Name every variable reachable from ``obj`` (a variable, a list/dict of them, or an object with ``variables``)."""
    if _is_variable(obj):
        name = prefix if not getattr(obj, "name", None) else f"{prefix}/{obj.name}"
        if name in out and out[name] is not obj:
            raise ValueError(f"Checkpoint: two different variables are both named {name!r}")
        out[name] = obj
    elif isinstance(obj, dict):
        for key in obj:
            _collect(f"{prefix}/{key}", obj[key], out)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect(prefix, item, out)
    elif hasattr(obj, "variables"):
        variables = obj.variables() if callable(obj.variables) else obj.variables
        _collect(prefix, list(variables), out)
    else:
        raise TypeError(f"Checkpoint: {prefix!r} is a {type(obj).__name__}, not a variable, a list/dict of "
                        "variables, or an object with a `variables` attribute")


def _broadcast_json(comm: Any, value: Any, root: int = 0) -> Any:
    """``root``'s JSON-serialisable ``value`` on every rank, sent as raw UTF-8 bytes (no pickle)."""
    data = json.dumps(value).encode() if comm.rank == root else b""
    (size,) = comm.broadcast([np.array([len(data)], dtype=np.int64)], root=root)
    buffer = np.frombuffer(data, dtype=np.uint8) if comm.rank == root else np.empty(int(size[0]), dtype=np.uint8)
    (received,) = comm.broadcast([buffer], root=root)
    return json.loads(received.tobytes().decode())


def _agree(comm: Any, error: CheckpointError | None) -> None:
    """Raise the error of the lowest rank that has one, with its message, on every rank (collective)."""
    if comm is None:
        if error is not None:
            raise error
        return
    failed = np.flatnonzero(comm.step_agreement(0 if error is None else 1))
    if failed.size:
        root = int(failed[0])
        message = _broadcast_json(comm, str(error) if comm.rank == root else None, root=root)
        raise CheckpointError(message) from (error if comm.rank == root else None)


class Checkpoint:
    """A set of named variables to save and restore together (``tf.train.Checkpoint``).

    ``Checkpoint(model=model, optimizer=optimizer, step=step)``: each keyword
    names a variable, a list or dict of variables, or an object with a
    ``variables`` attribute (``MLP``, optimizers). Variables are saved under
    ``"<keyword>/<variable name>"``. A keyword may name a distributed
    iterator instead: its position (steps taken, shuffle seeds and epochs)
    is saved in the manifest's metadata under ``"mpistrat.iterators"`` and
    restored by re-seeding and fast-forwarding a fresh iterator, so a resumed
    run sees the same next batches (a ``from_generator`` source raises).

    A checkpoint is one ``.npz`` file (a zip of ``.npy`` members, each with a
    CRC-32) holding every variable's value and a JSON manifest (names,
    shapes, dtypes, user metadata). Saving is collective: every rank reads
    the values (sync-on-read variables aggregate across ranks), the chief
    alone writes a temporary file in the target directory, fsyncs it, renames
    it into place and fsyncs the directory, so a crash at any point leaves
    either the old set of checkpoints or the new one, never a partial file
    under a checkpoint's name. Restoring is collective too: the chief checks
    the manifest and every member's declared size and ``.npy`` header
    against its live variables before reading any data, then reads the data
    in bounded chunks (:mod:`mpistrat.train.checkpoint_file`; nothing is
    unpickled), broadcasts the manifest (JSON bytes) and the arrays as raw
    buffers, and every other rank checks names, shapes and dtypes against
    its own live variables before assigning. Any problem raises the same
    :class:`CheckpointError`, naming the file, on every rank.
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise ValueError("Checkpoint needs at least one object to track, e.g. Checkpoint(model=model)")
        self._objects = objects

    def variables(self) -> dict:
        """Name -> variable, for everything tracked (built optimizers' slots included)."""
        out: dict = {}
        for key, obj in self._objects.items():
            if not isinstance(obj, SaveableIterator):
                _collect(key, obj, out)
        if not out:
            raise ValueError("Checkpoint: the tracked objects hold no variables yet (build the optimizer first)")
        return out

    # -- collectives --------------------------------------------------------------------
    def _strategy_and_comm(self, variables: dict) -> tuple[Any, Any]:
        strategies = {id(getattr(v, "_distribute_strategy", None)): getattr(v, "_distribute_strategy", None)
                      for v in variables.values()}
        strategy = next(iter(strategies.values())) if len(strategies) == 1 else None
        if strategy is None:
            if len(strategies) > 1:
                raise ValueError("Checkpoint: the variables belong to different strategies")
            strategy = context.get_strategy()
        comm = getattr(strategy.extended, "_communicator", None)
        return strategy, (comm if comm is not None and comm.size > 1 else None)

    @staticmethod
    @contextlib.contextmanager
    def _cross_replica(strategy: Any) -> Iterator[None]:
        if context.get_strategy() is strategy and context.in_cross_replica_context():
            yield
        else:
            with strategy.scope():
                yield

    # -- save ---------------------------------------------------------------------------
    def write(self, file_path: str, metadata: dict | None = None) -> str:
        """Save to exactly ``file_path`` (collective: call on every rank; the chief writes)."""
        return self._write(os.fspath(file_path), metadata)

    def _write(self, file_path: str, metadata: dict | None, then: Any = None) -> str:
        """``write``, running ``then(file_path)`` on the chief after the file is in place (errors on every rank)."""
        variables = self.variables()
        strategy, comm = self._strategy_and_comm(variables)
        with self._cross_replica(strategy):
            arrays = [np.array(v.numpy(), order="C") for v in variables.values()]
        positions = {key: it._state() for key, it in self._iterators().items()}  # collective
        if positions:
            metadata = {**(metadata or {}), ITERATORS_KEY: positions}
        error = None
        if comm is None or comm.rank == 0:
            try:
                write_file(file_path, list(variables), arrays, metadata or {})
                if then is not None:
                    then(file_path)
            except Exception as exc:  # noqa: BLE001 - any failure to write is reported on every rank below
                error = CheckpointError(f"Could not write checkpoint {file_path!r}: {type(exc).__name__}: {exc}")
        _agree(comm, error)
        return file_path

    # -- restore ------------------------------------------------------------------------
    def restore(self, save_path: str) -> dict:
        """Load ``save_path`` into the tracked variables on every rank; returns the saved metadata.

        The chief checks the file's manifest and member headers against its
        live variables before reading any data; every other rank checks the
        chief's manifest against its own. A failure anywhere raises the same
        CheckpointError on every rank and changes no variable.
        """
        save_path = os.fspath(save_path)
        variables = self.variables()
        strategy, comm = self._strategy_and_comm(variables)
        expected = {name: (tuple(var.shape), np.dtype(var.dtype)) for name, var in variables.items()}
        manifest, arrays, error = None, None, None
        if comm is None or comm.rank == 0:
            try:
                manifest, arrays = read_file(save_path, expected)
            except CheckpointError as exc:
                error = exc
        _agree(comm, error)
        if comm is not None:
            manifest = _broadcast_json(comm, manifest)
            if comm.rank != 0:
                try:
                    check_variables(save_path, manifest, expected, rank=comm.rank)
                except CheckpointError as exc:
                    error = exc
            _agree(comm, error)
            if comm.rank != 0:
                arrays = [np.empty(*expected[e["name"]]) for e in manifest["variables"]]
            arrays = comm.broadcast(arrays, root=0)
        metadata = dict(manifest["metadata"])
        positions = metadata.pop(ITERATORS_KEY, {})
        for key in self._iterators():  # the same manifest on every rank: raised on all, before any change
            if key not in positions:
                raise CheckpointError(f"Checkpoint {save_path!r} holds no position for the iterator {key!r}")
        by_name = {e["name"]: a for e, a in zip(manifest["variables"], arrays)}
        with self._cross_replica(strategy):
            for name, var in variables.items():
                var.assign(by_name[name])
        for key, it in self._iterators().items():
            it._restore(positions[key])
        return metadata

    def _iterators(self) -> dict:
        """Keyword -> tracked input iterator (``Checkpoint(iterator=iter(dist_dataset))``)."""
        return {k: o for k, o in self._objects.items() if isinstance(o, SaveableIterator)}

    read = restore


def _numbered(directory: str, name: str) -> list[tuple[int, str]]:
    pattern = re.compile(rf"^{re.escape(name)}-(\d+)\.npz$")
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError(f"Checkpoint directory {directory!r} is a file, not a directory") from None
    except OSError as exc:
        raise CheckpointError(f"Checkpoint directory {directory!r} cannot be listed: {type(exc).__name__}: "
                              f"{exc}") from None
    found = [(int(m.group(1)), os.path.join(directory, e)) for e in entries if (m := pattern.match(e))]
    return sorted(found)


def latest_checkpoint(directory: str, checkpoint_name: str = "ckpt") -> str | None:
    """The path of the newest complete checkpoint in ``directory`` (highest number), or None."""
    found = _numbered(os.fspath(directory), checkpoint_name)
    return found[-1][1] if found else None


class CheckpointManager:
    """Numbered checkpoints ``<directory>/<checkpoint_name>-<N>.npz``, keeping the newest ``max_to_keep``."""

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt"):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"CheckpointManager needs a Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer or None, got {max_to_keep!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.]+", checkpoint_name):
            raise ValueError(f"checkpoint_name must be letters, digits, '_' or '.', got {checkpoint_name!r}")
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name

    @property
    def checkpoints(self) -> list[str]:
        """Complete checkpoints in the directory, oldest first."""
        return [p for _, p in _numbered(self.directory, self.checkpoint_name)]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.directory, self.checkpoint_name)

    def save(self, checkpoint_number: int | None = None, metadata: dict | None = None) -> str:
        """Write checkpoint ``checkpoint_number`` (default: newest + 1) and drop the oldest beyond ``max_to_keep``.

        Collective: call on every rank; only the chief touches the directory.
        """
        if checkpoint_number is None:
            found = self._chief_view(lambda: _numbered(self.directory, self.checkpoint_name))
            checkpoint_number = found[-1][0] + 1 if found else 1
        if not isinstance(checkpoint_number, (int, np.integer)) or checkpoint_number < 0:
            raise ValueError(f"checkpoint_number must be a non-negative integer, got {checkpoint_number!r}")
        path = os.path.join(self.directory, f"{self.checkpoint_name}-{int(checkpoint_number)}.npz")
        return self.checkpoint._write(path, metadata, then=self._prune)

    def _prune(self, newest: str) -> None:
        found = [p for _, p in _numbered(self.directory, self.checkpoint_name) if p != newest]
        keep = len(found) if self.max_to_keep is None else self.max_to_keep - 1
        for old in found[:max(0, len(found) - keep)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
        for entry in os.listdir(self.directory):  # temporary files of saves that were killed
            if entry.startswith(f".{self.checkpoint_name}-") and entry.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, entry))
        fsync_directory(self.directory)

    def _chief_view(self, fn: Any) -> Any:
        """``fn()`` as the chief sees the directory (other ranks may not share its file system).

        A CheckpointError from ``fn`` on the chief is raised on every rank.
        """
        _, comm = self.checkpoint._strategy_and_comm(self.checkpoint.variables())
        if comm is None:
            return fn()
        value, error = None, None
        if comm.rank == 0:
            try:
                value = fn()
            except CheckpointError as exc:
                error = exc
        _agree(comm, error)
        return _broadcast_json(comm, value)

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint if there is one (collective); returns its path or None."""
        path = self._chief_view(lambda: self.latest_checkpoint)
        if path is not None:
            self.checkpoint.restore(path)
        return path
