"""The window's reduce plan: its blocks tile each owner's slice, cache-sized, summed in local-rank order."""

import numpy as np
import pytest

from mpistrat.comm.transport.shm.plan import PAIR_BLOCKS, make_plan, sums_aside

STEP = 1 << 10  # items


def _plan(local: int, local_rank: int, count: int, one_node: bool = True):
    views = [np.arange(count, dtype=np.float32) + 1000 * r for r in range(local)]
    bounds = [count * i // local for i in range(local + 1)]
    tmp = np.zeros(STEP, np.float32) if sums_aside(local, local_rank, local) else None
    return views, bounds, make_plan(views, bounds, local_rank, local, one_node, STEP, tmp)


@pytest.mark.parametrize("local", [2, 3, 4, 8])
@pytest.mark.parametrize("count", [100, 5 * STEP + 17, 40 * STEP + 3])
def test_blocks_tile_the_slice_in_cache_sized_pieces(local, count):
    longest = PAIR_BLOCKS * STEP if local == 2 else STEP
    for lr in range(local):
        views, bounds, plan = _plan(local, lr, count)
        lo, hi = bounds[lr], bounds[lr + 1]
        starts = [b[4] for b in plan.blocks]
        ends = [b[5] for b in plan.blocks]
        assert starts == [lo] + ends[:-1] and ends[-1] == hi, lr  # in order, no gap, no overlap
        assert max(e - s for s, e in zip(starts, ends)) <= longest, lr
        assert len(plan.blocks) == -(-(hi - lo) // longest), lr  # no shorter blocks than needed
        for srcs, dst, back, targets, s, e in plan.blocks:
            # every segment's block, in local-rank order: the same bits on every path
            assert [src[0] for src in srcs] == [views[r][s] for r in range(local)]
            assert [src[-1] for src in srcs] == [views[r][e - 1] for r in range(local)]
            assert all(x.size == e - s for x in srcs + targets + (dst,))
            written = back if back is not None else dst
            assert np.shares_memory(written, views[lr]) and written.size == e - s
            # pushed into every other segment's same items, while the block is in cache
            assert len(targets) == local - 1
            assert sorted(t[0] for t in targets) == sorted(views[r][s] for r in range(local) if r != lr)


def test_two_ranks_push_a_long_slice_block_by_block():
    # A slice 32 blocks long: summed whole, then pushed, it would be read back from memory beyond the cache.
    count = 2 * 32 * PAIR_BLOCKS * STEP
    _, bounds, plan = _plan(2, 0, count)
    assert len(plan.blocks) == (bounds[1] - bounds[0]) // (PAIR_BLOCKS * STEP)
    assert all(b[1].size == PAIR_BLOCKS * STEP == b[3][0].size for b in plan.blocks)


def test_across_nodes_the_slice_is_summed_in_blocks_then_reduced_whole():
    views, bounds, plan = _plan(2, 1, 40 * STEP, one_node=False)
    assert all(b[3] == () for b in plan.blocks)  # nothing pushed before the nodes have reduced
    assert plan.cross.size == bounds[2] - bounds[1] and np.shares_memory(plan.cross, views[1])
    assert len(plan.cross_targets) == 1 and np.shares_memory(plan.cross_targets[0], views[0])
