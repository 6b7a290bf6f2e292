"""The host tier keeps each row's record at its own table's width (issue 19): bytes per
host row of a narrow table in a mixed-width model, the record pools' bookkeeping, and
exact training against the flat reference with rows moving through host and disk,
across flush, checkpoint/restore and reopen, on both data planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hiermem as hm
import hiermem.tiers.host as host_mod
from hiermem.core.policies import PolicySpec
from hiermem.tiers.host import HostTier
from reference import FlatStore

OPT = hm.RowWiseAdagrad(lr=0.2)


def mixed_tables(narrow: int = 20, rows: int | None = None) -> list[hm.TableSpec]:
    return [hm.TableSpec("wide", rows, 128)] + [hm.TableSpec(f"narrow{i}", rows, 8) for i in range(narrow)]


def _fill(s: hm.HierarchicalStore, table: str, n: int, dim: int) -> None:
    for i in range(0, n, 512):
        ids = torch.arange(i, min(n, i + 512))
        s.write(table, ids, torch.randn(ids.numel(), dim, generator=torch.Generator().manual_seed(i)))


def test_narrow_rows_take_their_own_record_on_the_host(tmp_path):
    """A host full of 8-dim rows of a model whose widest table is 128-dim: 36 B per row
    (8 weights + row-wise Adagrad's one state float), not the widest record's 516 B."""
    H, D = 4096, 64
    with hm.HierarchicalStore(mixed_tables(), hm.StoreConfig(path=tmp_path / "s", device_rows=D, host_rows=H,
                                                              optimizer=OPT)) as s:
        _fill(s, "narrow0", H + D, 8)
        st = s.stats()
        assert st["narrow0"]["host"]["occupancy"] == H
        per_row = st["_store"]["host_record_bytes"] / H
        assert 36 <= per_row <= 36 * 1.01, per_row
        _fill(s, "wide", 200, 128)  # wide rows push narrow ones to disk: the wide pool follows
        st = s.stats()
        held = {t: st[t]["host"]["occupancy"] for t in ("wide", "narrow0")}
        assert held["wide"] > 0
        # each pool is at most twice what its rows need (doubling), never capacity x 516 B
        assert st["_store"]["host_record_bytes"] <= 2 * (held["wide"] * 516 + H * 36) + 516
        s.audit()


def test_single_width_keeps_the_flat_layout(tmp_path):
    tabs = [hm.TableSpec("a", None, 8), hm.TableSpec("b", None, 8)]
    with hm.HierarchicalStore(tabs, hm.StoreConfig(path=tmp_path / "s", device_rows=4, host_rows=32,
                                                   optimizer=OPT)) as s:
        assert s._host.uniform and s._host.data.shape == (32, 9)
        assert not s.host_tier.page_locked  # page-locked memory only for a CUDA device tier
        assert s.stats()["_store"]["host_record_bytes"] == 32 * 9 * 4


def _tier(widths, bounds, capacity=8):
    h = HostTier(capacity, widths, bounds, PolicySpec("lru"), base=100)
    return h, h.state[0]


def test_records_follow_rows_in_and_out(monkeypatch):
    monkeypatch.setattr(host_mod, "FIRST_RECORDS", 1)  # every pool grows, record by record
    h, kt = _tier([3, 5, 3], [None, None, 2])
    assert h.record_bytes() == 5 * 4  # nothing but the view's slack before any row
    kt[:] = [0, 1, 2, 1, -1, -1, 0, 1]
    occ = np.flatnonzero(kt >= 0)
    h.assign(occ)
    h.check()
    rec = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    h.write(occ, rec)
    got = h.read(occ, 5)
    widths = np.array([3, 5, 3, 5, 3, 5])
    for i, w in enumerate(widths):
        assert torch.equal(got[i, :w], rec[i, :w]) and not got[i, w:].any()
    # 3 rows of each width: pools doubled 1 -> 2 -> 4 records each, plus the view's slack
    assert h.record_bytes() == (4 * 3 + 4 * 5 + 5) * 4
    # slot 1 (width 5) leaves, slot 0 (width 3) takes a width-5 row: records swap classes
    kt[1] = -1
    h.release(np.array([1]))
    kt[0] = 1
    h.assign(np.array([0]))
    h.check()
    h.write(np.array([0]), torch.full((1, 5), 7.0))
    assert torch.equal(h.read(np.array([0, 3]), 5), torch.cat([torch.full((1, 5), 7.0), rec[3:4]]))
    assert torch.equal(h.read(np.array([2, 6]), 3), rec[[2, 4], :3])  # others kept through the regrowth
    kt[:] = -1
    h.clear()
    h.check()
    assert (h.hcls == -1).all()


def test_pool_bound_is_the_class_rows():
    h, kt = _tier([3, 5], [2, None], capacity=500)
    kt[:498] = 1
    kt[498:] = 0
    h.assign(np.arange(500))
    h.check()
    # the bounded table's pool stops at its 2 rows; the unbounded one's doubles 256 -> 512
    # but stops at 498: the host's capacity bounds it (<= 500), and so does the padded
    # tier's size (500 x 5 floats, the 2 narrow records included)
    assert h.ccap.tolist() == [2, 498]
    assert int((h.ccap * h.cw).sum()) <= 500 * 5


def _train(s, ref, rng, steps, tables, max_id):
    for step in range(steps):
        name = tables[rng.integers(len(tables))].name
        dim = 128 if name == "wide" else 8
        ids = torch.from_numpy(rng.integers(0, max_id, size=int(rng.integers(1, 12))))
        g = torch.from_numpy(rng.standard_normal((ids.numel(), dim)).astype(np.float32))
        s.lookup(name, ids)
        s.update(name, ids, g)
        ref.update(name, ids, g)


def _compare(s, ref, tables, max_id):
    for t in tables:
        for lo in range(0, max_id, 16):
            ids = torch.arange(lo, min(max_id, lo + 16))
            got, want = s.lookup(t.name, ids.to(s.device)).cpu(), ref.lookup(t.name, ids)
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (t.name, lo, (got - want).abs().max())


@pytest.mark.parametrize("plane", ["compiled", "torch"])
@pytest.mark.parametrize("opt", [hm.RowWiseAdagrad(lr=0.2), hm.Adam(lr=0.05), hm.SGD(lr=0.3)], ids=lambda o: o.name)
def test_mixed_widths_train_exactly(tmp_path, monkeypatch, plane, opt):
    """One 128-dim and three 8-dim tables on tiny tiers (rows move device <-> host <->
    disk all the time, the host's pools grow from one record): equal to the flat
    reference through flush, checkpoint and restore, and reopen."""
    monkeypatch.setattr(host_mod, "FIRST_RECORDS", 1)
    tables, max_id = mixed_tables(3), 60
    cfg = hm.StoreConfig(path=tmp_path / "s", device_rows=6, host_rows=24, optimizer=opt, seed=5)
    ref = FlatStore(tables, opt, seed=5)
    rng = np.random.default_rng(0)
    s = hm.HierarchicalStore(tables, cfg)
    try:
        s.data_plane = plane
        assert not s._host.uniform
        _train(s, ref, rng, 60, tables, max_id)
        s.audit()
        s.flush()
        _train(s, ref, rng, 30, tables, max_id)
        s.checkpoint(tmp_path / "ck")
        ref_rows = {k: dict(v) for k, v in ref.rows.items()}
        ref_steps = dict(ref.steps)
        _train(s, ref, rng, 30, tables, max_id)  # diverges from the checkpoint ...
        s.close()
        s = hm.HierarchicalStore.restore(tmp_path / "ck", cfg.path)  # ... and comes back to it
        s.data_plane = plane
        ref.rows, ref.steps = ref_rows, ref_steps
        _compare(s, ref, tables, max_id)
        s.audit()
        _train(s, ref, rng, 30, tables, max_id)
        _compare(s, ref, tables, max_id)
        s.close()
        s = hm.HierarchicalStore.open(cfg.path, host_rows=25)
        s.data_plane = plane
        _train(s, ref, rng, 30, tables, max_id)
        _compare(s, ref, tables, max_id)
        s.audit()
    finally:
        s.close()


@pytest.mark.gpu
def test_cuda_host_pools_are_pinned_and_exact(tmp_path):
    tables, max_id = mixed_tables(3), 60
    cfg = hm.StoreConfig(path=tmp_path / "s", device="cuda", device_rows=6, host_rows=300, optimizer=OPT, seed=5)
    ref = FlatStore(tables, OPT, seed=5)
    with hm.HierarchicalStore(tables, cfg) as s:
        _train_cuda(s, ref, tables, max_id)
        assert s.host_tier.page_locked and s._host.arena.is_pinned()
        s.checkpoint(tmp_path / "ck")
        _compare(s, ref, tables, max_id)
        s.audit()


def _train_cuda(s, ref, tables, max_id):
    rng = np.random.default_rng(1)
    for _ in range(80):
        name = tables[rng.integers(len(tables))].name
        dim = 128 if name == "wide" else 8
        ids = torch.from_numpy(rng.integers(0, max_id, size=int(rng.integers(1, 12))))
        g = torch.from_numpy(rng.standard_normal((ids.numel(), dim)).astype(np.float32))
        s.lookup(name, ids.cuda())
        s.update(name, ids.cuda(), g.cuda())
        ref.update(name, ids, g)


def test_pools_shrink_when_their_rows_leave(monkeypatch):
    monkeypatch.setattr(host_mod, "FIRST_RECORDS", 4)
    h, kt = _tier([3, 5], [None, None], capacity=64)
    kt[:] = 1
    h.assign(np.arange(64))
    rec = torch.arange(64 * 5, dtype=torch.float32).reshape(64, 5)
    h.write(np.arange(64), rec)
    assert h.ccap.tolist() == [0, 64]
    keep = np.array([3, 40, 63])  # records spread over the pool stay, moved below its new size
    kt[:] = -1
    kt[keep] = 1
    h.release(np.arange(64))
    h.check()
    assert h.ccap.tolist() == [0, 6] and h.record_bytes() == (6 * 5 + 5) * 4
    assert torch.equal(h.read(keep, 5), rec[keep])
    kt[8:16] = 0  # the other width's rows come: its pool grows, the first's records stay
    h.assign(np.arange(8, 16))
    h.check()
    assert torch.equal(h.read(keep, 5), rec[keep])


def test_host_records_never_take_more_than_a_padded_tier(tmp_path):
    """Whatever the mix of rows over time, the pools never allocate more than the padded
    tier did (host_rows x the widest record): a host filled with wide rows, then with
    narrow ones (the wide pool has grown to its peak), then wide again, stays within it,
    and rows read back exact."""
    H, D = 2048, 32
    pad = H * 516
    with hm.HierarchicalStore(mixed_tables(4), hm.StoreConfig(path=tmp_path / "s", device_rows=D, host_rows=H,
                                                               optimizer=OPT)) as s:
        for table, n, dim in (("wide", H + D, 128), ("narrow0", H // 2, 8), ("narrow1", H // 2, 8),
                              ("wide", H + D, 128), ("narrow2", H + D, 8), ("wide", H // 2, 128)):
            _fill(s, table, n, dim)
            # (+ one widest record past the end: the float-stride view's slack)
            assert s.stats()["_store"]["host_record_bytes"] <= pad + 516
            s.audit()
        for table, n, dim in (("wide", H + D, 128), ("narrow2", H + D, 8)):
            got = s.lookup(table, torch.arange(256))
            want = torch.cat([torch.randn(min(512, n), dim, generator=torch.Generator().manual_seed(0))])[:256]
            assert torch.equal(got, want)
