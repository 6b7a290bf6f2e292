"""TorchRec drop-in: TorchRec's own DLRM trained through hiermem equals it on TorchRec's EBC.

The reference is ``torchrec.models.dlrm.DLRM`` over a plain ``EmbeddingBagCollection``
(dense gradients, ``torch.optim.SGD`` or ``torchrec.optim.RowWiseAdagrad`` on its
weights); the candidate is the same DLRM class built over
``CachedEmbeddingBagCollection.from_torchrec(ebc)`` (rows in device/host/LMDB tiers
smaller than the tables, the same optimizer fused into the backward).  Same dense
initial weights, same batches: losses every step and every row at the end within 1e-5,
and ``to_torchrec()`` exports rows that give the reference's outputs.
"""

import copy

import pytest
import torch

import hiermem as hm
from hiermem.nn.torchrec import torchrec_available

pytestmark = pytest.mark.skipif(not torchrec_available(), reason="torchrec is not importable")

B, D, DENSE = 16, 8, 5
STEPS = 25


def _ebc(weighted: bool = False, pooling: str = "SUM"):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    pt = PoolingType[pooling]
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(num_embeddings=300, embedding_dim=D, name="user", feature_names=["user_id"], pooling=pt),
        EmbeddingBagConfig(num_embeddings=200, embedding_dim=D, name="item", feature_names=["item_id", "item_hist"],
                           pooling=pt),
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=D, name="cat", feature_names=["cat"], pooling=pt),
    ], is_weighted=weighted)


FEATURES = ("cat", "item_hist", "user_id", "item_id")  # not the tables' order


def _kjt(step: int, weighted: bool = False, extra: bool = False):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 + step)
    rows = {"user_id": 300, "item_id": 200, "item_hist": 200, "cat": 40, "other": 5}
    keys = list(FEATURES) + (["other"] if extra else [])
    lens, vals = [], []
    for k in keys:
        ln = torch.randint(0, 4, (B,), generator=g)
        vals.append((torch.rand(int(ln.sum()), generator=g) ** 2 * rows[k]).long())  # skewed
        lens.append(ln)
    v = torch.cat(vals)
    w = torch.rand(v.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=v, lengths=torch.cat(lens), weights=w)


def _batch(step: int):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(B, DENSE, generator=g), (torch.rand(B, generator=g) < 0.3).float()


def _dlrm(ebc):
    from torchrec.models.dlrm import DLRM

    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, D],
                over_arch_layer_sizes=[16, 1])


def _dense(model):
    return [p for n, p in model.named_parameters() if "embedding_bag_collection" not in n]


def _optimizers(kind: str):
    from torchrec.optim import RowWiseAdagrad

    if kind == "sgd":
        return hm.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)
    return hm.RowWiseAdagrad(lr=0.1, eps=1e-8), lambda ps: RowWiseAdagrad(ps, lr=0.1, eps=1e-8)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_torchrec_dlrm_trains_the_same_through_hiermem(tmp_path, kind):
    ebc = _ebc()
    ref = _dlrm(ebc)
    hm_opt, ref_emb_opt = _optimizers(kind)
    # tiers far smaller than the 540 rows: rows go through host memory and LMDB
    cfg = hm.StoreConfig(tmp_path / "s", device_rows=96, host_rows=64, optimizer=hm_opt)
    cached = hm.CachedEmbeddingBagCollection.from_torchrec(copy.deepcopy(ebc), cfg)
    model = _dlrm(cached)  # TorchRec's DLRM accepts the drop-in
    with torch.no_grad():
        for p, q in zip(_dense(model), _dense(ref), strict=True):
            p.copy_(q)
    opt_ref = torch.optim.SGD(_dense(ref), lr=0.05)
    opt_emb = ref_emb_opt(list(ebc.parameters()))
    opt_hm = torch.optim.SGD(_dense(model), lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for step in range(STEPS):
        dense, y = _batch(step)
        kjt = _kjt(step)
        l_ref = loss_fn(ref(dense, kjt).squeeze(1), y)
        opt_ref.zero_grad()
        opt_emb.zero_grad()
        l_ref.backward()
        opt_ref.step()
        opt_emb.step()
        l_hm = loss_fn(model(dense, kjt).squeeze(1), y)
        opt_hm.zero_grad()
        l_hm.backward()  # embedding rows update here (fused optimizer)
        opt_hm.step()
        assert abs(float(l_hm) - float(l_ref)) <= 1e-5 * max(1.0, abs(float(l_ref))), (step, l_hm, l_ref)
        losses.append(float(l_ref))
    assert losses[-1] != losses[0]
    st = cached.store.stats()
    assert sum(v["disk"]["hits"] for k, v in st.items() if k != "_store") > 0, "no row came back from LMDB"
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(cached.table_rows(name), bag.weight.detach(), rtol=1e-5, atol=1e-5)
    # export to a plain EBC (all tiers) for serving: same outputs as the reference's EBC
    exported = cached.to_torchrec()
    assert [c.name for c in exported.embedding_bag_configs()] == ["user", "item", "cat"]
    kjt = _kjt(999)
    want, got = ebc(kjt), exported(kjt)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got.values(), want.values(), rtol=1e-5, atol=1e-5)
    mine = cached(kjt)
    assert mine.keys() == want.keys()
    torch.testing.assert_close(mine.values(), want.values(), rtol=1e-5, atol=1e-5)
    cached.store.close()


@pytest.mark.parametrize("weighted,pooling", [(True, "SUM"), (False, "MEAN")])
def test_from_torchrec_outputs_match(tmp_path, weighted, pooling):
    ebc = _ebc(weighted, pooling)
    cached = hm.CachedEmbeddingBagCollection.from_torchrec(ebc, hm.StoreConfig(tmp_path / "s", device_rows=64,
                                                                               host_rows=32))
    assert cached.is_weighted() == weighted and cached.mode == pooling.lower()
    for step in range(3):
        kjt = _kjt(step, weighted=True, extra=True)  # extra feature ignored, as TorchRec does
        want, got = ebc(kjt), cached(kjt)
        assert got.keys() == want.keys() == ["user_id", "item_id", "item_hist", "cat"]
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-5, atol=1e-5)
        d = cached(kjt, as_dict=True)
        torch.testing.assert_close(d["item_hist"], want.to_dict()["item_hist"], rtol=1e-5, atol=1e-5)
    cached.store.close()
    # the tensor output stays available
    plain = hm.CachedEmbeddingBagCollection.from_torchrec(ebc, hm.StoreConfig(tmp_path / "t"), output="tensor")
    out = plain(_kjt(0, weighted=True))
    assert isinstance(out, torch.Tensor) and out.shape == (B, 4 * D)
    plain.store.close()


def test_from_torchrec_refuses_what_it_cannot_honour(tmp_path):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    mixed = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="a", feature_names=["f"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="b", feature_names=["g"],
                           pooling=PoolingType.MEAN)])
    with pytest.raises(hm.InvalidArgumentError, match="SUM or MEAN"):
        hm.CachedEmbeddingBagCollection.from_torchrec(mixed, hm.StoreConfig(tmp_path / "a"))
    shared = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="a", feature_names=["f"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="b", feature_names=["f"])])
    with pytest.raises(hm.InvalidArgumentError, match="two tables"):
        hm.CachedEmbeddingBagCollection.from_torchrec(shared, hm.StoreConfig(tmp_path / "b"))
    with pytest.raises(hm.InvalidTypeError):
        hm.CachedEmbeddingBagCollection.from_torchrec(torch.nn.Linear(2, 2), hm.StoreConfig(tmp_path / "c"))
    ebc = _ebc()
    m = hm.CachedEmbeddingBagCollection.from_torchrec(ebc, hm.StoreConfig(tmp_path / "d"))
    before = m.table_rows("cat")
    from torchrec import KeyedJaggedTensor

    with pytest.raises(hm.InvalidArgumentError, match="do not match"):  # a feature is missing
        m(KeyedJaggedTensor(keys=["cat"], values=torch.tensor([1]), lengths=torch.tensor([1])))
    torch.testing.assert_close(m.table_rows("cat"), before)
    with pytest.raises(hm.InvalidArgumentError):
        hm.CachedEmbeddingBagCollection.from_torchrec(ebc, hm.StoreConfig(tmp_path / "e"), output="nope")
    m.store.close()


def test_from_torchrec_meta_ebc_starts_from_hiermems_initialiser(tmp_path):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(num_embeddings=1000, embedding_dim=4, name="a",
                                                            feature_names=["f"])], device=torch.device("meta"))
    m = hm.CachedEmbeddingBagCollection.from_torchrec(ebc, hm.StoreConfig(tmp_path / "s", seed=5))
    ref = hm.HierarchicalStore([hm.TableSpec("a", 1000, 4)], hm.StoreConfig(tmp_path / "r", seed=5))
    ids = torch.tensor([0, 7, 999])
    torch.testing.assert_close(m.table_rows("a")[ids], ref.lookup("a", ids))
    m.store.close()
    ref.close()


def test_to_torchrec_from_hiermem_tables(tmp_path):
    tables = [hm.TableSpec("a", 50, 4), hm.TableSpec("b", 20, 6)]
    m = hm.CachedEmbeddingBagCollection(tables, hm.StoreConfig(tmp_path / "s", device_rows=16, host_rows=8))
    f = hm.SparseFeatures(("a", "b"), torch.tensor([1, 2, 40, 3, 19]), torch.tensor([2, 1, 1, 1]))
    m(f).sum().backward()
    ebc = m.to_torchrec()
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=f.values, lengths=f.lengths)
    torch.testing.assert_close(ebc(kjt).values(), m(f).detach(), rtol=1e-6, atol=1e-6)
    unb = hm.CachedEmbeddingBagCollection([hm.TableSpec("u", None, 4)], hm.StoreConfig(tmp_path / "u"))
    with pytest.raises(hm.InvalidArgumentError, match="unbounded"):
        unb.to_torchrec()
    m.store.close()
    unb.store.close()


def test_torchrec_planner_plan_translates_and_fits():
    """TorchRec's planner on hiermem tables (CPU topology): its plan becomes a hiermem
    ShardingPlan with the same sharding types, ranks and column splits; a table over one
    rank's memory gets split; the JSON round-trips."""
    import logging

    from hiermem.sharding import PlannerTable, ShardingPlan, ShardingType, TierPlacement, Topology
    from hiermem.sharding.torchrec_plan import torchrec_plan, translate

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    tables = [PlannerTable("big", 200_000, 64, 4.0), PlannerTable("hot", 5_000, 32, 20.0),
              *(PlannerTable(f"t{i}", 300, 8, 1.0) for i in range(4))]
    # 200k x (64 + 1) x 4 B = 52 MB > one rank's 40 MB: TorchRec must split "big"
    topo = Topology(2, 2, device_bytes=10e6, host_bytes=30e6)
    tr, p = torchrec_plan(tables, topo, 128, hm.RowWiseAdagrad(lr=0.1))
    assert ShardingPlan.from_json(p.to_json()) == p and p.meta["source"] == "torchrec"
    params = tr.plan[""]
    for t in p.tables:
        ps = params[t.name]
        want = {"table_wise": ShardingType.TABLE_WISE, "column_wise": ShardingType.COLUMN_WISE,
                "table_column_wise": ShardingType.COLUMN_WISE, "data_parallel": ShardingType.DATA_PARALLEL}
        assert t.sharding is want[ps.sharding_type]
        assert all(s.tier is TierPlacement.DEVICE for s in t.shards)
        if t.sharding is ShardingType.COLUMN_WISE:
            assert sum(s.col_width for s in t.shards) == t.dim
            assert sorted(s.rank for s in t.shards) == sorted(int(x.placement.rank())
                                                               for x in ps.sharding_spec.shards)
    assert p.table("big").sharding is not ShardingType.TABLE_WISE
    # TorchRec kept every rank within its memory (device + host budget, all in DDR)
    assert all(b["device"] <= topo.device_bytes + topo.host_bytes for b in p.rank_bytes())
    # fit to hiermem's budgets: same shardings, ranks and columns; every rank within them
    from hiermem.sharding.torchrec_plan import fit_tiers

    fit = fit_tiers(p, tables, topo, 128, hm.RowWiseAdagrad(lr=0.1))
    for a, b in zip(p.tables, fit.tables, strict=True):
        assert a.sharding is b.sharding and [(s.rank, s.col_start, s.col_width, s.row_part) for s in a.shards] == \
            [(s.rank, s.col_start, s.col_width, s.row_part) for s in b.shards]
    assert all(b["device"] <= topo.device_bytes and b["host"] <= topo.host_bytes for b in fit.rank_bytes())
    assert any(s.tier is not TierPlacement.DEVICE for t in fit.tables for s in t.shards)
    from hiermem.sharding import PlannerError

    with pytest.raises(PlannerError, match="fits no tier"):
        fit_tiers(p, tables, Topology(2, 2, device_bytes=1e6, host_bytes=1e6, ssd_bytes=0.0), 128)
    # a kernel hiermem has no equivalent for is refused
    import copy

    bad = copy.deepcopy(tr)
    bad.plan[""]["hot"].compute_kernel = "quant"
    with pytest.raises(hm.InvalidArgumentError, match="no hiermem equivalent"):
        translate(bad, tables, topo, 128)
