"""Distributed datasets: each step, this rank's per-replica part of the input, in step with every rank.

``DistributedDataset`` and ``DistributedDatasetsFromFunction`` are what the
strategies return from ``experimental_distribute_dataset`` and
``distribute_datasets_from_function``; each step yields the element as it is
with one local replica, else the element's structure with one ``PerReplica``
per leaf (local replica order), as tf.distribute does. Sharding is
:mod:`.autoshard`'s, batch splitting :mod:`.splitting`'s, the background
thread :mod:`.prefetch`'s; this module holds the ranks' agreement on steps
(:class:`DistributedIterator`) and the placement on devices.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, List, Optional as _Opt

import numpy as np

from mpistrat import nest, timeline
from mpistrat.devices import device_index, is_gpu, to_device
from mpistrat.distribute import context
from mpistrat.distribute.input_options import InputContext, InputOptions, InputReplicationMode, InputWorkerInfo
from mpistrat.distribute.regroup import regroup
from mpistrat.distribute.values import PerReplica
from mpistrat.data.autoshard import DATA, needs_seeds, resolve_policy, with_seeds
from mpistrat.data.dataset import Dataset
from mpistrat.data.errors import InputPipelineError, OutOfRangeError, rank_label
from mpistrat.data.iterator_state import SaveableIterator, check_saveable, random_state, set_random_state
from mpistrat.data.optional import Optional
from mpistrat.data.prefetch import BackgroundProducer, ByteBudget
from mpistrat.data.spec import TensorSpec, per_replica_spec
from mpistrat.data.splitting import empty_like_template, function_steps, global_steps, local_steps, template_of

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator", "Optional"]

EXHAUSTED, EXHAUSTED_NO_TEMPLATE, FAILED = 0, -1, -2  # a positive code: steps held in memory
AGREEMENT_WINDOW = 64  # most steps agreed at once
AGREEMENT_BYTES = 32 << 20  # most host bytes read ahead for one agreement (at least one step)
AGREEMENT_PATIENCE = 0.02  # seconds an agreement waits for more steps than the one it has
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


def _require_outside_replica_fn() -> None:
    """Raise inside a replica function: each replica would take a step of its own (TF's get_next rule)."""
    frame = context.current_frame()
    if frame.replica_context is not None and frame.strategy is not context.default_strategy():
        raise ValueError("next(iterator) should be called from outside of replica_fn. e.g. "
                         "strategy.run(replica_fn, args=(next(iterator),))")


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


def _nbytes(values: List[Any]) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for v in values if v is not None for x in nest.flatten(v))


class _Placer:
    """Copies each replica's values to its device (in the producer thread when prefetching)."""

    def __init__(self, devices: tuple, fetch_to_device: bool):
        self.devices = devices
        self.fetch = fetch_to_device
        self.gpu = {d: is_gpu(d) for d in devices}
        self.streams: dict = {}
        # The CUDA events around the latest copies to GPUs, (device, start, end) each: when a copy ran on
        # the GPU, next to the step's kernels (cupy.cuda.get_elapsed_time between any two of a device).
        self.copy_events: collections.deque = collections.deque(maxlen=64)

    def _leaf(self, x: Any, device: str) -> Any:
        if isinstance(x, np.ndarray):
            if not self.gpu[device] or x.dtype.hasobject:
                return x  # already on the host, where CPU devices keep their arrays (and objects stay)
            return to_device(x, device)
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
            elif self.gpu[device]:
                out.append(self._to_gpu(value, device))
            elif not nest.is_nested(value):
                out.append(self._leaf(value, device))
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
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            with stream:
                start.record(stream)
                placed = nest.map_structure(lambda x: self._leaf(x, device), value)
                end.record(stream)
            stream.synchronize()
        self.copy_events.append((k, start, end))
        return placed


class DistributedIterator(SaveableIterator):
    """One pass over a distributed dataset: ``next``, ``get_next``, ``get_next_as_optional``.

    Each step is the element as it is with one local replica, else the
    element's structure with one ``PerReplica`` per leaf. All three must be
    called outside a replica function (in it they raise ValueError and take
    nothing).

    The ranks agree (``communicator.step_agreement``) on a code per rank: n > 0
    steps this rank holds in memory, 0 exhausted, -1 exhausted without ever
    having seen a batch (it then receives the structure of an empty batch), -2
    failed; all ranks then run the smallest positive n steps before agreeing
    again. Iteration ends on every rank at the first step where no rank has
    data; a replica without data meanwhile gets an empty batch (leading
    dimension 0, same trailing shape and dtype). A failure on any rank raises
    :class:`InputPipelineError` on every rank, naming the failing rank(s) and
    their messages. With ``experimental_fetch_to_device`` and a positive
    ``experimental_per_replica_buffer_size``, a background thread prepares the
    next steps and copies each replica's part to its device (CuPy: on a
    non-blocking stream per device, synchronised before hand-over) into a
    bounded queue.

    Agreement is amortised without changing its meaning: at an agreement point each
    rank reports how many steps it already holds in memory, and all ranks then run
    the smallest positive count of steps without talking. Without the prefetch
    thread a rank reads up to ``AGREEMENT_WINDOW`` steps (and ``AGREEMENT_BYTES``)
    ahead on the host and copies each to its devices when handing it out. With it,
    the count is of the steps waiting in the thread's queue, already placed. On
    GPUs that queue holds at most ``experimental_per_replica_buffer_size`` steps
    (device memory), so agreement is amortised over at most that many steps:
    raise the buffer size, or use 0 (no thread), for input-bound multi-rank GPU
    pipelines. On CPU devices with several workers the queue starts at the buffer
    size and doubles whenever an agreement finds it full, up to
    ``AGREEMENT_WINDOW`` steps, and the thread stops reading ahead while
    ``AGREEMENT_BYTES`` wait in the queue (it may always hold the buffer's
    steps), so the agreements thin out without a larger buffer. A
    single worker has nothing to agree on and reads no further ahead than the
    buffer. A rank never promises a step it has not read,
    so iteration ends, and a read error is raised on every rank, at exactly the
    step where it would be with one agreement per step.

    ``Checkpoint(iterator=it)`` saves the position: the steps handed out and
    each rank's (seed, epoch) of every shuffle at the start of the pass.
    Restoring into a fresh iterator over the same pipeline re-seeds it and
    fast-forwards (re-reading the steps it skips), so the next steps are
    bitwise those the saved run would have seen next.
    """

    def __init__(self, make_steps: Callable[[], Iterator[List[Any]]], info: InputWorkerInfo, options: InputOptions,
                 element_spec: Callable[[], Any], nodes: _Opt[List[Any]] = None):
        self._args = (make_steps, info, options, element_spec, nodes)
        self._nodes = nodes
        self._random = random_state(nodes) if nodes is not None else []  # before the pass draws its epoch
        self._steps = 0
        self._info = info
        self._comm = info.communicator if info.num_workers > 1 else None
        self._spec_fn = element_spec
        self._template: Any = None
        self._finished = False
        self._error: _Opt[InputPipelineError] = None
        self._local_done = False
        self._pending_error: _Opt[BaseException] = None
        self._ready: collections.deque = collections.deque()
        self._committed = 0
        self._held = 0
        # experimental_place_dataset_on_device (PER_REPLICA, no fetch): each replica's values go to its
        # device as they are handed out, without a prefetch thread.
        fetch = bool(options.experimental_fetch_to_device)  # a None set by _replace: no fetch, as TF
        placer = _Placer(info.local_devices, fetch or options.experimental_place_dataset_on_device)
        self._placer = placer
        buffer = options.experimental_per_replica_buffer_size
        self._producer: _Opt[BackgroundProducer] = None
        self._window = AGREEMENT_WINDOW if self._comm is not None else 1
        self._target = 1  # steps to wait for (briefly) before the next agreement; doubles up to the depth
        self._depth_cap = buffer  # the most steps the prefetch thread may hold (its queue grows up to it)
        budget = None
        if fetch and buffer > 0:
            # The thread runs at most its queue's depth ahead and then blocks. It starts at `buffer`: a thread
            # that is always busy (a deep queue filling) holds the GIL whenever this thread wakes from the
            # user's compute, which costs up to the interpreter's switch interval per step. With
            # several workers on CPU devices the depth doubles whenever an agreement finds the queue full, up
            # to AGREEMENT_WINDOW steps, and the thread holds at most AGREEMENT_BYTES in all, or `buffer`
            # steps if those are more (a byte budget counted step by step), so that agreement is amortised as with host
            # read-ahead. On GPUs it stays at `buffer`: device memory holds at most buffer + 1 steps ahead.
            if self._comm is not None and not any(placer.gpu.values()):
                self._depth_cap = max(buffer, AGREEMENT_WINDOW)
                budget = ByteBudget(AGREEMENT_BYTES, buffer, _nbytes)
            self._window = buffer

            def produce() -> Iterator[List[Any]]:
                return (placer(values) for values in make_steps())

            self._producer = BackgroundProducer(produce, buffer, name=f"mpistrat-input-{rank_label().replace(' ', '')}",
                                                budget=budget)
            self._source: Iterator = self._producer
        else:
            self._source = make_steps()  # placed on hand-out, so read-ahead stays on the host

    # -- the agreement protocol ---------------------------------------------------------
    def _pull(self) -> bool:
        """Move one step from the source into ``_ready`` (waiting for it); False at the end or an error."""
        if self._local_done:
            return False
        try:
            values = next(self._source)
        except StopIteration:
            self._local_done = True
            return False
        except Exception as exc:  # a read error: reported when the steps before it are used
            self._local_done = True
            self._pending_error = exc
            return False
        if self._template is None:
            for v in values:
                if v is not None:
                    self._template = template_of(v)
                    break
        self._ready.append(values)
        return True

    def _fill(self) -> int:
        """Count the steps this rank holds (reading ahead if needed); return the local code."""
        if self._producer is not None:
            held = 0 if self._local_done else self._wait_and_deepen()
            if held == 0:
                self._pull()  # the end or the failure: records it
                held = len(self._ready)
            elif self._template is None:
                first = self._producer.peek()
                self._template = next((template_of(v) for v in first if v is not None), None)
        else:
            if not self._ready:
                self._pull()
            if self._window > 1:
                nbytes = sum(_nbytes(v) for v in self._ready)
                while len(self._ready) < self._window and nbytes < AGREEMENT_BYTES and self._pull():
                    nbytes += _nbytes(self._ready[-1])
            held = len(self._ready)
        self._held = held
        if held:
            return min(held, self._window)
        if self._pending_error is not None:
            return FAILED
        return EXHAUSTED if self._template is not None else EXHAUSTED_NO_TEMPLATE

    def _wait_and_deepen(self) -> int:
        """The steps ready in the prefetch queue, after a short wait for more.

        With peers to agree with, wait (at most ``AGREEMENT_PATIENCE`` beyond the
        first step) for ``_target`` steps, which doubles at each agreement up to
        the queue's depth: agreements thin out geometrically without stalling the
        first steps, and a slow reader makes its peers wait about one step's
        read, not many. A full queue means the thread keeps up: it may then run
        twice as far ahead, up to the cap.
        """
        producer = self._producer
        if self._comm is None:
            return producer.wait_ready(1)
        held = producer.wait_ready(self._target, patience=AGREEMENT_PATIENCE)
        if held >= producer.depth and producer.depth < self._depth_cap:
            producer.grow(min(2 * producer.depth, self._depth_cap) - producer.depth)
            self._window = producer.depth
        self._target = min(2 * self._target, producer.depth)
        return held

    def _agree(self) -> None:
        code = self._fill()
        # Plain ints: this runs once per agreement, up to once per step, where NumPy on tiny arrays costs.
        codes = [code] if self._comm is None else self._comm.step_agreement(code).tolist()
        if FAILED in codes:
            self._fail(codes, self._pending_error if code == FAILED else None)
        held = [c for c in codes if c > 0]
        if not held:
            self._finish()
            raise StopIteration
        if EXHAUSTED_NO_TEMPLATE in codes:
            templates = self._comm.allgather_object(self._template)
            if self._template is None:
                self._template = next((t for t in templates if t is not None), None)
                if self._template is None:  # pragma: no cover - a rank with data always has one
                    raise InputPipelineError("No rank could describe an empty batch (no rank has seen a batch)")
        self._committed = min(held)

    def _fail(self, codes: List[int], exc: _Opt[BaseException]) -> None:
        if self._comm is None:
            messages = [_failure_message(exc)]
        else:
            messages = self._comm.allgather_object(None if exc is None else _failure_message(exc))
        failed = [r for r, c in enumerate(codes) if c == FAILED] if self._comm is not None else [
            self._info.worker_index]
        self._error = InputPipelineError(
            f"Input pipeline failed on rank(s) {failed}: " + "; ".join(m for m in messages if m is not None)
        )
        self._finish()
        raise self._error from exc

    def __next__(self) -> Any:
        _require_outside_replica_fn()
        # The timeline records the time the replicas waited for their next batch (reading, agreement,
        # placement) around the same call; off, it costs the one check.
        traced = timeline.enabled()
        if traced:
            start = timeline.now_us()
        try:
            return self._next()
        finally:
            if traced:
                timeline.record("next", "input", start, timeline.now_us() - start,
                                replicas=self._info.num_local_replicas)

    def _next(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._finished:
            raise StopIteration
        if self._committed == 0:
            self._agree()
        self._committed -= 1
        self._steps += 1
        if self._held > 0:
            self._held -= 1
            if self._ready:
                values = self._ready.popleft()
            else:
                values = next(self._producer)  # counted as ready at the agreement: no wait
            if self._producer is None:
                values = self._placer(values)
            elif self._template is None:
                self._template = next((template_of(v) for v in values if v is not None), None)
        else:  # this rank has run out; others still have data this step
            values = [None] * self._info.num_local_replicas
        return self._assemble(values)

    def _assemble(self, values: List[Any]) -> Any:
        """One step's value: the element with one local replica, else its structure of PerReplica leaves."""
        if len(values) == 1 and values[0] is not None:
            return values[0]
        if any(v is None for v in values):
            if self._template is None:  # single worker, some replicas never got data
                self._template = next(template_of(v) for v in values if v is not None)
            empty = self._placer([empty_like_template(self._template)] * len(values))
            values = [v if v is not None else empty[i] for i, v in enumerate(values)]
        if len(values) == 1:
            return values[0]
        return regroup(values, PerReplica, always_wrap=True, what="got input elements")

    # -- public API ---------------------------------------------------------------------
    def __iter__(self) -> "DistributedIterator":
        return self

    def get_next(self) -> Any:
        """The next step's values; raises OutOfRangeError at the end."""
        try:
            return self.__next__()
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> Optional:
        """The next step's values as an Optional, empty at the end (on every rank together)."""
        try:
            return Optional(self.__next__())  # already distributed values: nothing to convert
        except StopIteration:
            return Optional._empty_with_spec_from(lambda: self.element_spec)

    @property
    def element_spec(self) -> Any:
        """The spec of what one step yields (the dataset's ``element_spec``)."""
        return self._spec_fn()

    # -- checkpointing (SaveableIterator) ----------------------------------------------------
    def _state(self) -> Any:
        """``{"steps": n, "random": [per rank: [[seed, epoch], ...]]}`` (collective)."""
        if self._nodes is None:
            raise ValueError("Cannot save this iterator: it was not made by iterating a distributed dataset")
        check_saveable(self._nodes)
        random = [self._random] if self._comm is None else self._comm.allgather_object(self._random)
        return {"steps": self._steps, "random": random}

    def _restore(self, state: Any) -> None:
        """Re-seed the pipeline as saved and skip the saved number of steps (collective; a fresh iterator)."""
        if self._nodes is None:
            raise ValueError("Cannot restore this iterator: it was not made by iterating a distributed dataset")
        check_saveable(self._nodes)
        if self._steps:
            raise ValueError(f"Cannot restore an iterator that has already yielded {self._steps} step(s): "
                             "restore into a fresh iter(dist_dataset)")
        random = state["random"]
        if len(random) != self._info.num_workers:
            raise ValueError(f"Cannot restore the iterator: saved with {len(random)} worker(s), "
                             f"running with {self._info.num_workers}")
        self._finish()
        set_random_state(self._nodes, random[self._info.worker_index])
        self.__init__(*self._args)  # type: ignore[misc]  # a new pass from the restored seeds and epochs
        for _ in range(int(state["steps"])):
            try:
                self._next()
            except StopIteration:  # saved at the end of its pass: the restored iterator is at its end too
                break

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
        return DistributedIterator(self._make_steps, self._info, self._options, lambda: self.element_spec,
                                   self._pipeline())

    def _pipeline(self) -> List[Any]:
        """The root nodes this rank iterates (what an iterator's saved state describes)."""
        raise NotImplementedError

    def _make_steps(self) -> Iterator[List[Any]]:
        raise NotImplementedError

    def _per_replica(self, spec: Any) -> Any:
        """The spec of a step: ``spec`` with one local replica, else a PerReplicaSpec per leaf."""
        if self._info.num_local_replicas == 1:
            return spec
        return per_replica_spec(spec, self._info.num_local_replicas)

    def reduce(self, initial_state: Any, reduce_fn: Callable[[Any, Any], Any]) -> Any:
        """Fold ``reduce_fn(state, step)`` over every step (a step as the iterator yields it)."""
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


def _replica_piece_spec(spec: TensorSpec) -> TensorSpec:
    """The spec of one replica's piece of a batch of ``spec``: an unknown number of rows."""
    if not spec.shape:
        raise ValueError(
            "A distributed dataset's elements must be batches when there are several replicas in sync "
            f"(call .batch(global_batch_size) before distributing); got a component of spec {spec}"
        )
    return TensorSpec((None,) + tuple(spec.shape[1:]), spec.dtype)


class DistributedDataset(_DistributedBase):
    """A batched Dataset spread over the replicas of all ranks (``experimental_distribute_dataset``).

    With several replicas in sync the dataset must be batched by the global
    batch size; with one, its elements pass through whole, batched or not (as
    TF). The dataset's ``auto_shard_policy`` picks what this rank reads (FILE:
    its files; DATA and OFF: everything) and :mod:`.splitting` how each batch
    is cut over the replicas. Iterating again starts a new pass.
    """

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

    def _pipeline(self) -> List[Any]:
        return [self._dataset._node]

    def _make_steps(self) -> Iterator[List[Any]]:
        info = self._info
        if self._mode == DATA:
            return global_steps(iter(self._dataset), info.num_replicas_in_sync, info.first_replica_id,
                                info.num_local_replicas)
        return local_steps(iter(self._dataset), info.num_workers, info.num_local_replicas, info.worker_index)

    @property
    def element_spec(self) -> Any:
        """The dataset's spec with one replica in sync; else per replica, with an unknown number of rows."""
        spec = self._dataset.element_spec
        if self._info.num_replicas_in_sync == 1:
            return spec
        return self._per_replica(nest.map_structure(_replica_piece_spec, spec))


def _same_structure(steps: Iterator[List[Any]]) -> Iterator[List[Any]]:
    """Pass steps on; a step whose replicas' elements differ in structure is a read error (on every rank)."""
    for values in steps:
        signatures = [None if v is None else nest.structure_signature(v) for v in values]
        known = [s for s in signatures if s is not None]
        if any(s != known[0] for s in known):
            raise ValueError(
                "The datasets dataset_fn built for the replicas yield elements of different structures: "
                + ", ".join(f"local replica {r}: {s}" for r, s in enumerate(signatures) if s is not None)
            )
        yield values


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
            if per_replica and opts.experimental_fetch_to_device and opts.experimental_place_dataset_on_device:
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

    def _pipeline(self) -> List[Any]:
        return [d._node for d in self._datasets]

    def _make_steps(self) -> Iterator[List[Any]]:
        steps = function_steps([iter(d) for d in self._datasets], self._info.num_local_replicas)
        return _same_structure(steps) if len(self._datasets) > 1 else steps

    @property
    def element_spec(self) -> Any:
        """Per-replica spec of the built datasets (leading dimension as the dataset says)."""
        return self._per_replica(self._datasets[0].element_spec)
