"""What one window reduce-scatter touches, computed once per bucket, dtype and count."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PAIR_BLOCKS", "ReducePlan", "ScatterLayout", "make_plan", "one_sync_tail", "sums_aside"]

# A two-rank plan's block in ``step``s: the two segments' blocks a bare reduce touches then fill what the wider
# plan's eight do (a call with a private result or source touches a third).
PAIR_BLOCKS = 4


def sums_aside(local_size: int, local_rank: int, owners: int) -> bool:
    """Whether slice owner ``local_rank`` sums its slice aside (into a scratch block, copied back after): its own
    segment comes after the first two in the summing order, so a sum into it would overwrite it unread."""
    return local_size > 2 and 2 <= local_rank < owners


def one_sync_tail(count: int, itemsize: int, chunk_items: int, direct: int) -> bool:
    """Whether an array of ``count`` items in chunks of ``chunk_items`` (0, or ``count`` or more: one pass) ends in
    a chunk of at most ``direct`` bytes, which the window reduces with one synchronisation, every rank summing it
    into its own result (so such an array takes no shared result block)."""
    step = max(1, chunk_items if 0 < chunk_items < count else count)
    return (count - (-(-count // step) - 1) * step) * itemsize <= direct


class ReducePlan:
    """Precomputed views of one reduce: the result (this rank's segment), the reduction blocks
    ``(sources, destination, copy-back or None, push targets, start, end)``, the cross-node
    slice and where it is pushed once reduced across nodes.

    :class:`~mpistrat.comm.transport.shm.allreduce.ShmTransport` sums slice ``i``
    of a bucket on node rank ``i`` (an owner) and pushes the sum into every other
    node rank's segment (on one node block by block, across nodes after the
    cross-node reduction), so every rank reads the whole result from its own
    segment. A plan holds those views, so a call only loops over them.
    """

    __slots__ = ("result", "blocks", "cross", "cross_targets")

    def __init__(self, result: np.ndarray, blocks: list, cross: np.ndarray | None, cross_targets: tuple) -> None:
        self.result = result
        self.blocks = blocks
        self.cross = cross
        self.cross_targets = cross_targets


def make_plan(
    views: list[np.ndarray], bounds: list[int], local_rank: int, owners: int, one_node: bool, step: int,
    tmp: np.ndarray | None,
) -> ReducePlan:
    """The plan of node rank ``local_rank`` for a bucket whose segments are ``views`` (one per node
    rank), cut at ``bounds`` among the ``owners``, in cache-sized blocks: of ``step`` items when more
    than two ranks share the node (a block touches every segment's block, and ``tmp``'s), summed into
    ``tmp`` (then copied back) when given; of ``PAIR_BLOCKS * step`` on two ranks. On one node each
    block is pushed right after its sum, while in cache, not read back from memory."""
    lr, n = local_rank, len(views)
    count = bounds[-1]
    blocks: list[tuple] = []
    cross = None
    cross_targets: tuple = ()
    others = [v for r, v in enumerate(views) if r != lr]  # every other node rank, owner or not

    def push(s: int, e: int) -> tuple:
        return tuple(v[s:e] for v in others) if one_node else ()

    if lr < owners and bounds[lr + 1] > bounds[lr]:
        lo, hi = bounds[lr], bounds[lr + 1]
        own = views[lr]
        if n >= 2:  # summed in local-rank order
            width = max(1, step) * (PAIR_BLOCKS if n == 2 else 1)
            for s in range(lo, hi, width):
                e = min(s + width, hi)
                srcs = tuple(v[s:e] for v in views)
                if tmp is None:
                    blocks.append((srcs, own[s:e], None, push(s, e), s, e))
                else:
                    blocks.append((srcs, tmp[: e - s], own[s:e], push(s, e), s, e))
        if not one_node:
            cross = own[lo:hi]
            cross_targets = tuple(v[lo:hi] for v in others)
    return ReducePlan(views[lr][:count], blocks, cross, cross_targets)


class ScatterLayout:
    """What the compiled reduce-scatter (``_lane.scatter``) of one array size reads: every rank's window
    segment per bucket, this rank's local rank, the chunks, the node's result blocks, every rank's offer
    word and this rank's decision word (``shared``'s; empty and 0 without), the node synchronisation's epoch
    counters (``sync``)."""

    __slots__ = ("segments", "me", "itemsize", "chunk", "chunk_items", "direct", "tail_one_sync", "epochs", "shared",
                 "controls", "blocks", "decision", "sync", "counters", "words")

    def __init__(self, segments: tuple[bytes, bytes], me: int, count: int, itemsize: int, chunk_items: int,
                 direct: int, shared: Any, sync: Any) -> None:
        self.segments = segments
        self.me = me
        self.itemsize = itemsize
        self.chunk_items = chunk_items if 0 < chunk_items < count else count
        self.chunk = self.chunk_items * itemsize if self.chunk_items < count else 0  # bytes; 0: one pass
        self.direct = direct
        chunks = -(-count // self.chunk_items)
        # A short last chunk takes the window's one-synchronisation reduce, which flips its bucket.
        self.tail_one_sync = one_sync_tail(count, itemsize, self.chunk_items, direct)
        # The node synchronisations besides the check's: two per chunk, one fewer for the first and a short last.
        self.epochs = 2 * chunks - 1 - self.tail_one_sync
        self.shared = shared
        self.controls, self.blocks, self.decision = shared.addresses() if shared is not None else (b"", b"", 0)
        self.sync = sync
        self.counters, self.words = sync.layout()
