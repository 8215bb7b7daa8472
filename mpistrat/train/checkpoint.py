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
import tempfile
import zipfile
from typing import Any, Iterator

import numpy as np

from mpistrat.distribute import context

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointError", "latest_checkpoint"]

_FORMAT = "mpistrat-checkpoint"
_VERSION = 1
_MANIFEST_KEY = "__manifest__"


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, corrupt, or does not match the live variables."""


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


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _status(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _broadcast_json(comm: Any, value: Any) -> Any:
    """The chief's JSON-serialisable ``value`` on every rank, sent as raw UTF-8 bytes (no pickle)."""
    data = json.dumps(value).encode() if comm.rank == 0 else b""
    (size,) = comm.broadcast([np.array([len(data)], dtype=np.int64)], root=0)
    buffer = np.frombuffer(data, dtype=np.uint8) if comm.rank == 0 else np.empty(int(size[0]), dtype=np.uint8)
    (received,) = comm.broadcast([buffer], root=0)
    return json.loads(received.tobytes().decode())


class Checkpoint:
    """A set of named variables to save and restore together (``tf.train.Checkpoint``).

    ``Checkpoint(model=model, optimizer=optimizer, step=step)``: each keyword
    names a variable, a list or dict of variables, or an object with a
    ``variables`` attribute (``MLP``, optimizers). Variables are saved under
    ``"<keyword>/<variable name>"``.

    A checkpoint is one ``.npz`` file (a zip of ``.npy`` members, each with a
    CRC-32) holding every variable's value and a JSON manifest (names,
    shapes, dtypes, user metadata). Saving is collective: every rank reads
    the values (sync-on-read variables aggregate across ranks), the chief
    alone writes a temporary file in the target directory, fsyncs it, renames
    it into place and fsyncs the directory, so a crash at any point leaves
    either the old set of checkpoints or the new one, never a partial file
    under a checkpoint's name. Restoring is collective too: the chief reads
    the file with ``np.load(allow_pickle=False)`` (no code execution), checks
    it against the manifest, broadcasts the manifest (JSON bytes) and the
    arrays as raw buffers (nothing is pickled, on disk or between ranks), and
    every rank verifies names, shapes and dtypes against its live variables
    before assigning. Any problem raises the same :class:`CheckpointError`,
    naming the file, on every rank.
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise ValueError("Checkpoint needs at least one object to track, e.g. Checkpoint(model=model)")
        self._objects = objects

    def variables(self) -> dict:
        """Name -> variable, for everything tracked (built optimizers' slots included)."""
        out: dict = {}
        for key, obj in self._objects.items():
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

    def _agree(self, comm: Any, error: BaseException | None) -> None:
        """Raise the chief's error (if any) on every rank."""
        message = _status(error)
        if comm is not None:
            message = _broadcast_json(comm, message)
        if message is not None:
            if error is not None and comm is None:
                raise error
            raise CheckpointError(message)

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
        error = None
        if comm is None or comm.rank == 0:
            try:
                _write_npz(file_path, list(variables), arrays, metadata or {})
                if then is not None:
                    then(file_path)
            except Exception as exc:  # reported on every rank below
                error = CheckpointError(f"Could not write checkpoint {file_path!r}: {type(exc).__name__}: {exc}")
        self._agree(comm, error)
        return file_path

    # -- restore ------------------------------------------------------------------------
    def restore(self, save_path: str) -> dict:
        """Load ``save_path`` into the tracked variables on every rank; returns the saved metadata."""
        save_path = os.fspath(save_path)
        variables = self.variables()
        strategy, comm = self._strategy_and_comm(variables)
        manifest, arrays, error = None, None, None
        if comm is None or comm.rank == 0:
            try:
                manifest, arrays = _read_npz(save_path)
            except CheckpointError as exc:
                error = exc
        self._agree(comm, error)
        if comm is not None:
            manifest = _broadcast_json(comm, manifest)
        _verify(save_path, manifest, variables)
        if comm is not None:
            if comm.rank != 0:
                arrays = [np.empty(tuple(e["shape"]), np.dtype(e["dtype"])) for e in manifest["variables"]]
            arrays = comm.broadcast(arrays, root=0)
        by_name = {e["name"]: a for e, a in zip(manifest["variables"], arrays)}
        with self._cross_replica(strategy):
            for name, var in variables.items():
                var.assign(by_name[name])
        return dict(manifest.get("metadata", {}))

    read = restore


def _write_npz(path: str, names: list, arrays: list, metadata: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    manifest = {
        "format": _FORMAT, "version": _VERSION, "metadata": metadata,
        "variables": [{"name": n, "shape": list(a.shape), "dtype": a.dtype.str} for n, a in zip(names, arrays)],
    }
    members = {f"v{i}": a for i, a in enumerate(arrays)}
    members[_MANIFEST_KEY] = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **members)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _read_npz(path: str) -> tuple[dict, list]:
    """The manifest and arrays of a checkpoint file; CheckpointError naming the file otherwise."""
    if not os.path.isfile(path):
        raise CheckpointError(f"Checkpoint file {path!r} does not exist")
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as npz:  # f closes even if np.load fails
            if _MANIFEST_KEY not in npz.files:
                raise CheckpointError(f"Checkpoint file {path!r} has no manifest: not an mpistrat checkpoint")
            manifest = json.loads(bytes(npz[_MANIFEST_KEY]).decode())
            if manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
                raise CheckpointError(f"Checkpoint file {path!r} has format {manifest.get('format')!r} version "
                                      f"{manifest.get('version')!r}; expected {_FORMAT!r} version {_VERSION}")
            arrays = []
            for i, entry in enumerate(manifest["variables"]):
                arr = npz[f"v{i}"]
                if list(arr.shape) != list(entry["shape"]) or arr.dtype.str != entry["dtype"]:
                    raise CheckpointError(
                        f"Checkpoint file {path!r} is inconsistent: {entry['name']!r} is stored with shape "
                        f"{arr.shape} dtype {arr.dtype} but its manifest says {tuple(entry['shape'])} {entry['dtype']}")
                arrays.append(arr)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError, UnicodeDecodeError, TypeError) as exc:
        raise CheckpointError(f"Checkpoint file {path!r} is corrupt or truncated: {type(exc).__name__}: {exc}") from None
    return manifest, arrays


def _verify(path: str, manifest: dict, variables: dict) -> None:
    saved = {e["name"]: e for e in manifest["variables"]}
    missing = [n for n in variables if n not in saved]
    unexpected = [n for n in saved if n not in variables]
    problems = []
    if missing:
        problems.append(f"missing from the file: {missing}")
    if unexpected:
        problems.append(f"in the file but not among the live variables: {unexpected}")
    for name, var in variables.items():
        entry = saved.get(name)
        if entry is None:
            continue
        shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
        if shape != tuple(var.shape) or dtype != np.dtype(var.dtype):
            problems.append(f"{name!r}: saved shape {shape} dtype {dtype.name}, live shape {tuple(var.shape)} "
                            f"dtype {np.dtype(var.dtype).name}")
    if problems:
        raise CheckpointError(f"Checkpoint file {path!r} does not match the live variables: " + "; ".join(problems))


def _numbered(directory: str, name: str) -> list[tuple[int, str]]:
    pattern = re.compile(rf"^{re.escape(name)}-(\d+)\.npz$")
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
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
        _fsync_directory(self.directory)

    def _chief_view(self, fn: Any) -> Any:
        """``fn()`` as the chief sees the directory (other ranks may not share its file system)."""
        _, comm = self.checkpoint._strategy_and_comm(self.checkpoint.variables())
        if comm is None:
            return fn()
        return _broadcast_json(comm, fn() if comm.rank == 0 else None)

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint if there is one (collective); returns its path or None."""
        path = self._chief_view(lambda: self.latest_checkpoint)
        if path is not None:
            self.checkpoint.restore(path)
        return path
