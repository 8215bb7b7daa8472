"""A small data-parallel training run that injects one fault (run by tests/test_fault_injection.py).

``mpiexec -n N python tests/fault_program.py CASE``: every rank trains an
MLP under ``MultiWorkerMirroredStrategy`` for ``STEPS`` steps (one fused
all-reduce of the gradients and the example count per step, mirrored variables
updated by SGD); the last rank injects the fault ``CASE`` at step
``FAULT_STEP``, while the other ranks are inside (or about to enter) that step's
all-reduce:

``raise``       the replica function raises in the middle of ``strategy.run``;
``sigkill``     the process kills itself with SIGKILL;
``exit``        the rank leaves its loop early and ends its program cleanly (uneven steps);
``shapes``      its gradient has another shape than the other ranks';
``short-data``  its own list of batches is shorter: its loop ends and it goes on to
                the end-of-training metrics reduction while the others still train;
``nan``         its gradient holds a NaN (run with ``MPISTRAT_CHECK_NUMERICS=1``);
``hang``        the rank hangs (sleeps for an hour) before the all-reduce (run with the stall
                inspector's ``MPISTRAT_STALL_SHUTDOWN_SECONDS``);
``none``        no fault (prints ``OK``).

Just before the fault the faulty rank prints ``FAULT <case> rank <r> at <unix time>``
(flushed), so the test can measure the time from the fault to the end of the job.
"""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpistrat as ms
from mpistrat.examples.mlp import MLP
from mpistrat.optimizers import SGD

STEPS = 6
FAULT_STEP = 3
BATCH = 16
FEATURES, CLASSES = 8, 4


def fault_now(case: str, rank: int) -> None:
    """Announce the fault with its wall-clock time (the test's zero)."""
    sys.stdout.write(f"FAULT {case} rank {rank} at {time.time():.6f}\n")  # one write: one line
    sys.stdout.flush()


def main() -> int:
    case = sys.argv[1]
    strategy = ms.MultiWorkerMirroredStrategy()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    faulty = rank == size - 1
    with strategy.scope():
        model = MLP([FEATURES, 16, CLASSES], seed=0)
        optimizer = SGD(0.1)
        optimizer.build(model.trainable_variables)
        examples = ms.Variable(np.float64(0.0), synchronization=ms.VariableSynchronization.ON_READ,
                               aggregation=ms.VariableAggregation.SUM)
    rng = np.random.default_rng(rank)
    steps = FAULT_STEP if faulty and case == "short-data" else STEPS
    batches = [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, BATCH))
               for _ in range(steps)]

    def train_step(step: int, x: np.ndarray, y: np.ndarray) -> None:
        _, _, grads = model.loss_and_gradients(x, y)
        if faulty and step == FAULT_STEP:
            if case in ("raise", "sigkill"):
                time.sleep(0.3)  # the others are inside this step's all-reduce by now
                fault_now(case, rank)
                if case == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault in step {step} on rank {rank}")
            if case == "shapes":
                fault_now(case, rank)
                grads[0] = grads[0][:, :-1]
            if case == "nan":
                fault_now(case, rank)
                grads[0][0, 0] = np.nan
            if case == "hang":
                fault_now(case, rank)
                time.sleep(3600)
        total = ms.get_replica_context().all_reduce(
            ms.ReduceOp.SUM, {"grads": grads, "count": np.array([x.shape[0]], np.float32)})
        scale = 1.0 / total["count"][0]
        optimizer.apply_gradients([(g * scale, v) for g, v in zip(total["grads"], model.trainable_variables)],
                                  experimental_aggregate_gradients=False)
        examples.assign_add(x.shape[0])

    for step, (x, y) in enumerate(batches):
        if faulty and case == "exit" and step == FAULT_STEP:
            fault_now(case, rank)
            return 0  # a clean, early end: the others wait for this rank in step FAULT_STEP
        strategy.run(train_step, args=(step, x, y))
    if faulty and case == "short-data":
        fault_now(case, rank)  # its data ran out: on to the end-of-training metrics
    with strategy.scope():
        seen = float(examples.numpy())  # a cross-rank reduction of the sync-on-read variable
    checksum = strategy.reduce("sum", strategy.run(lambda: model.trainable_variables[0].value().sum()), axis=None)
    sys.stdout.write(f"OK rank {rank} examples {seen:.0f} checksum {float(checksum):.6f}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
