"""Victims without a pass over the tier: the reservoir of hiermem.core.victims.

The reservoir (a sorted run plus a heap of later low keys) must give exactly the
victims a full scan gives (the smallest ``(key, slot)`` among the evictable slots) under
any sequence of inserts, accesses, carry-ins of old keys, removals, pins and per-batch
exclusions; and a store whose tiers answer from it must train, place and count exactly
like one that scans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.core import victims as vk
from hiermem.core.policies import POLICIES


def _victims(p, kt, pins, excl, n):
    mark = np.zeros(kt.size, dtype=np.uint8)
    mark[excl] = 1
    ok = (kt >= 0) & (pins == 0) & (mark == 0)
    out = np.empty(max(n, 1), dtype=np.int64)
    got = vk.victims(p.state, kt, pins, mark, n, int(ok.sum()), int((kt >= 0).sum()), out)
    assert not mark.any() or set(np.nonzero(mark)[0]) == set(excl), "victims left marks behind"
    return out[:got]


@pytest.mark.parametrize("carried", [50, 3000], ids=["few-carry-ins", "many-carry-ins"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["lru", "lfu", "lfu_decay"])
def test_reservoir_victims_equal_a_full_scan(name, seed, carried):
    cap = 40_000
    rng = np.random.default_rng(seed)
    p, ref = POLICIES[name](cap, "cpu"), POLICIES[name](cap, "cpu")
    ref.reservoir = False
    kt = np.full(cap, -1, dtype=np.int64)
    pins = np.zeros(cap, dtype=np.int32)
    clock = 0
    used = 0
    for step in range(120):
        free = np.nonzero(kt < 0)[0]
        new = rng.choice(free, min(free.size, int(rng.integers(0, 3000))), replace=False)
        kt[new] = 0
        c = np.arange(clock, clock + new.size)
        clock += new.size
        for q in (p, ref):
            q.on_insert(new, c, np.ones(new.size, dtype=np.int64))
        occ = np.nonzero(kt >= 0)[0]
        hit = np.unique(rng.choice(occ, min(occ.size, 2000)))
        cnt = rng.integers(1, 4, hit.size)
        for q in (p, ref):
            q.on_access(hit, clock + np.arange(hit.size), cnt)
        clock += hit.size
        if step % 4 == 1:  # rows carried in from another tier with old keys (below tau)
            old = np.unique(rng.choice(occ, min(occ.size, carried)))
            keys = rng.integers(0, max(1, clock // 4), old.size)
            for q in (p, ref):
                q.on_carry_in(old, torch.stack((torch.from_numpy(keys).view(torch.float64),
                                                torch.zeros(old.size, dtype=torch.float64),
                                                torch.ones(old.size, dtype=torch.float64)), 1))
        if step % 7 == 3:  # pins come and go
            pins[:] = 0
            pins[rng.choice(occ, min(occ.size, 500))] = 1
        excl = np.unique(rng.choice(occ, min(occ.size, 300)))
        evictable = int(((kt >= 0) & (pins == 0)).sum()) - int((pins[excl] == 0).sum())
        n = int(min(evictable, rng.integers(1, 800)))
        v_ref = _victims(ref, kt, pins, excl, n)
        v = _victims(p, kt, pins, excl, n)
        assert np.array_equal(v, v_ref), f"step {step}: reservoir victims differ from the scan"
        used += p.state[4][0] == 1
        assert p.reservoir_builds <= step + 1
        kt[v] = -1  # evicted (until then the victims' entries may be gone: a failed plan drops it)
        if step % 5 == 0:  # rows removed otherwise (promoted to the other tier)
            gone = rng.choice(np.nonzero(kt >= 0)[0], 200, replace=False)
            kt[gone] = -1
        p.check_reservoir(torch.from_numpy(kt >= 0))
    assert used >= 60  # the path under test answered (not the scan fallback)
    assert p.reservoir_builds < 40


def test_per_access_victims_equal_a_full_scan():
    """One victim per call (a per-access trace): the heap path, LFU's fresh counts."""
    cap = 70_000
    rng = np.random.default_rng(5)
    p, ref = POLICIES["lfu"](cap, "cpu"), POLICIES["lfu"](cap, "cpu")
    ref.reservoir = False
    kt = np.zeros(cap, dtype=np.int64)
    counts = rng.integers(1, 3, cap)
    for q in (p, ref):
        q.on_insert(np.arange(cap), np.arange(cap), counts)
    for step in range(300):
        v = _victims(p, kt, np.zeros(cap, np.int32), np.zeros(0, np.int64), 1)
        assert np.array_equal(v, _victims(ref, kt, np.zeros(cap, np.int32), np.zeros(0, np.int64), 1))
        for q in (p, ref):
            q.on_insert(v, np.array([cap + step]), np.array([1]))
    assert p.reservoir_builds == 1


def test_a_small_tier_keeps_every_slot_in_one_reservoir():
    """A tier smaller than the reservoir's floor (4096 entries) keeps all its slots in the
    run, with the largest key as threshold: one build serves evictions until the run is
    spent (the scan it replaced sorted the whole tier for every miss of a per-access
    trace: 7 us a miss at 500 slots)."""
    p = POLICIES["lru"](1000, "cpu")
    p.on_insert(torch.arange(1000), torch.arange(1000), torch.ones(1000, dtype=torch.int64))
    kt = np.zeros(1000, dtype=np.int64)
    assert _victims(p, kt, np.zeros(1000, np.int32), np.zeros(0, np.int64), 10).tolist() == list(range(10))
    assert p.reservoir_builds == 1 and p.state[4][1] == 999  # tau: the largest key
    for i in range(10, 20):  # one victim a call, as a per-access trace asks: no rebuild
        assert _victims(p, kt, np.zeros(1000, np.int32), np.zeros(0, np.int64), 1).tolist() == [i - 10]
        p.on_insert(np.array([i - 10]), np.array([1000 + i]), np.array([1]))
    assert p.reservoir_builds == 1


@pytest.mark.parametrize("cap", [300, 20_000])
@pytest.mark.parametrize("name", ["lru", "lfu", "lfu_decay"])
def test_per_access_victims_with_carry_ins_equal_a_full_scan(name, cap):
    """One victim a call, with uses, old keys carried in (rows up from another tier) and
    pins between calls: the whole-tier reservoir (a small tier; LRU's per-access calls on
    any tier) gives the scan's victims."""
    rng = np.random.default_rng(11)
    p, ref = POLICIES[name](cap, "cpu"), POLICIES[name](cap, "cpu")
    ref.reservoir = False
    kt = np.zeros(cap, dtype=np.int64)
    pins = np.zeros(cap, dtype=np.int32)
    first, counts = rng.permutation(cap), rng.integers(1, 4, cap)
    for q in (p, ref):
        q.on_insert(np.arange(cap), first, counts)
    clock = cap
    for step in range(3000):
        used = rng.choice(cap, int(rng.integers(0, 4)), replace=False)
        for q in (p, ref):
            q.on_access(used, np.full(used.size, clock), np.ones(used.size, np.int64))
        if step % 97 == 5:
            pins[:] = 0
            pins[rng.choice(cap, 20, replace=False)] = 1
        if step % 13 == 0:  # a row up from another tier, with the key it had there
            old = rng.choice(cap, 2, replace=False)
            keys = rng.integers(0, clock, 2).astype(np.int64)
            for q in (p, ref):
                q.on_carry_in(old, torch.stack((torch.from_numpy(keys).view(torch.float64),
                                                torch.zeros(2, dtype=torch.float64),
                                                torch.ones(2, dtype=torch.float64)), 1))
        v = _victims(p, kt, pins, np.zeros(0, np.int64), 1)
        assert np.array_equal(v, _victims(ref, kt, pins, np.zeros(0, np.int64), 1)), f"step {step}"
        for q in (p, ref):
            q.on_insert(v, np.array([clock]), np.array([1]))
        clock += 1
    assert p.reservoir_builds < 3000 // 10


def test_ties_go_to_the_lower_slot():
    p = POLICIES["lru"](50_000, "cpu")
    p.on_insert(np.arange(50_000)[::-1].copy(), np.zeros(50_000, np.int64), np.ones(50_000, np.int64))
    kt = np.zeros(50_000, dtype=np.int64)
    v = _victims(p, kt, np.zeros(50_000, np.int32), np.array([0, 2]), 5)
    assert v.tolist() == [1, 3, 4, 5, 6]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_store_on_the_reservoir_equals_one_that_scans(tmp_path, policy):
    """Host tier of 30k rows (the reservoir path), device 512: the same training gives the
    same placement, counts and values as with the scan; audit checks the invariant."""
    spec = [hm.TableSpec("a", 200_000, 4), hm.TableSpec("b", None, 4)]
    stores = [hm.HierarchicalStore(spec, hm.StoreConfig(path=tmp_path / n, device_rows=512, host_rows=30_000,
                                                        policy=policy, optimizer=hm.Adagrad(lr=0.1)))
              for n in ("res", "scan")]
    for tier in (stores[1]._dev, stores[1]._host):
        tier.policy.reservoir = False
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
        assert stores[1]._host.policy.reservoir_builds == 0
        st = [s.stats() for s in stores]
        for name in ("a", "b"):
            assert st[0][name] == st[1][name]
        ids = torch.arange(0, 180_000, 7)
        assert torch.equal(stores[0].where("a", ids), stores[1].where("a", ids))
        assert torch.equal(stores[0].lookup("a", ids[:2000]), stores[1].lookup("a", ids[:2000]))
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize("seed", range(6))
def test_select_is_the_kth_smallest(seed):
    """The reservoir's threshold (the r-th smallest key) is a quickselect written out in
    place of ``np.partition``: it must agree with numpy on any keys, ties included."""
    rng = np.random.default_rng(seed)
    for n in (1, 2, 3, 7, 100, 5000):
        hi = [2, n, 1 << 40][seed % 3]  # heavy ties, some, none
        a = rng.integers(-hi, hi, n).astype(np.int64)
        for k in {0, n // 2, n - 1, int(rng.integers(0, n))}:
            b = a.copy()
            assert vk._select(b, n, k) == np.partition(a, k)[k]
            assert sorted(b.tolist()) == sorted(a.tolist()), "select lost or duplicated a key"


def test_select_on_ordered_keys_and_its_heap_fallback():
    """Keys an LRU tier holds in slot order (a rotated ascending run, the input that made
    a median-of-ends quickselect quadratic), organ pipes and sawtooths agree with numpy;
    so does the heap selection the quickselect falls back to, on any sub-range."""
    n = 20_000
    up = np.arange(n, dtype=np.int64)
    shapes = [np.roll(up, r) for r in (0, 1, 3000, n // 2, 20000 % n, n - 1)]
    shapes += [np.concatenate([up[: n // 2], up[: n // 2][::-1]]), up % 97, up[::-1].copy()]
    for a in shapes:
        for k in (0, 2499, n // 2, n - 1):
            b = a.copy()
            assert vk._select(b, n, k) == np.partition(a, k)[k]
            assert np.array_equal(np.sort(b), np.sort(a))
    rng = np.random.default_rng(7)
    for _ in range(20):
        m = int(rng.integers(1, 300))
        a = rng.integers(-5, 50, m).astype(np.int64)
        lo = int(rng.integers(0, m))
        hi = int(rng.integers(lo, m))
        k = int(rng.integers(lo, hi + 1))
        b = a.copy()
        assert vk._heap_select(b, lo, hi, k) == np.partition(a[lo:hi + 1], k - lo)[k - lo]
        assert np.array_equal(np.sort(b[lo:hi + 1]), np.sort(a[lo:hi + 1])) and np.array_equal(b[:lo], a[:lo])


def test_the_victim_search_knows_the_policy_codes():
    """victims.py names LRU's and lookahead's codes itself (policy.py imports it)."""
    from hiermem.core import policy

    assert (vk._LRU, vk._LOOKAHEAD) == (policy.LRU, policy.LOOKAHEAD)


@pytest.mark.parametrize("seed", range(6))
def test_scan_is_the_n_smallest_key_slot_pairs(seed):
    """The scan (the reference every reservoir test compares with) against numpy's
    lexsort: the ``n`` smallest ``(key, slot)`` of the evictable slots, in order, for any
    ``n`` (its histogram path takes fewer than half of them), on keys with heavy ties,
    negative keys, and keys at both ends of int64 (a span that only fits in uint64)."""
    rng = np.random.default_rng(seed)
    C = 3000
    hi = [3, 1000, 1 << 40, 1 << 62, 1 << 62, 1 << 20][seed]
    keys = rng.integers(-hi, hi, C).astype(np.int64)
    if seed == 4:  # both extremes of int64 present
        keys[:2] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    kt = np.where(rng.random(C) < 0.9, 0, -1).astype(np.int64)
    pins = np.where(rng.random(C) < 0.05, 1, 0).astype(np.int32)
    mark = np.where(rng.random(C) < 0.05, 1, 0).astype(np.uint8)
    ok = np.nonzero((kt >= 0) & (pins == 0) & (mark == 0))[0]
    ref = ok[np.lexsort((ok, keys[ok]))]
    rm = vk.new_state(C)
    for n in (1, 2, 17, ok.size // 3, ok.size // 2 - 1, ok.size // 2 + 1, ok.size, ok.size + 5):
        out = np.empty(max(n, 1), dtype=np.int64)
        got = vk.scan_(keys, rm, kt, pins, mark, n, out)
        assert got == min(n, ok.size)
        assert out[:got].tolist() == ref[:got].tolist(), n


@pytest.mark.parametrize("seed", range(6))
def test_build_keeps_the_r_smallest_and_their_ties(seed):
    """A reservoir build: the threshold is the r-th smallest occupied key (numpy's
    partition), and the run is every occupied slot with a key at most that, in
    ``(key, slot)`` order; on heavy ties, negative keys and both ends of int64."""
    rng = np.random.default_rng(seed)
    C = 4000
    hi = [3, 1000, 1 << 40, 1 << 62, 1 << 62, 1 << 20][seed]
    keys = rng.integers(-hi, hi, C).astype(np.int64)
    if seed == 4:
        keys[:2] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    kt = np.where(rng.random(C) < 0.8, 0, -1).astype(np.int64)
    occ = np.nonzero(kt >= 0)[0]
    for r in (1, 7, occ.size // 5, occ.size - 1, occ.size, occ.size + 3):
        rm = vk.new_state(C)
        run_s, run_k = np.empty(C, np.int64), np.empty(C, np.int64)
        vk.build_(keys, rm, run_s, run_k, kt, r)
        tau = np.partition(keys[occ], min(r, occ.size) - 1)[min(r, occ.size) - 1]
        assert rm[vk._TAU] == tau, r
        want = occ[keys[occ] <= tau]
        want = want[np.lexsort((want, keys[want]))]
        n = int(rm[vk._RLEN])
        assert run_s[:n].tolist() == want.tolist() and run_k[:n].tolist() == keys[want].tolist(), r


def test_nth_smallest_on_skewed_keys():
    """The threshold search narrows by histograms: LFU-shaped keys (most in one count,
    the clock below it), clustered keys and a few huge outliers need several rounds."""
    rng = np.random.default_rng(11)
    n = 30_000
    lfu = (np.minimum(rng.zipf(1.5, n), 4000).astype(np.int64) << 40) | rng.permutation(10 * n)[:n]
    clustered = np.concatenate([rng.integers(0, 50, n - 3), [1 << 61, -(1 << 61), 1 << 62]]).astype(np.int64)
    for keys in (lfu, clustered, np.full(n, 7, dtype=np.int64)):
        kept = keys.copy()
        for r in (1, 2, 65, n // 8, n // 2, n - 1, n):
            got = vk._nth_smallest(keys, n, int(keys.min()), int(keys.max()), r)
            assert got == np.partition(keys, r - 1)[r - 1], r
        assert np.array_equal(keys, kept), "the keys were permuted"
