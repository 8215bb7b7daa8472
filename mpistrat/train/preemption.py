"""``PreemptionCheckpointHandler``: a checkpoint at the next step boundary after a preemption signal on any rank."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mpistrat.train.checkpoint import Checkpoint, CheckpointManager

__all__ = ["EXIT_CODE", "PreemptionCheckpointHandler", "TerminationConfig"]

EXIT_CODE = 42  # TF's _RESTARTABLE_EXIT_CODE (its default exit_fn; GCE's is 143): a job script tells preemption by it
RUN_CALLS_KEY = "preemption_total_run_calls"  # in the checkpoint's metadata
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # Slurm: SIGTERM before the kill, --signal=USR1@T ahead


class TerminationConfig:
    """TensorFlow's ``TerminationConfig``: how a platform announces termination and how the program ends.

    ``termination_watcher_fn``: a cheap, non-blocking function that returns True once termination is
    announced (asked at every step; default: the signals). ``exit_fn``: called after the checkpoint
    (default ``sys.exit(42)``). ``grace_period``: accepted for TF's signature; mpistrat saves at the
    next step boundary. ``save_fn``: called instead of the default save (``CheckpointManager.save``).
    """

    def __init__(self, termination_watcher_fn: Callable[[], bool] | None = None,
                 exit_fn: Callable[[], Any] | None = None, grace_period: float | None = None,
                 save_fn: Callable[[], Any] | None = None) -> None:
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


class PreemptionCheckpointHandler:
    """Save a checkpoint and exit when any rank is told to stop (TF's ``PreemptionCheckpointHandler``).

    Created on every rank with the job's cluster resolver and a ``Checkpoint`` (with ``checkpoint_dir``)
    or a ``CheckpointManager``: it restores the newest checkpoint there at once, and ``total_run_calls``
    continues from the saved count. ``run(train_step, *args)`` runs one step; before each step the ranks
    agree (one small all-reduce) whether any of them received a termination signal (``signals``:
    SIGTERM and SIGUSR1 by default; the handlers only set a flag) or saw its ``termination_watcher_fn``
    return True. If one did, every rank saves the checkpoint (``total_run_calls`` in its metadata) and
    calls ``exit_fn`` (``sys.exit(42)``): a job script can requeue on that status. Collective: every
    rank calls ``run`` the same number of times.
    """

    def __init__(self, cluster_resolver: Any, checkpoint_or_checkpoint_manager: Any, checkpoint_dir: str | None = None,
                 termination_config: TerminationConfig | None = None,
                 signals: Sequence[int] = DEFAULT_SIGNALS) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        given = checkpoint_or_checkpoint_manager
        if isinstance(given, CheckpointManager):
            self._manager = given
        elif isinstance(given, Checkpoint):
            if checkpoint_dir is None:
                raise ValueError("PreemptionCheckpointHandler: checkpoint_dir is needed with a Checkpoint (or pass "
                                 "a CheckpointManager)")
            self._manager = CheckpointManager(given, checkpoint_dir, max_to_keep=1)
        else:
            raise TypeError(f"checkpoint_or_checkpoint_manager must be a Checkpoint or a CheckpointManager, got "
                            f"{type(given).__name__}")
        self._comm = (cluster_resolver.comm if cluster_resolver is not None else None) or MPI.COMM_WORLD
        self._max = MPI.MAX  # the per-step agreement's op (MPI loaded here, not on every step)
        self._config = termination_config or TerminationConfig()
        self._flag = np.zeros(1, np.int32)
        self._agreed = np.zeros(1, np.int32)
        self._received = False
        self._run_calls = 0
        latest = self._manager.latest_checkpoint
        if latest is not None:
            metadata = self._manager.checkpoint.restore(latest)
            self._run_calls = int(metadata.get(RUN_CALLS_KEY, 0))
        if self._config.termination_watcher_fn is None:
            self._install(signals)

    def _install(self, signals: Sequence[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionCheckpointHandler installs signal handlers: create it in the main thread")
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._received = True  # only a flag: the ranks act on it together at the next step boundary

    @property
    def total_run_calls(self) -> int:
        """The number of ``run`` calls so far, those of earlier (preempted) runs of the job included."""
        return self._run_calls

    def _any_rank_told(self) -> bool:
        watcher = self._config.termination_watcher_fn
        told = self._received or (watcher is not None and bool(watcher()))
        self._flag[0] = int(told)
        self._comm.Allreduce(self._flag, self._agreed, op=self._max)
        return bool(self._agreed[0])

    def save_checkpoint_if_preempted(self) -> None:
        """Where any rank was told to stop: save on every rank, then ``exit_fn`` (collective)."""
        if not self._any_rank_told():
            return
        if self._config.save_fn is not None:
            self._config.save_fn()
        else:
            self._manager.save(checkpoint_number=self._run_calls, metadata={RUN_CALLS_KEY: self._run_calls})
        if self._config.exit_fn is not None:
            self._config.exit_fn()
        else:
            sys.exit(EXIT_CODE)

    def run(self, distributed_train_function: Callable, *args: Any, **kwargs: Any) -> Any:
        """``distributed_train_function(*args, **kwargs)``, one training step, after checking for preemption."""
        self.save_checkpoint_if_preempted()
        result = distributed_train_function(*args, **kwargs)
        self._run_calls += 1
        return result

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """TF's scope around a training loop; preemption is handled in ``run`` here, so it adds nothing."""
        yield

