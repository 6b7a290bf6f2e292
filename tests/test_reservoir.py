"""Victims without a pass over the tier: the LRU/LFU reservoir (hiermem.eviction).

The reservoir must give exactly the victims a full scan gives (the smallest
``(key, slot)`` among the evictable slots) under any sequence of inserts, accesses,
carry-ins of old keys, removals, pins and per-batch exclusions; and a store whose host
tier answers from it must train, place and count exactly like one that scans."""

from __future__ import annotations

import pytest
import torch

import hiermem as hm
from hiermem.eviction import POLICIES, smallest


class Tier:
    """Occupancy, pins and exclusions of a tier, as SlotTier keeps them."""

    def __init__(self, cap):
        self.occ = torch.zeros(cap, dtype=torch.bool)
        self.pins = torch.zeros(cap, dtype=torch.int32)
        self.exclude = torch.empty(0, dtype=torch.int64)

    def view(self):
        tier = self

        class View:
            held = int((tier.occ & (tier.pins > 0)).sum()) + int(
                (tier.occ[tier.exclude] & (tier.pins[tier.exclude] == 0)).sum())
            count = int(tier.occ.sum()) - held

            def at(self, slots):
                return tier.mask().index_select(0, slots)

            def occupied(self):
                return tier.occ.clone()

            def mask(self):
                return tier.mask()
        return View()

    def mask(self):
        m = self.occ & (self.pins == 0)
        m[self.exclude] = False
        return m


@pytest.mark.parametrize("carried", [50, 3000], ids=["few-carry-ins", "many-carry-ins-merged"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["lru", "lfu"])
def test_reservoir_victims_equal_a_full_scan(name, seed, carried):
    cap = 40_000
    g = torch.Generator().manual_seed(seed)
    p = POLICIES[name](cap, "cpu")
    if carried > 50:
        p.PENDING_MERGE = 0  # pending entries sorted into the reservoir as soon as they exceed 4n
    ref = POLICIES[name](cap, "cpu")
    ref.incremental = False  # the full scan, for the same keys
    tier = Tier(cap)
    clock = 0
    free = torch.randperm(cap, generator=g)
    free_n = cap

    def both(method, *args):
        getattr(p, method)(*args)
        getattr(ref, method)(*args)

    # fill most of the tier
    s = free[:36_000]
    free = free[36_000:]
    free_n = free.numel()
    both("on_insert", s, torch.arange(clock, clock + s.numel()), torch.ones(s.numel(), dtype=torch.int64))
    clock += s.numel()
    tier.occ[s] = True
    used_reservoir = 0
    for step in range(60):
        occ = tier.occ.nonzero().squeeze(1)
        # accesses (some with equal clocks: ties), carry-ins of old keys, pins, exclusions
        hit = occ[torch.randint(0, occ.numel(), (300,), generator=g)].unique()
        both("on_access", hit, torch.full_like(hit, clock) if step % 3 == 0 else torch.arange(clock, clock + hit.numel()),
             torch.randint(1, 4, (hit.numel(),), generator=g))
        clock += hit.numel()
        if step % 4 == 1:  # rows carried in from another tier with old keys (below tau)
            old = occ[torch.randint(0, occ.numel(), (carried,), generator=g)].unique()
            both("on_carry_in", old, torch.randint(0, max(1, clock // 50), (old.numel(),), generator=g))
        tier.pins[:] = 0
        tier.pins[occ[torch.randint(0, occ.numel(), (200,), generator=g)]] = 1
        tier.exclude = hit[: hit.numel() // 2]
        n = int(torch.randint(1, 1500, (1,), generator=g))
        v_ref = ref.victims(n, tier.mask())
        v = p.victims(n, tier.view())
        assert torch.equal(v, v_ref), f"step {step}: reservoir victims differ from the scan"
        assert p.reservoir_builds <= step + 1
        used_reservoir += p._tau is not None
        p.check_reservoir(tier.occ)
        # evict them; refill some slots (new rows) from the free list and the evicted ones
        tier.occ[v] = False
        both("on_remove", v)
        back = torch.cat((free[:free_n], v))
        k = min(back.numel(), int(torch.randint(0, 1200, (1,), generator=g)))
        new = back[torch.randperm(back.numel(), generator=g)[:k]]
        both("on_insert", new, torch.arange(clock, clock + k), torch.ones(k, dtype=torch.int64))
        clock += k
        tier.occ[new] = True
        free = (~tier.occ).nonzero().squeeze(1)
        free_n = free.numel()
        p.check_reservoir(tier.occ)
    assert used_reservoir >= 50  # the path under test answered (not the scan fallback)
    assert p.reservoir_builds < 30
    if carried > 50:
        assert p.merges >= 3


def test_smallest_breaks_ties_by_slot_and_counts_duplicates_once():
    slots = torch.tensor([9, 3, 7, 3, 1, 5])
    keys = torch.tensor([2, 1, 2, 1, 2, 0])
    assert smallest(slots, keys, 3).tolist() == [5, 3, 1]
    assert smallest(slots, keys, 5).tolist() == [5, 3, 1, 7, 9]
    with pytest.raises(hm.InvalidArgumentError):
        smallest(slots, keys, 6)


def test_a_small_tier_is_scanned_not_reservoired():
    p = POLICIES["lru"](1000, "cpu")
    p.on_insert(torch.arange(1000), torch.arange(1000), torch.ones(1000, dtype=torch.int64))
    tier = Tier(1000)
    tier.occ[:] = True
    assert p.victims(10, tier.view()).tolist() == list(range(10))
    assert p._tau is None and p.reservoir_builds == 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_store_on_the_reservoir_equals_one_that_scans(tmp_path, policy):
    """Host tier of 30k rows (the reservoir path), device 512: the same training gives the
    same placement, counts and values as with the scan; audit checks the invariant."""
    spec = [hm.TableSpec("a", 200_000, 4), hm.TableSpec("b", None, 4)]
    stores = [hm.HierarchicalStore(spec, hm.StoreConfig(path=tmp_path / n, device_rows=512, host_rows=30_000,
                                                        policy=policy, optimizer=hm.Adagrad(lr=0.1)))
              for n in ("res", "scan")]
    for tier in (stores[1]._dev, stores[1]._host):
        tier.policy.incremental = False
    g = torch.Generator().manual_seed(0)
    zipf = torch.distributions.Categorical(probs=1.0 / torch.arange(1, 60_001, dtype=torch.float64) ** 1.05)
    try:
        for step in range(70):
            torch.manual_seed(step)
            ids = zipf.sample((3000,)) * 3
            hashed = torch.randint(0, 2**62, (200,), generator=g)
            for s in stores:
                for name, x in (("a", ids), ("b", hashed)):
                    emb = s.lookup(name, x)
                    s.update(name, x, 0.1 * emb + 0.01)
            if step % 10 == 9:
                for s in stores:
                    s.audit()
        assert stores[0]._host.policy.reservoir_builds >= 1
        assert stores[0]._host.policy._tau is not None
        st = [s.stats() for s in stores]
        for name in ("a", "b"):
            assert st[0][name] == st[1][name]
        ids = torch.arange(0, 180_000, 7)
        assert torch.equal(stores[0].where("a", ids), stores[1].where("a", ids))
        assert torch.equal(stores[0].lookup("a", ids[:2000]), stores[1].lookup("a", ids[:2000]))
    finally:
        for s in stores:
            s.close()
