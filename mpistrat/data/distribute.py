"""Distributed datasets and iterators: sharding by policy, batch splitting, per-device prefetch.

``DistributedDataset(dataset, worker_info, options)`` and
``DistributedDatasetsFromFunction(dataset_fn, worker_info, options)`` are what
the strategies return from ``experimental_distribute_dataset`` and
``distribute_datasets_from_function``. Each step yields this rank's per-replica
values: the plain value with one local replica, else ``PerReplica`` in local
replica order. How batches are split is described in :mod:`.splitting`.

Every step the ranks agree (``communicator.step_agreement``) on a code: 0 this
rank has data, 1 exhausted, 2 failed, 3 exhausted without ever seeing a batch.
Iteration ends on every rank at the first step where no rank has data; a
replica without data meanwhile gets an empty batch (leading dimension 0, same
trailing shape and dtype). A failure on any rank raises
:class:`InputPipelineError` on every rank, naming the failing rank(s) and their
messages. With ``experimental_fetch_to_device`` and a positive
``experimental_per_replica_buffer_size``, a background thread prepares the next
steps and copies each replica's part to its device (CuPy: on a non-blocking
stream per device, synchronised before hand-over) into a bounded queue.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional as _Opt

import numpy as np

from .. import nest
from ..devices import device_index, is_gpu, to_device
from ..input_options import InputContext, InputOptions, InputReplicationMode, InputWorkerInfo
from ..values import PerReplica
from .autoshard import DATA, needs_seeds, resolve_policy, with_seeds
from .dataset import Dataset
from .errors import InputPipelineError, OutOfRangeError, rank_label
from .optional import Optional
from .prefetch import BackgroundProducer
from .spec import PerReplicaSpec, TensorSpec
from .splitting import empty_like_template, function_steps, global_steps, local_steps, template_of

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator", "Optional"]

HAVE_DATA, EXHAUSTED, FAILED, EXHAUSTED_NO_TEMPLATE = 0, 1, 2, 3
_TRANSFORMATIONS = frozenset(
    "map filter batch unbatch shuffle repeat take skip shard interleave flat_map prefetch cache zip "
    "enumerate concatenate with_options padded_batch apply window".split()
)


def _check_info(worker_info: Any) -> InputWorkerInfo:
    if not isinstance(worker_info, InputWorkerInfo):
        raise TypeError(f"worker_info must be an InputWorkerInfo, got {type(worker_info).__name__}")
    return worker_info


def _check_options(options: Any) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be an mpistrat.InputOptions, got {type(options).__name__}")
    if options.experimental_per_replica_buffer_size < 0:
        raise ValueError(
            f"experimental_per_replica_buffer_size must be >= 0, got {options.experimental_per_replica_buffer_size}"
        )
    return options


def _failure_message(exc: BaseException) -> str:
    text = str(exc)
    label = rank_label()
    return f"{type(exc).__name__}: {text}" if label in text else f"{label}: {type(exc).__name__}: {text}"


def _agree_at_construction(info: InputWorkerInfo, error: _Opt[BaseException], mode: int = 0) -> None:
    """All ranks check that construction worked everywhere (and chose the same mode)."""
    comm = info.communicator
    if comm is None or info.num_workers == 1:
        if error is not None:
            raise error
        return
    codes = comm.step_agreement(FAILED if error is not None else 16 + mode)
    if (codes == FAILED).any():
        messages = comm.allgather_object(None if error is None else _failure_message(error))
        if error is not None:
            raise error
        failed = [r for r, c in enumerate(codes.tolist()) if c == FAILED]
        raise InputPipelineError(
            f"Building the distributed dataset failed on rank(s) {failed}: "
            + "; ".join(m for m in messages if m is not None)
        )
    if len(set(codes.tolist())) != 1:
        names = {16: "FILE", 17: "DATA", 18: "OFF"}
        raise InputPipelineError(
            "Ranks chose different sharding for the same dataset ("
            + ", ".join(f"rank {r}: {names.get(c, c)}" for r, c in enumerate(codes.tolist()))
            + "); do all ranks see the same files?"
        )


class _Placer:
    """Copies each replica's values to its device (in the producer thread when prefetching)."""

    def __init__(self, devices: tuple, fetch_to_device: bool):
        self.devices = devices
        self.fetch = fetch_to_device
        self.streams: dict = {}

    def _leaf(self, x: Any, device: str) -> Any:
        if isinstance(x, (bytes, str)) or getattr(x, "dtype", None) == object:
            return x
        return to_device(x, device)

    def __call__(self, values: List[Any]) -> List[Any]:
        if not self.fetch:
            return values
        out = []
        for value, device in zip(values, self.devices):
            if value is None:
                out.append(None)
            elif is_gpu(device):
                out.append(self._to_gpu(value, device))
            else:
                out.append(nest.map_structure(lambda x, d=device: self._leaf(x, d), value))
        return out

    def _to_gpu(self, value: Any, device: str) -> Any:
        import cupy  # noqa: PLC0415

        k = device_index(device)
        with cupy.cuda.Device(k):
            stream = self.streams.get(k)
            if stream is None:
                stream = self.streams[k] = cupy.cuda.Stream(non_blocking=True)
            with stream:
                placed = nest.map_structure(lambda x: self._leaf(x, device), value)
            stream.synchronize()
        return placed


class DistributedIterator:
    """One pass over a distributed dataset: ``next``, ``get_next``, ``get_next_as_optional``."""

    def __init__(self, make_steps: Callable[[], Iterator[List[Any]]], info: InputWorkerInfo, options: InputOptions,
                 element_spec: Callable[[], Any]):
        self._info = info
        self._comm = info.communicator if info.num_workers > 1 else None
        self._spec_fn = element_spec
        self._template: Any = None
        self._finished = False
        self._error: _Opt[InputPipelineError] = None
        self._local_done = False
        placer = _Placer(info.local_devices, options.fetch_to_device)

        def produce() -> Iterator[List[Any]]:
            return (placer(values) for values in make_steps())

        buffer = options.experimental_per_replica_buffer_size
        self._producer: _Opt[BackgroundProducer] = None
        if options.fetch_to_device and buffer > 0:
            self._producer = BackgroundProducer(produce, buffer, name=f"mpistrat-input-{rank_label().replace(' ', '')}")
            self._source: Iterator = self._producer
        else:
            self._source = produce()
        self._placer = placer

    # -- the per-step protocol ---------------------------------------------------------
    def _local_step(self) -> "tuple[int, Any, _Opt[BaseException]]":
        if self._local_done:
            return (EXHAUSTED if self._template is not None else EXHAUSTED_NO_TEMPLATE), None, None
        try:
            values = next(self._source)
        except StopIteration:
            self._local_done = True
            return (EXHAUSTED if self._template is not None else EXHAUSTED_NO_TEMPLATE), None, None
        except Exception as exc:  # a read error: every rank must hear of it
            self._local_done = True
            return FAILED, None, exc
        if self._template is None:
            for v in values:
                if v is not None:
                    self._template = template_of(v)
                    break
        return HAVE_DATA, values, None

    def _fail(self, codes: _Opt[np.ndarray], exc: _Opt[BaseException]) -> None:
        if self._comm is None:
            messages = [_failure_message(exc)]
            failed = [self._info.worker_index]
        else:
            messages = self._comm.allgather_object(None if exc is None else _failure_message(exc))
            failed = [r for r, c in enumerate(codes.tolist()) if c == FAILED]
        self._error = InputPipelineError(
            f"Input pipeline failed on rank(s) {failed}: " + "; ".join(m for m in messages if m is not None)
        )
        self._finish()
        raise self._error from exc

    def __next__(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._finished:
            raise StopIteration
        code, values, exc = self._local_step()
        if self._comm is None:
            if code == FAILED:
                self._fail(None, exc)
            if code != HAVE_DATA:
                self._finish()
                raise StopIteration
        else:
            codes = self._comm.step_agreement(code)
            if (codes == FAILED).any():
                self._fail(codes, exc)
            if not (codes == HAVE_DATA).any():
                self._finish()
                raise StopIteration
            if (codes == EXHAUSTED_NO_TEMPLATE).any():
                templates = self._comm.allgather_object(self._template)
                if self._template is None:
                    self._template = next(t for t in templates if t is not None)
            if values is None:
                values = [None] * self._info.num_local_replicas
        return self._assemble(values)

    def _assemble(self, values: List[Any]) -> Any:
        if any(v is None for v in values):
            if self._template is None:  # single worker, some replicas never got data
                self._template = next(template_of(v) for v in values if v is not None)
            empty = empty_like_template(self._template)
            values = [v if v is not None else self._placer([empty] * len(values))[i] for i, v in enumerate(values)]
        return values[0] if len(values) == 1 else PerReplica(values)

    # -- public API ---------------------------------------------------------------------
    def __iter__(self) -> "DistributedIterator":
        return self

    def get_next(self) -> Any:
        """The next per-replica values; raises OutOfRangeError at the end."""
        try:
            return self.__next__()
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> Optional:
        """The next per-replica values as an Optional, empty at the end (on every rank together)."""
        try:
            return Optional.from_value(self.__next__())
        except StopIteration:
            return Optional.empty(self.element_spec)

    @property
    def element_spec(self) -> Any:
        """The spec of what one step yields (per replica: leading dimension None)."""
        return self._spec_fn()

    def _finish(self) -> None:
        self._finished = True
        if self._producer is not None:
            self._producer.close()

    def close(self) -> None:
        """Stop the prefetch thread (if any); the iterator yields nothing more."""
        self._finish()

    def __del__(self) -> None:
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.close(timeout=1.0)


class _DistributedBase:
    """Shared by both distributed dataset kinds: iteration, reduce, and the no-transformations rule."""

    _info: InputWorkerInfo
    _options: InputOptions

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._make_steps, self._info, self._options, lambda: self.element_spec)

    def _make_steps(self) -> Iterator[List[Any]]:
        raise NotImplementedError

    def _replica_spec(self, dataset_spec: Any) -> Any:
        raise NotImplementedError

    def _per_replica(self, spec: Any) -> Any:
        if self._info.num_local_replicas == 1:
            return spec
        return PerReplicaSpec((spec,) * self._info.num_local_replicas)

    def reduce(self, initial_state: Any, reduce_fn: Callable[[Any, Any], Any]) -> Any:
        """Fold ``reduce_fn(state, per_replica_values)`` over every step."""
        state = initial_state
        for value in self:
            state = reduce_fn(state, value)
        return state

    def __getattr__(self, name: str) -> Any:
        if name in _TRANSFORMATIONS:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}': a distributed dataset cannot be "
                f"transformed. Apply .{name}(...) to the mpistrat.data.Dataset before distributing it."
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


def _unbatched_to_replica(spec: Any) -> Any:
    return nest.map_structure(lambda s: TensorSpec((None,) + tuple(s.shape[1:]), s.dtype), spec)


class DistributedDataset(_DistributedBase):
    """A batched Dataset spread over the replicas of all ranks (``experimental_distribute_dataset``)."""

    def __init__(self, dataset: Dataset, worker_info: InputWorkerInfo, options: _Opt[InputOptions] = None):
        info = _check_info(worker_info)
        error: _Opt[BaseException] = None
        mode = None
        try:
            if not isinstance(dataset, Dataset):
                raise TypeError(
                    f"experimental_distribute_dataset expects an mpistrat.data.Dataset, got {type(dataset).__name__}"
                )
            opts = _check_options(options)
            if opts.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
                raise NotImplementedError(
                    "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function`."
                )
            if opts.experimental_place_dataset_on_device:
                raise ValueError(
                    "When `experimental_place_dataset_on_device` is set for dataset placement, you must also "
                    "specify `PER_REPLICA` for the replication mode"
                )
            local, mode = resolve_policy(dataset, info.num_workers, info.worker_index, warn=info.worker_index == 0)
        except Exception as exc:  # reported on every rank
            error = exc
        _agree_at_construction(info, error, {"FILE": 0, "DATA": 1, "OFF": 2}.get(mode, 0))
        if mode == DATA and info.communicator is not None and needs_seeds(local):
            seed = info.communicator.broadcast_object(int(np.random.SeedSequence().entropy % (1 << 62)), root=0)
            local = with_seeds(local, seed)
        self._info, self._options = info, opts
        self._dataset, self._mode = local, mode

    @property
    def auto_shard_mode(self) -> str:
        """The sharding applied: "FILE", "DATA" or "OFF"."""
        return self._mode

    def _make_steps(self) -> Iterator[List[Any]]:
        info = self._info
        if self._mode == DATA:
            return global_steps(iter(self._dataset), info.num_replicas_in_sync, info.first_replica_id,
                                info.num_local_replicas)
        return local_steps(iter(self._dataset), info.num_workers, info.num_local_replicas, info.worker_index)

    @property
    def element_spec(self) -> Any:
        """Per-replica spec: the dataset's spec with an unknown leading (batch) dimension."""
        return self._per_replica(_unbatched_to_replica(self._dataset.element_spec))


class DistributedDatasetsFromFunction(_DistributedBase):
    """Datasets built by ``dataset_fn(InputContext)`` per worker or per replica (``distribute_datasets_from_function``)."""

    def __init__(self, dataset_fn: Callable[[InputContext], Dataset], worker_info: InputWorkerInfo,
                 options: _Opt[InputOptions] = None):
        info = _check_info(worker_info)
        error: _Opt[BaseException] = None
        datasets: list = []
        try:
            if not callable(dataset_fn):
                raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
            opts = _check_options(options)
            per_replica = opts.experimental_replication_mode == InputReplicationMode.PER_REPLICA
            if not per_replica and opts.experimental_place_dataset_on_device:
                raise ValueError(
                    "When `experimental_place_dataset_on_device` is set for dataset placement, you must also "
                    "specify `PER_REPLICA` for the replication mode"
                )
            if per_replica and opts.fetch_to_device and opts.experimental_place_dataset_on_device:
                raise ValueError(
                    "`experimental_place_dataset_on_device` can not be set to True when experimental_fetch_to_device "
                    "is True and replication mode is set to `PER_REPLICA`"
                )
            if per_replica:
                contexts = [
                    InputContext(info.num_replicas_in_sync, info.first_replica_id + r, info.num_replicas_in_sync)
                    for r in range(info.num_local_replicas)
                ]
            else:
                contexts = [InputContext(info.num_workers, info.worker_index, info.num_replicas_in_sync)]
            for ctx in contexts:
                ds = dataset_fn(ctx)
                if not isinstance(ds, Dataset):
                    raise TypeError(f"dataset_fn must return an mpistrat.data.Dataset, got {type(ds).__name__}")
                datasets.append(ds)
        except Exception as exc:
            error = exc
        _agree_at_construction(info, error)
        self._info, self._options, self._datasets = info, opts, datasets

    def _make_steps(self) -> Iterator[List[Any]]:
        return function_steps([iter(d) for d in self._datasets], self._info.num_local_replicas)

    @property
    def element_spec(self) -> Any:
        """Per-replica spec of the built datasets (leading dimension as the dataset says)."""
        return self._per_replica(self._datasets[0].element_spec)
