"""tf.data's deterministic interleave order, shared by ``Dataset.interleave`` and ``num_parallel_reads``."""

from __future__ import annotations

from typing import Any, Callable, Iterator

__all__ = ["interleave"]


def interleave(inputs: Iterator[Any], open_fn: Callable[[Any], Iterator[Any]], cycle_length: int,
               block_length: int) -> Iterator[Any]:
    """Elements of ``open_fn(x)`` for each input ``x``, ``cycle_length`` open at a time, ``block_length`` each.

    As TensorFlow's InterleaveDataset: a slot is (re)opened lazily when the cycle
    reaches it; the cycle moves on after ``block_length`` elements or when the
    slot's iterator ends (an ended slot is refilled the next time round).
    """
    slots: list = [None] * cycle_length
    index = 0
    open_count = 0
    end_of_input = False
    while not end_of_input or open_count > 0:
        it = slots[index]
        if it is not None:
            produced = 0
            while produced < block_length:
                try:
                    element = next(it)
                except StopIteration:
                    slots[index] = None
                    open_count -= 1
                    break
                produced += 1
                yield element
        elif not end_of_input:
            try:
                element = next(inputs)
            except StopIteration:
                end_of_input = True
                continue
            slots[index] = open_fn(element)
            open_count += 1
            continue
        index = (index + 1) % cycle_length
