"""The slot record (hiermem.core.layout): one 32-byte record per slot, fields that never
overlap, and one compiled type for every tier size."""

import numba
import numpy as np
import pytest

from hiermem.core.layout import RECORD, slot_records
from hiermem.core.policies import PolicySpec
from hiermem.tiers.slots import SlotTier
from hiermem.types import Tier


@pytest.mark.parametrize("capacity", [0, 1, 2, 7, 1000])
def test_fields_are_disjoint_views_of_one_aligned_record_per_slot(capacity):
    kt, kk, key, pins, dirty, mark = f = slot_records(capacity)
    n = max(capacity, 2)
    assert all(a.size == n and a.strides == (RECORD,) for a in f)
    assert kt.ctypes.data % 64 == 0  # records 32-byte aligned in a line: none straddles two
    base = kt.ctypes.data
    assert [a.ctypes.data - base for a in f] == [0, 8, 16, 24, 28, 29]
    assert (kt == -1).all() and not kk.any() and not key.any() and not pins.any() and not dirty.any()
    # each field written alone leaves every other as it was
    rng = np.random.default_rng(capacity)
    vals = [rng.integers(-2**62, 2**62, n), rng.integers(0, 2**62, n), rng.integers(-2**62, 2**62, n),
            rng.integers(-2**31, 2**31, n).astype(np.int32), rng.integers(0, 2, n).astype(bool),
            rng.integers(0, 256, n).astype(np.uint8)]
    for a, v in zip(f, vals):
        a[:] = v
    for a, v in zip(f, vals):
        assert np.array_equal(a, v)
    # every tier size compiles to the same kernel types (layout "A"), tiny tiers included
    assert {str(numba.typeof(a)).rsplit(",", 1)[1] for a in f} == {" A)"}


def test_tier_and_policy_share_the_records():
    t = SlotTier(Tier.HOST, 5, 4, "cpu", PolicySpec("lru"), base=3)
    kt, kk, dirty, pins, free, meta, mark = t.state
    key = t.policy.state[0]
    assert key.ctypes.data == kt.ctypes.data + 16 and key.strides == (RECORD,)
    assert t.keys_t.numel() == t.dirty.numel() == t.pins.numel() == t.policy.key.numel() == 5
    t.policy.on_insert(np.array([2]), np.array([41]), np.array([1]))
    assert t.policy.key[2] == 41 and key[2] == 41
    # the record past a one-slot tier's capacity is neither free nor occupied
    one = SlotTier(Tier.DEVICE, 1, 4, "cpu", PolicySpec("lfu"), base=0)
    assert one.state[0].size == 2 and one.state[4].tolist() == [0] and one.keys_t.tolist() == [-1]
