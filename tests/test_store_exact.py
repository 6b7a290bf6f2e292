"""Model-based exactness: random operation sequences on a store with tiny tiers must
return exactly what a flat in-memory table returns (every optimizer, both policies,
bounded and unbounded tables, across flush and close/reopen)."""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hiermem as hm
from reference import FlatStore

TABLES = [hm.TableSpec("small", 40, 3), hm.TableSpec("wide", 1000, 6), hm.TableSpec("hashed", None, 4)]
HASHED_POOL = [0, 1, 7, 2**31, 2**40 + 3, 2**62, 2**63 - 1, 123456789012, 5, 99]
OPTIMIZERS = [hm.SGD(lr=0.3), hm.Adagrad(lr=0.2), hm.RowWiseAdagrad(lr=0.2), hm.Adam(lr=0.05)]
ATOL = 1e-6


def ids_for(table: str):
    if table == "small":
        return st.lists(st.integers(0, 39), max_size=14)
    if table == "wide":
        return st.lists(st.integers(0, 999) | st.sampled_from([0, 1, 2, 3, 998, 999]), max_size=14)
    return st.lists(st.sampled_from(HASHED_POOL), max_size=14)


table_and_ids = st.sampled_from([s.name for s in TABLES]).flatmap(lambda t: st.tuples(st.just(t), ids_for(t)))
DIMS = {s.name: s.dim for s in TABLES}


def grads_for(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


class StoreMachine(RuleBasedStateMachine):
    optimizer: hm.Optimizer = OPTIMIZERS[0]
    policy: str = "lru"
    device: str = "cpu"  # tests/test_gpu.py runs the same machine with "cuda"

    @initialize()
    def setup(self):
        self.dir = tempfile.mkdtemp(prefix="hm-exact-")
        self.cfg = hm.StoreConfig(path=f"{self.dir}/s", device_rows=4, host_rows=16, policy=self.policy,
                                  optimizer=self.optimizer, seed=3, device=self.device)
        self.store = hm.HierarchicalStore(TABLES, self.cfg)
        self.ref = FlatStore(TABLES, self.optimizer, seed=3)
        self.touched: dict[str, set[int]] = {s.name: set() for s in TABLES}

    def teardown(self):
        if hasattr(self, "store"):
            try:
                for name, ids in self.touched.items():
                    if ids:  # every row ever touched still equals the reference
                        for chunk in _chunks(sorted(ids), 12):
                            self._compare(name, chunk)
            finally:
                self.store.close()
                shutil.rmtree(self.dir, ignore_errors=True)

    def _compare(self, table, ids):
        t = torch.tensor(ids, dtype=torch.int64)
        got = self.store.lookup(table, t).cpu()
        want = self.ref.lookup(table, t)
        assert got.shape == (len(ids), DIMS[table])
        assert torch.allclose(got, want, atol=ATOL, rtol=1e-5), (table, ids, (got - want).abs().max())

    def _fits(self, ids) -> bool:
        return len(set(ids)) <= 20

    @rule(ti=table_and_ids)
    def lookup(self, ti):
        table, ids = ti
        if not self._fits(ids):
            with pytest.raises(hm.CapacityError):
                self.store.lookup(table, torch.tensor(ids))
            return
        self._compare(table, ids)
        self.touched[table].update(ids)

    @rule(ti=table_and_ids, seed=st.integers(0, 2**16), via_lookup=st.booleans())
    def update(self, ti, seed, via_lookup):
        table, ids = ti
        if not self._fits(ids):
            return
        t = torch.tensor(ids, dtype=torch.int64)
        g = grads_for(len(ids), DIMS[table], seed)
        if via_lookup:  # the training pattern: lookup, then update with the same tensor
            self.store.lookup(table, t)
        self.store.update(table, t, g)
        self.ref.update(table, t, g)
        self.touched[table].update(ids)

    @rule(ti=table_and_ids, seed=st.integers(0, 2**16))
    def write(self, ti, seed):
        table, ids = ti
        if not self._fits(ids):
            return
        ids = list(dict.fromkeys(ids))  # distinct: "last wins" is tested separately
        v = grads_for(len(ids), DIMS[table], seed)
        self.store.write(table, torch.tensor(ids, dtype=torch.int64), v)
        self.ref.write(table, torch.tensor(ids, dtype=torch.int64), v)
        self.touched[table].update(ids)

    @rule()
    def flush(self):
        self.store.flush()
        s = self.store.stats()["_store"]
        assert s["device_dirty"] == 0 and s["host_dirty"] == 0

    @rule(device_rows=st.sampled_from([4, 5]), host_rows=st.sampled_from([16, 17]))
    def reopen(self, device_rows, host_rows):
        self.store.close()
        self.store = hm.HierarchicalStore.open(self.cfg.path, device_rows=device_rows, host_rows=host_rows)

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            self.store.audit()


def _chunks(xs, n):
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


def _machine(opt, policy):
    cls = type(f"StoreMachine_{opt.name}_{policy}", (StoreMachine,), {"optimizer": opt, "policy": policy})
    cls.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                     suppress_health_check=list(HealthCheck))
    return cls


for _opt in OPTIMIZERS:
    for _pol in ("lru", "lfu"):
        _m = _machine(_opt, _pol)
        # the LRU machines take 10-18 s each here (the LFU ones 1.4-2 s): slow, run in full runs and CI
        globals()[f"Test{_m.__name__}"] = pytest.mark.slow(_m.TestCase) if _pol == "lru" else _m.TestCase
