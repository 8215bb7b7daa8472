"""Fusion planning, packing and result pools (serial)."""

import numpy as np
import pytest

from mpistrat.comm.fusion import ResultPool, pack, plan_buckets


def test_plan_groups_by_dtype_and_respects_pack_bytes():
    entries = [((4,), "f4"), ((2, 2), "f8"), ((3,), "f4"), ((10,), "f4"), ((1,), "f8")]
    buckets = plan_buckets(entries, pack_bytes=40)
    f4 = [b for b in buckets if b.dtype == np.float32]
    f8 = [b for b in buckets if b.dtype == np.float64]
    assert [b.members for b in f4] == [(0, 2), (3,)]  # 7 floats fit in 40 bytes, then 10 alone
    assert [b.members for b in f8] == [(1, 4)]
    assert f4[0].offsets == (0, 4) and f4[0].count == 7
    assert all(b.nbytes <= 40 or len(b.members) == 1 for b in buckets)
    with pytest.raises(ValueError):
        plan_buckets(entries, 0)


def test_arrays_of_at_least_alone_bytes_get_buckets_of_their_own():
    entries = [((4,), "f4"), ((300,), "f4"), ((2,), "f4"), ((256,), "f4"), ((3,), "f8"), ((400,), "f8"), ((1,), "f4")]
    buckets = plan_buckets(entries, pack_bytes=1 << 20, alone_bytes=1024)  # 256 float32 = 1024 bytes: alone
    assert [b.members for b in buckets] == [(1,), (3,), (0, 2, 6), (5,), (4,)]
    assert plan_buckets(entries, 1 << 20, None)[0].members == (0, 1, 2, 3, 6)  # no limit: all packed


def test_pack_lays_out_every_array_in_order():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(3, 2), (5,), (), (2, 1, 2)]]
    arrays[0] = np.asfortranarray(arrays[0])
    (bucket,) = plan_buckets([(a.shape, a.dtype) for a in arrays], 1 << 20)
    flat = np.empty(bucket.count, np.float32)
    pack(arrays, bucket, flat)
    np.testing.assert_array_equal(flat, np.concatenate([a.ravel() for a in arrays]))
    for o, n, s, a in zip(bucket.offsets, bucket.sizes, bucket.shapes, arrays):  # the members' views
        np.testing.assert_array_equal(flat[o : o + n].reshape(s), a)


def test_result_pool_reuses_only_unreferenced_entries():
    (bucket,) = plan_buckets([((4,), "f4"), ((2,), "f4")], 1 << 20)
    pool = ResultPool(bucket, max_entries=2)
    views1 = pool.get()[1]
    first = id(views1[0].base)
    held = views1[1]  # a caller keeps one result
    del views1
    views2 = pool.get()[1]
    assert id(views2[0].base) != first
    del held
    assert id(pool.get()[0]) == first  # nobody holds entry 1 any more: reused
    keep = [pool.get()[1][0] for _ in range(3)]  # all referenced: fresh arrays beyond the pool
    assert len({id(k) for k in keep}) == 3
    np.testing.assert_array_equal(keep[0].shape, (4,))


def test_result_pool_view_of_result_pins_entry():
    (bucket,) = plan_buckets([((8,), "f8")], 1 << 20)
    pool = ResultPool(bucket)
    views = pool.get()[1]
    first = id(views[0].base)
    derived = views[0][2:5]  # its .base is the block, not the result view
    del views
    assert id(pool.get()[0]) != first
    del derived
    assert id(pool.get()[0]) == first
