"""What a strategy hands its input pipeline: options, the ``dataset_fn`` context, this rank's place.

``InputOptions`` and ``InputReplicationMode`` as ``tf.distribute``; ``InputContext``
is what ``distribute_datasets_from_function`` passes to ``dataset_fn``;
``InputWorkerInfo`` is what a strategy tells ``mpistrat.data.distribute`` about
this rank's place (see docs/internals.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

if TYPE_CHECKING:  # pragma: no cover
    from mpistrat.comm import RankCommunicator

__all__ = ["InputReplicationMode", "InputOptions", "InputContext", "InputWorkerInfo"]


class InputReplicationMode(enum.Enum):
    """How ``dataset_fn`` is replicated: once per worker (rank) or once per replica."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class _InputOptionsFields(NamedTuple):
    experimental_fetch_to_device: bool
    experimental_replication_mode: InputReplicationMode
    experimental_place_dataset_on_device: bool
    experimental_per_replica_buffer_size: int


class InputOptions(_InputOptionsFields):
    """Options for distributed input, as ``tf.distribute.InputOptions``.

    experimental_fetch_to_device: copy each replica's batch to its device (default True; None given to
      the constructor means True, a None stored by ``_replace`` reads as False, both as TF); with a
      positive buffer size a background thread per rank does it ahead of time.
      On CPU devices the batch already is where the replica reads it: placement copies nothing.
    experimental_replication_mode: PER_WORKER (default) or PER_REPLICA (datasets from function).
    experimental_place_dataset_on_device: build the dataset on the device (PER_REPLICA only).
    experimental_per_replica_buffer_size: batches prefetched per replica (default 1; 0 disables). On GPUs
      it bounds the batches held in device memory; on CPU devices with several workers the queue
      deepens from it up to 64 steps (32 MiB) so the ranks agree on steps less often.
    """

    __slots__ = ()

    def __new__(cls, experimental_fetch_to_device: Optional[bool] = None,
                experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
                experimental_place_dataset_on_device: bool = False,
                experimental_per_replica_buffer_size: int = 1) -> "InputOptions":
        if experimental_fetch_to_device is None:
            experimental_fetch_to_device = True
        return super().__new__(cls, experimental_fetch_to_device, experimental_replication_mode,
                               experimental_place_dataset_on_device, experimental_per_replica_buffer_size)


class InputContext:
    """What ``dataset_fn`` learns about its input pipeline, as ``tf.distribute.InputContext``."""

    __slots__ = ["_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync"]

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync (all ranks)."""
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """This input pipeline's id (the rank for PER_WORKER, the global replica id for PER_REPLICA)."""
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines."""
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; raises ValueError if it does not divide."""
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                "The `global_batch_size` %r is not divisible by `num_replicas_in_sync` %r "
                % (global_batch_size, self._num_replicas_in_sync)
            )
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self) -> str:
        return "mpistrat.InputContext(input pipeline id {}, total: {})".format(
            self.input_pipeline_id, self.num_input_pipelines
        )


@dataclass(frozen=True)
class InputWorkerInfo:
    """This rank's place, as a strategy tells the input pipeline."""

    num_workers: int  # MPI ranks in the strategy (1 for OneDevice/Mirrored)
    worker_index: int  # this rank
    local_devices: "tuple[str, ...]"  # canonical devices of this rank's replicas
    num_replicas_in_sync: int  # num_workers * len(local_devices)
    first_replica_id: int  # global id of local replica 0
    communicator: "Optional[RankCommunicator]"  # None when num_workers == 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_devices", tuple(self.local_devices))
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"InputWorkerInfo: worker_index {self.worker_index} out of range for {self.num_workers} workers")
        if not self.local_devices:
            raise ValueError("InputWorkerInfo: at least one local device is needed")
        if self.num_replicas_in_sync != self.num_workers * len(self.local_devices):
            raise ValueError(
                f"InputWorkerInfo: num_replicas_in_sync {self.num_replicas_in_sync} != num_workers {self.num_workers} "
                f"* local devices {len(self.local_devices)}"
            )
        if self.num_workers > 1 and self.communicator is None:
            raise ValueError(f"InputWorkerInfo: {self.num_workers} workers need a communicator")

    @property
    def num_local_replicas(self) -> int:
        """Replicas on this rank."""
        return len(self.local_devices)

    @staticmethod
    def single(local_devices: Any = ("/cpu:0",)) -> "InputWorkerInfo":
        """One worker (no MPI) with the given local devices."""
        devices = tuple(local_devices)
        return InputWorkerInfo(1, 0, devices, len(devices), 0, None)
