"""Splitting batches across replicas, step by step (pieces cut like ``numpy.array_split``).

DATA sharding cuts every global batch over all W*R replicas
(:func:`global_steps`); FILE and OFF cut each worker's own batches as TF's
``batch_sizes_for_worker`` does (:func:`local_steps`).
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data.element import element_length, slice_element
from mpistrat.data.spec import TensorSpec

__all__ = ["split_sizes", "rotated_sizes", "global_steps", "local_steps", "function_steps", "template_of", "empty_like_template"]


def split_sizes(n: int, parts: int) -> list:
    """The sizes ``numpy.array_split(range(n), parts)`` gives: earlier parts larger by one."""
    q, r = divmod(int(n), int(parts))
    return [q + 1] * r + [q] * (parts - r)


def rotated_sizes(n: int, num_workers: int, num_local: int, worker_index: int) -> list:
    """Piece sizes for worker ``worker_index``'s batch of ``n`` rows (TF's batch_sizes_for_worker)."""
    base = split_sizes(n, num_workers * num_local)
    offset = worker_index * num_local
    return base[offset:] + base[:offset]


def _cuts(batch: Any, sizes: list) -> list:
    out, start = [], 0
    for s in sizes:
        out.append(slice_element(batch, start, start + s))
        start += s
    return out


def global_steps(batches: Iterator[Any], num_replicas: int, first_replica: int, num_local: int) -> Iterator[List[Any]]:
    """DATA: per step, this rank's pieces of the global batch (array_split, piece g to replica g).

    Every worker reads every global batch; batch t of B rows is cut like
    ``numpy.array_split`` into N = W*R pieces (earlier pieces larger) and
    global replica g gets piece g at step t.
    """
    for batch in batches:
        sizes = split_sizes(element_length(batch), num_replicas)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        yield [
            slice_element(batch, offsets[g], offsets[g + 1]) for g in range(first_replica, first_replica + num_local)
        ]


def local_steps(batches: Iterator[Any], num_workers: int, num_local: int, worker_index: int) -> Iterator[List[Any]]:
    """FILE/OFF: each local batch cut into W*R rotated pieces, R pieces per step over W steps.

    As TF's ``batch_sizes_for_worker``: worker w reads its own batches of B
    rows; each is cut into N = W*R pieces whose sizes are the array_split
    sizes rotated by w*R, and consumed R pieces per step, so one of the
    worker's batches feeds W consecutive steps and every step consumes B rows
    over all replicas while the data lasts. (TF cuts a short last batch with
    the full-batch sizes, filling early pieces first; here a short batch is
    cut with its own array_split sizes, so replicas stay within one row of
    each other.)

    Steps with no rows at all after the worker's last batch are dropped; to know a
    batch is the last one, the next batch is read early only when such steps exist.
    With one replica in all, every element is one step, whole: batched or not (as TF).
    """
    if num_workers * num_local == 1:
        for element in batches:
            yield [element]
        return
    it = iter(batches)
    end = object()
    batch = next(it, end)
    while batch is not end:
        pieces = _cuts(batch, rotated_sizes(element_length(batch), num_workers, num_local, worker_index))
        steps = [pieces[s * num_local:(s + 1) * num_local] for s in range(num_workers)]
        if not all(element_length(p) == 0 for p in steps[-1]):
            yield from steps
            batch = next(it, end)
            continue
        try:
            following = next(it, end)
        except Exception:
            yield from steps  # hand out what was read, then report the error at its own step
            raise
        if following is end:
            while steps and all(element_length(p) == 0 for p in steps[-1]):
                steps.pop()
        yield from steps
        batch = following


def function_steps(iterators: list, num_local: int) -> Iterator[List[Optional[Any]]]:
    """Datasets from a function: one iterator feeding R replicas (PER_WORKER) or one per replica.

    ``None`` marks a replica whose dataset has ended; stops when no replica got a batch.
    """
    end = object()
    done = [False] * len(iterators)
    while True:
        values: list = []
        for r in range(num_local):
            k = 0 if len(iterators) == 1 else r
            value = end if done[k] else next(iterators[k], end)
            if value is end:
                done[k] = True
                values.append(None)
            else:
                values.append(value)
        if all(v is None for v in values):
            return
        yield values


def template_of(value: Any) -> Any:
    """The nest of TensorSpecs of one replica's batch, batch dimension dropped (for empty batches)."""

    def spec(x: Any) -> TensorSpec:
        # Arrays (NumPy, CuPy: which refuses an implicit NumPy conversion) carry their shape and dtype.
        shape = tuple(int(d) for d in np.shape(x))
        dtype = np.dtype(x.dtype if isinstance(getattr(x, "dtype", None), np.dtype) else np.asarray(x).dtype)
        return TensorSpec(shape[1:], dtype)

    return nest.map_structure(spec, value)


def empty_like_template(template: Any) -> Any:
    """A batch with no rows (leading dimension 0) of the template's structure, shapes and dtypes."""
    return nest.map_structure(
        lambda s: np.zeros((0,) + tuple(0 if d is None else d for d in s.shape), dtype=s.dtype), template
    )
