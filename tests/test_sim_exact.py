"""The simulator reproduces a real HierarchicalStore's counters exactly on a trace the
store captured while training (lookup + update per batch), for every registered policy
that needs no lookahead, with several tables, tiny tiers and LMDB write-backs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.nn.data import ZipfIds
from hiermem.core.policies import POLICIES
from hiermem.sim import SimConfig, load_trace, simulate
from hiermem.observe.stats import IO

PLAIN = sorted(n for n, c in POLICIES.items() if not c.wants_lookahead) + ["lookahead"]


def _train(tmp_path, policy, tables, steps, device_rows, host_rows, seed, record_via_config=True):
    cfg = hm.StoreConfig(path=tmp_path / "store", device_rows=device_rows, host_rows=host_rows, policy=policy,
                         trace_path=(tmp_path / "trace") if record_via_config else None)
    store = hm.HierarchicalStore(tables, cfg)
    if not record_via_config:
        store.record(tmp_path / "trace")
    gens = [ZipfIds(s.num_rows, 0.9 + 0.1 * i, seed + i) for i, s in enumerate(tables)]
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for spec, gen in zip(tables, gens):
            n = int(rng.integers(1, 40))
            ids = torch.from_numpy(gen(n))
            store.lookup(spec.name, ids)
            store.update(spec.name, ids, torch.full((n, spec.dim), 0.01))
    table, io = store.counters.table.clone(), store.counters.io.clone()
    width = store.width
    store.close()
    return table, io, width


@pytest.mark.parametrize("policy", PLAIN)
@pytest.mark.parametrize("seed", [0, 1])
def test_sim_reproduces_store_counters(tmp_path, policy, seed):
    tables = [hm.TableSpec("users", 400, 4), hm.TableSpec("items", 250, 4), hm.TableSpec("tags", 30, 4)]
    table, io, width = _train(tmp_path, policy, tables, steps=50, device_rows=24, host_rows=40, seed=seed,
                              record_via_config=seed == 0)
    trace = load_trace(tmp_path / "trace")
    assert trace.tables == ("users", "items", "tags") and trace.updates
    assert trace.accesses == int(table[:, hm.Tier.DEVICE, hm.Stat.LOOKUPS].sum())
    res = simulate(trace, SimConfig(device_rows=24, host_rows=40, policy=policy, row_bytes=width * 4))
    assert int(table[:, hm.Tier.HOST, hm.Stat.WRITEBACKS].sum()) > 0  # LMDB write-backs happened
    assert int(table[:, hm.Tier.DISK, hm.Stat.HITS].sum()) > 0  # and rows were read back
    assert torch.equal(res.counters.table, table)
    for k in (IO.BYTES_HOST_TO_DEVICE, IO.BYTES_DEVICE_TO_HOST, IO.BYTES_DISK_TO_HOST, IO.BYTES_HOST_TO_DISK,
              IO.UPDATES, IO.UPDATED_ROWS):
        assert int(res.counters.io[k]) == int(io[k]), k.name


def test_sim_reproduces_store_when_batches_overflow_device(tmp_path):
    """Batches larger than the device tier: rows land in the host tier (the C/E cases)."""
    tables = [hm.TableSpec("t", 300, 2)]
    table, io, width = _train(tmp_path, "lru", tables, steps=120, device_rows=8, host_rows=64, seed=3)
    res = simulate(tmp_path / "trace", SimConfig(device_rows=8, host_rows=64, policy="lru", row_bytes=width * 4))
    assert torch.equal(res.counters.table, table)


def test_policy_file_into_sim_and_store(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('name = "lfu_decay"\n[params]\nhalf_life = 300.0\nadmit = 2\n')
    tables = [hm.TableSpec("t", 500, 2)]
    table, _, width = _train(tmp_path, str(f), tables, steps=80, device_rows=16, host_rows=32, seed=5)
    res = simulate(tmp_path / "trace", SimConfig(device_rows=16, host_rows=32, policy=f, row_bytes=width * 4))
    assert torch.equal(res.counters.table, table)


def _train_prefetch(tmp_path, policy, tables, steps, D, H, depth, seed):
    """Multi-table batches through the store's prefetch API in the pipeline's order:
    P(0..k-1); per step L(i), P(i+k), U(i), R(i), or L(i), U(i), R(i), P(i+k) when batch
    i is not pinned at its lookup (as hiermem.PrefetchPipeline issues them)."""
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "store", device_rows=D, host_rows=H,
                                                        policy=policy, trace_path=tmp_path / "trace"))
    gens = [ZipfIds(s.num_rows, 0.9 + 0.1 * i, seed + i) for i, s in enumerate(tables)]
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        n = [int(rng.integers(1, 30)) for _ in tables]
        t = torch.from_numpy(np.concatenate([np.full(x, i) for i, x in enumerate(n)]))
        k = torch.from_numpy(np.concatenate([g(x) for g, x in zip(gens, n)]))
        perm = torch.from_numpy(rng.permutation(t.numel()))  # tables interleaved, as a module may issue
        batches.append((t[perm], k[perm]))
    tickets = {j: store.prefetch(*batches[j]) for j in range(min(depth, steps))}
    for i, (t, k) in enumerate(batches):
        off = torch.arange(k.numel())
        ticket = tickets.pop(i, None)  # depth 0: plain multi-table lookups
        store.lookup_bags(t, k, off, ticket=ticket)
        pinned = ticket is not None and ticket.pinned
        if depth and i + depth < steps and pinned:
            tickets[i + depth] = store.prefetch(*batches[i + depth])
        store.update_bags(t, k, off, torch.full((k.numel(), store.max_dim), 0.01), ticket=ticket)
        if ticket is not None:
            store.release(ticket)
        if depth and i + depth < steps and not pinned:
            tickets[i + depth] = store.prefetch(*batches[i + depth])
    table, io, width = store.counters.table.clone(), store.counters.io.clone(), store.width
    store.close()
    return table, io, width


@pytest.mark.skipif(not hasattr(hm.HierarchicalStore, "prefetch"), reason="store has no prefetch")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("depth,D,H", [(1, 40, 60), (2, 48, 80), (3, 40, 40), (0, 40, 60)])
def test_sim_reproduces_store_with_prefetch(tmp_path, policy, depth, D, H):
    """Pins, degraded (refused) prefetches, host landings and revocations included."""
    tables = [hm.TableSpec("users", 400, 4), hm.TableSpec("items", 250, 4)]
    table, io, width = _train_prefetch(tmp_path, policy, tables, 60, D, H, depth, seed=depth)
    res = simulate(tmp_path / "trace", SimConfig(device_rows=D, host_rows=H, policy=policy, prefetch_depth=depth,
                                                 row_bytes=width * 4))
    assert int(table[:, hm.Tier.HOST, hm.Stat.WRITEBACKS].sum()) > 0
    assert torch.equal(res.counters.table, table)
    skip = {IO.FLUSHES, IO.FLUSHED_ROWS, IO.LATE_PREFETCHES}
    for k in IO:
        if k not in skip:
            assert int(res.counters.io[k]) == int(io[k]), k.name
    if depth == 3:
        assert int(io[IO.PREFETCH_DEGRADED]) > 0


@pytest.mark.parametrize("policy,depth,D,H", [("lru", 2, 48, 80), ("lfu", 3, 40, 40), ("lru", 1, 200, 100),
                                              ("lookahead", 2, 40, 60), ("lfu_decay", 2, 48, 80)])
def test_sim_reproduces_a_real_prefetch_pipeline(tmp_path, policy, depth, D, H):
    """The module trained through hm.PrefetchPipeline (its background thread included)
    issues exactly the order the simulator replays: counters equal."""
    tables = [hm.TableSpec("users", 400, 4), hm.TableSpec("items", 250, 4)]
    emb = hm.CachedEmbeddingBagCollection(tables, hm.StoreConfig(
        path=tmp_path / "store", device_rows=D, host_rows=H, policy=policy, trace_path=tmp_path / "trace",
        optimizer=hm.RowWiseAdagrad(lr=0.1)))
    gens = [ZipfIds(s.num_rows, 0.9, depth + i) for i, s in enumerate(tables)]
    rng = np.random.default_rng(depth)

    def batches():
        for _ in range(50):
            lengths = torch.from_numpy(rng.integers(0, 3, 2 * 16))
            n = lengths.view(2, 16).sum(1).tolist()
            yield hm.SparseFeatures(("users", "items"), torch.from_numpy(np.concatenate(
                [g(x) for g, x in zip(gens, n)])), lengths)
    with hm.PrefetchPipeline(batches(), emb, depth=depth) as pipe:
        for f in pipe:
            emb(f).square().sum().backward()
    table, io, width = emb.store.counters.table.clone(), emb.store.counters.io.clone(), emb.store.width
    emb.store.close()
    res = simulate(tmp_path / "trace", SimConfig(device_rows=D, host_rows=H, policy=policy, prefetch_depth=depth,
                                                 row_bytes=width * 4))
    assert torch.equal(res.counters.table, table)
    for k in IO:
        if k not in (IO.FLUSHES, IO.FLUSHED_ROWS, IO.LATE_PREFETCHES):
            assert int(res.counters.io[k]) == int(io[k]), k.name
    assert int(io[IO.PREFETCHED_BATCHES]) > 0


def test_prefetch_order_is_the_pipelines_rule():
    """P(0..k-1); per batch L(i), P(i+k) at once when batch i is pinned, else after R(i)."""
    from hiermem.store.multi import prefetch_now, prefetch_order

    class T:
        def __init__(self, pinned):
            self.pinned = pinned

    tickets = {0: T(True), 1: T(False), 2: T(True), 3: None}
    got = list(prefetch_order(4, 2, tickets.get))
    assert got == [("P", 0), ("P", 1),
                   ("L", 0), ("P", 2), ("U", 0), ("R", 0),
                   ("L", 1), ("U", 1), ("R", 1), ("P", 3),
                   ("L", 2), ("U", 2), ("R", 2),
                   ("L", 3), ("U", 3), ("R", 3)]
    assert prefetch_now(T(True)) and not prefetch_now(T(False)) and not prefetch_now(None)
    assert list(prefetch_order(1, 3, tickets.get)) == [("P", 0), ("L", 0), ("U", 0), ("R", 0)]
