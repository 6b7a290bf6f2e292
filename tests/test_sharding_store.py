"""The store/optimizer hooks sharding adds: shard initialisation from the logical table,
updates with an external row statistic (column shards), and pooled lookups over a
non-contiguous tier view (optimizer state, or tables of mixed widths)."""

import pytest
import torch

import hiermem as hm
from hiermem.sharding import ShardStore
from hiermem.store.rows import initial_records


def test_shard_rows_start_as_the_logical_tables(tmp_path):
    logical = [hm.TableSpec("a", 1000, 8), hm.TableSpec("b", None, 6)]
    opt = hm.RowWiseAdagrad()
    shards = [hm.TableSpec("b.s0", None, 2), hm.TableSpec("b.s1", None, 4), hm.TableSpec("a.s0", 1000, 8)]
    origin = [(logical[1], 1, 0), (logical[1], 1, 2), (logical[0], 0, 0)]
    ids = torch.tensor([0, 5, 2**62 + 7])
    with ShardStore(shards, hm.StoreConfig(tmp_path / "s", optimizer=opt, seed=9), origin) as s:
        full_b = initial_records(logical[1], 1, 9, opt, ids)[:, :6]
        assert torch.equal(torch.cat((s.lookup("b.s0", ids), s.lookup("b.s1", ids)), 1), full_b)
        a_ids = ids[:2]
        assert torch.equal(s.lookup("a.s0", a_ids), initial_records(logical[0], 0, 9, opt, a_ids)[:, :8])


def test_column_shards_with_row_stat_equal_the_whole_row(tmp_path):
    spec, opt = hm.TableSpec("t", 500, 8), hm.RowWiseAdagrad(lr=0.3)
    cfg = dict(optimizer=opt, seed=1, device_rows=64, host_rows=64)  # small: rows page through LMDB
    whole = hm.HierarchicalStore([spec], hm.StoreConfig(tmp_path / "w", **cfg))
    cols = [(0, 3), (3, 5)]
    parts = [ShardStore([hm.TableSpec(f"t.s{i}", 500, w)], hm.StoreConfig(tmp_path / f"p{i}", **cfg), [(spec, 0, c0)])
             for i, (c0, w) in enumerate(cols)]
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        ids = torch.randint(0, 500, (90,), generator=g)
        grads = torch.randn(90, 8, generator=g)
        whole.update("t", ids, grads)
        uniq, inv = torch.unique(ids, return_inverse=True)
        gu = torch.zeros(uniq.numel(), 8).index_add_(0, inv, grads)
        perm = torch.randperm(uniq.numel(), generator=g)  # any order of distinct ids
        uniq, gu = uniq[perm], gu[perm]
        stat = sum(opt.row_statistic(gu[:, c0:c0 + w], 8) for c0, w in cols)
        for p, (c0, w) in zip(parts, cols):
            p.update_with_row_stat(p.tables[0].name, uniq, gu[:, c0:c0 + w].contiguous(), stat)
    for probe in torch.arange(500).split(100):
        got = torch.cat([p.lookup(p.tables[0].name, probe) for p in parts], 1)
        torch.testing.assert_close(got, whole.lookup("t", probe), rtol=1e-5, atol=1e-6)
    assert sum(p.stats()["t.s0" if i == 0 else "t.s1"]["disk"]["hits"] for i, p in enumerate(parts)) > 0
    for s in (whole, *parts):
        s.close()


def test_update_with_row_stat_refuses_bad_input(tmp_path):
    with hm.HierarchicalStore([hm.TableSpec("t", 100, 4)],
                              hm.StoreConfig(tmp_path / "r", optimizer=hm.RowWiseAdagrad())) as s:
        ids = torch.tensor([1, 2, 3])
        before = s.lookup("t", ids).clone()
        g, st = torch.ones(3, 4), torch.ones(3)
        with pytest.raises(hm.InvalidArgumentError):
            s.update_with_row_stat("t", torch.tensor([1, 1, 3]), g, st)  # repeated ids
        with pytest.raises(hm.InvalidArgumentError):
            s.update_with_row_stat("t", ids, g, torch.ones(2))
        with pytest.raises(hm.NonFiniteGradientError):
            s.update_with_row_stat("t", ids, g, torch.tensor([1.0, float("nan"), 1.0]))
        with pytest.raises(hm.NonFiniteGradientError):
            s.update_with_row_stat("t", ids, torch.full((3, 4), float("inf")), st)
        assert torch.equal(s.lookup("t", ids), before)
    with hm.HierarchicalStore([hm.TableSpec("t", 100, 4)], hm.StoreConfig(tmp_path / "sgd")) as s:
        with pytest.raises(hm.InvalidArgumentError):  # SGD has no row statistic
            s.update_with_row_stat("t", torch.tensor([1]), torch.ones(1, 4), torch.ones(1))
    assert hm.SGD().row_statistic(torch.ones(2, 3), 3) is None


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooled_lookup_over_a_narrower_table(tmp_path, mode):
    # the store's slot width is the widest record (16 + 1): table "a" reads a strided view
    tabs = [hm.TableSpec("a", 300, 4), hm.TableSpec("b", 300, 16)]
    with hm.HierarchicalStore(tabs, hm.StoreConfig(tmp_path / "n", optimizer=hm.RowWiseAdagrad())) as s:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 300, (50,), generator=g)
        offsets = torch.tensor([0, 3, 3, 20, 41])
        rows = s.lookup("a", ids)
        want = torch.nn.functional.embedding_bag(torch.arange(50), rows, offsets, mode=mode)
        torch.testing.assert_close(s.lookup_pooled("a", ids, offsets, mode), want)
        w = torch.rand(50, generator=g)
        if mode == "sum":
            want_w = torch.nn.functional.embedding_bag(torch.arange(50), rows, offsets, mode="sum",
                                                       per_sample_weights=w)
            torch.testing.assert_close(s.lookup_pooled("a", ids, offsets, "sum", w), want_w)
