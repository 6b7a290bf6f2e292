"""Eviction policies: one contract suite run by every registered policy, plus exact
victim order against cachetools where the semantics coincide."""

from __future__ import annotations

import random

import cachetools
import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.core.policies import POLICIES, resolve_policy

ALL = sorted(POLICIES)


def _policy(name, cap=8, admission="off"):
    p = POLICIES[name](cap, "cpu", admission=admission)
    p.attach_admission()  # as a device tier does (the filter acts in the placement; its state is there)
    return p


def _policy_file(tmp_path, name, admission):
    """A policy file naming ``name`` with the admission filter ``admission``."""
    f = tmp_path / f"{name}-{admission}.toml"
    f.write_text(f'name = "{name}"\n[params]\nadmission = "{admission}"\n')
    return str(f)


def _fill(p, n):
    slots = torch.arange(n)
    p.on_insert(slots, torch.arange(n), torch.ones(n, dtype=torch.int64))
    return slots


@pytest.mark.parametrize("admission", ["off", "tinylfu"])
@pytest.mark.parametrize("name", ALL)
class TestPolicyContract:
    def test_victims_are_distinct_evictable_and_sorted(self, name, admission):
        p = _policy(name, 16, admission)
        _fill(p, 16)
        ev = torch.zeros(16, dtype=torch.bool)
        ev[::2] = True
        v = p.victims(5, ev)
        assert v.numel() == 5 and len(set(v.tolist())) == 5
        assert bool(ev[v].all())
        keys = p.key[v]
        assert bool((keys[1:] >= keys[:-1]).all())
        assert bool((keys.max() <= p.key[ev].sort().values[4]))  # the 5 smallest

    def test_zero_and_too_many(self, name, admission):
        p = _policy(name, 8, admission)
        _fill(p, 8)
        ev = torch.ones(8, dtype=torch.bool)
        assert p.victims(0, ev).numel() == 0
        assert p.victims(8, ev).numel() == 8
        with pytest.raises(ValueError):
            p.victims(9, ev)
        with pytest.raises(ValueError):
            p.victims(1, torch.zeros(8, dtype=torch.bool))

    def test_recent_access_protects(self, name, admission):
        p = _policy(name, 8, admission)
        _fill(p, 8)
        p.on_access(torch.tensor([0]), torch.tensor([100]), torch.tensor([1]))
        v = p.victims(7, torch.ones(8, dtype=torch.bool))
        assert 0 not in v.tolist()

    def test_carry_round_trip(self, name, admission):
        a, b = _policy(name, 8, admission), _policy(name, 8, admission)
        _fill(a, 8)
        a.on_access(torch.tensor([3, 5]), torch.tensor([50, 60]), torch.tensor([2, 1]))
        b.on_carry_in(torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]), a.carry(torch.arange(8)))
        ev = torch.ones(8, dtype=torch.bool)
        assert (7 - b.victims(8, ev)).tolist() == a.victims(8, ev).tolist()

    def test_resolves_by_name_and_file(self, name, admission, tmp_path):
        assert resolve_policy(name).name == name
        f = tmp_path / "p.toml"
        f.write_text(f'name = "{name}"\n')
        assert resolve_policy(f).name == name
        spec = resolve_policy(_policy_file(tmp_path, name, admission))
        assert spec.name == name and spec.build(4).admission == admission


class _Recorder:
    """Wrap a cachetools cache to record evicted keys in order."""

    def __init__(self, cls, cap):
        evicted = self.evicted = []

        class C(cls):
            def popitem(self):
                k, v = super().popitem()
                evicted.append(k)
                return k, v

        self.cache = C(cap)

    def access(self, k):
        if k in self.cache:
            self.cache[k]
        else:
            self.cache[k] = True


def _drive(policy_name, cap, trace):
    """A one-tier cache over the policy, one access per batch; returns evicted keys."""
    p = POLICIES[policy_name](cap, "cpu")
    slot_of, key_of, free, evicted = {}, {}, list(range(cap - 1, -1, -1)), []
    one = torch.ones(1, dtype=torch.int64)
    for clock, k in enumerate(trace):
        c = torch.tensor([clock])
        if k in slot_of:
            p.on_access(torch.tensor([slot_of[k]]), c, one)
            continue
        if not free:
            occ = torch.zeros(cap, dtype=torch.bool)
            occ[list(key_of)] = True
            v = int(p.victims(1, occ)[0])
            p.on_remove(torch.tensor([v]))
            evicted.append(key_of.pop(v))
            del slot_of[evicted[-1]]
            free.append(v)
        s = free.pop()
        slot_of[k], key_of[s] = s, k
        p.on_insert(torch.tensor([s]), c, one)
    return evicted


def _zipf_trace(n, universe, seed):
    rng = np.random.default_rng(seed)
    return [int(x) % universe for x in rng.zipf(1.3, n)]


@pytest.mark.parametrize("name,cls", [("lru", cachetools.LRUCache), ("lfu", cachetools.LFUCache)])
@pytest.mark.parametrize("seed", [0, 1])
def test_victim_order_equals_cachetools(name, cls, seed):
    trace = _zipf_trace(3000, 200, seed)
    ref = _Recorder(cls, 16)
    for k in trace:
        ref.access(k)
    got = _drive(name, 16, trace)
    assert len(got) > 500
    assert got == ref.evicted


def test_store_tiers_match_cachetools_lru(tmp_path):
    """Batch size 1 through the store: the device tier holds exactly LRU(D)'s keys and
    device+host exactly LRU(D+H)'s (exclusive tiers, recency carried on demotion)."""
    D, H = 4, 8
    store = hm.HierarchicalStore([hm.TableSpec("t", 64, 2)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=D, host_rows=H, policy="lru"))
    small, big = cachetools.LRUCache(D), cachetools.LRUCache(D + H)
    trace = _zipf_trace(400, 40, 7)
    for k in trace:
        store.lookup("t", torch.tensor([k]))
        for c in (small, big):
            if k in c:
                c[k]
            else:
                c[k] = True
        where = store.where("t", torch.arange(64))
        assert set((where == hm.Tier.DEVICE).nonzero().squeeze(1).tolist()) == set(small)
        assert set((where <= hm.Tier.HOST).nonzero().squeeze(1).tolist()) == set(big)
    store.close()


def test_lru_order_inside_one_batch():
    """The per-access clock makes LRU exact within a batch: last use decides."""
    p = POLICIES["lru"](4, "cpu")
    p.on_insert(torch.arange(4), torch.tensor([3, 0, 2, 1]), torch.ones(4, dtype=torch.int64))
    assert p.victims(4, torch.ones(4, dtype=torch.bool)).tolist() == [1, 3, 2, 0]


def test_policy_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "lru"\ncolour = "blue"\n')
    with pytest.raises(hm.PolicyFileError, match="unknown keys"):
        resolve_policy(bad)
    bad.write_text('name = "nope"\n')
    with pytest.raises(hm.PolicyFileError, match="unknown policy"):
        resolve_policy(bad)
    bad.write_text('name = "lru"\n[params]\nx = 1\n')
    with pytest.raises(hm.PolicyFileError):
        resolve_policy(bad)
    bad.write_text("name = [\n")
    with pytest.raises(hm.PolicyFileError, match="cannot read"):
        resolve_policy(bad)
    with pytest.raises(hm.PolicyFileError):
        resolve_policy("mru")


def test_shipped_policy_files_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "policies"
    for f in ("lru.toml", "lfu.toml"):
        assert resolve_policy(root / f).name == f.split(".")[0]


@pytest.mark.parametrize("admission", ["off", "tinylfu"])
def test_rows_of_current_batch_never_evicted(tmp_path, admission):
    store = hm.HierarchicalStore([hm.TableSpec("t", 1000, 2)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=8, host_rows=8,
                                                policy=_policy_file(tmp_path, "lfu", admission)))
    rng = random.Random(0)
    for _ in range(50):
        ids = torch.tensor(rng.sample(range(1000), 8))
        store.lookup("t", ids)
        assert bool((store.where("t", ids) == hm.Tier.DEVICE).all())
    store.close()
