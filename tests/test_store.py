"""Store behaviour in detail: counters by hand, residency, memo reuse, write semantics."""

from __future__ import annotations

import torch

import hiermem as hm


def _store(tmp_path, **kw):
    cfg = dict(path=tmp_path / "s", device_rows=2, host_rows=2, optimizer=hm.SGD(lr=1.0))
    cfg.update(kw)
    return hm.HierarchicalStore([hm.TableSpec("a", 100, 2), hm.TableSpec("b", None, 2)], hm.StoreConfig(**cfg))


def test_counters_by_hand(tmp_path):
    s = _store(tmp_path)
    s.lookup("a", torch.tensor([1, 1, 2]))        # 2 distinct misses (new rows), 1 duplicate hit
    s.lookup("a", torch.tensor([1, 3]))           # 1 hit; 3 misses -> evicts 2 (LRU) to host
    s.lookup("a", torch.tensor([4, 5]))           # 2 misses; 1,3 down to host, which pushes 2 to disk
    st = s.stats()["a"]
    assert st["device"] == dict(lookups=7, hits=2, misses=5, evictions=3, writebacks=0, occupancy=2)
    assert st["host"]["lookups"] == 5 and st["host"]["hits"] == 0 and st["host"]["occupancy"] == 2
    assert st["host"]["evictions"] == 1 and st["host"]["writebacks"] == 0  # clean initial rows: no write
    assert st["disk"] == dict(lookups=5, hits=0, misses=5, evictions=0, writebacks=0)
    assert s.stats()["_store"]["disk_rows"] == 0  # never-written rows cost no disk
    s.update("a", torch.tensor([4]), torch.ones(1, 2))  # dirty on device
    s.lookup("a", torch.tensor([2, 3]))  # 2 from disk (initialiser), 3 from host
    st = s.stats()["a"]
    assert st["host"]["hits"] == 1 and st["disk"]["misses"] == 6
    assert st["device"]["writebacks"] == 1  # row 4 went down dirty
    where = s.where("a", torch.tensor([2, 3, 4, 5, 1, 50]))
    assert where.tolist() == [hm.Tier.DEVICE, hm.Tier.DEVICE, hm.Tier.HOST, hm.Tier.HOST, hm.Tier.INIT,
                              hm.Tier.INIT]
    s.lookup("a", torch.tensor([6, 7]))  # pushes 4 (dirty) out of host to LMDB
    assert s.where("a", torch.tensor([4])).tolist() == [hm.Tier.DISK]
    assert s.stats()["a"]["host"]["writebacks"] == 1
    assert s.stats()["_store"]["disk_rows"] == 1
    s.audit()
    s.close()


def test_counters_are_shared_and_cannot_be_replaced(tmp_path):
    """The placement engine and the prefetches count into the store's own counters: a
    replaced object would silently stop counting, so replacing it is refused."""
    import pytest

    s = _store(tmp_path)
    with pytest.raises(AttributeError):
        s.counters = hm.observe.stats.Counters(2)
    s.lookup("a", torch.tensor([1, 2]))
    s.lookup("a", torch.tensor([3]))  # 3 misses, one row down to host
    t = s.counters.table[0]
    assert int(t[hm.Tier.DEVICE, hm.observe.stats.Stat.MISSES]) == 3 and int(t[hm.Tier.DEVICE, hm.observe.stats.Stat.EVICTIONS]) == 1
    assert s.stats()["a"]["device"]["misses"] == 3
    s.close()


def test_update_after_lookup_of_other_table_is_not_confused(tmp_path):
    s = _store(tmp_path, device_rows=8, host_rows=8)
    ids = torch.tensor([1, 2])
    a0, b0 = s.lookup("a", ids).clone(), s.lookup("b", ids).clone()
    s.lookup("a", ids)
    s.update("b", ids, torch.ones(2, 2))  # same tensor, other table: must not reuse a's placement
    assert torch.equal(s.lookup("a", ids), a0)
    assert torch.allclose(s.lookup("b", ids), b0 - 1)
    ids2 = ids.clone()
    s.lookup("a", ids2)
    ids2[0] = 3  # mutated in place after lookup: the memo is dropped
    s.update("a", ids2, torch.ones(2, 2))
    assert torch.allclose(s.lookup("a", torch.tensor([1, 2, 3]))[1:], torch.stack([a0[1] - 1, s.lookup("a", torch.tensor([3]))[0]]))
    assert torch.equal(s.lookup("a", torch.tensor([1])), a0[:1])
    s.close()


def test_write_last_duplicate_wins_and_resets_state(tmp_path):
    s = _store(tmp_path, optimizer=hm.Adagrad(lr=0.1), device_rows=8, host_rows=8)
    s.update("a", torch.tensor([5]), torch.ones(1, 2))
    s.write("a", torch.tensor([5, 5]), torch.tensor([[1.0, 1.0], [2.0, 3.0]]))
    assert s.lookup("a", torch.tensor([5])).tolist() == [[2.0, 3.0]]
    s.update("a", torch.tensor([5]), torch.ones(1, 2))  # fresh accumulator: full lr step
    assert torch.allclose(s.lookup("a", torch.tensor([5])), torch.tensor([[1.9, 2.9]]))
    s.close()


def test_import_records_sets_rows_in_every_tier_where_they_are(tmp_path):
    """Rows on the device tier, on the host tier, on LMDB and never written, imported in
    one call (a duplicate: the last record wins): each takes its record where it is, and
    no row changes tier."""
    s = _store(tmp_path, optimizer=hm.Adagrad(lr=0.1), device_rows=2, host_rows=2)
    s.update("a", torch.tensor([1, 2]), torch.ones(2, 2))  # dirty: 1, 2 on device
    s.lookup("a", torch.tensor([3, 4]))  # 1, 2 down to host
    s.lookup("a", torch.tensor([5, 6]))  # 3, 4 down to host, 1, 2 (dirty) to LMDB
    ids = torch.tensor([1, 3, 5, 9, 5])  # LMDB, host, device, never written; 5 twice
    before = s.where("a", ids[:4]).tolist()
    assert before == [int(hm.Tier.DISK), int(hm.Tier.HOST), int(hm.Tier.DEVICE), int(hm.Tier.INIT)]
    rec = torch.arange(20, dtype=torch.float32).reshape(5, 4)  # Adagrad: weights | state
    s.import_records("a", ids, rec)
    assert s.where("a", ids[:3]).tolist() == before[:3]  # nothing moved
    assert int(s.where("a", ids[3:4])) == int(hm.Tier.DISK)  # written straight to LMDB
    got_ids, got = s.export("a")  # flushes: the resident rows' records too
    by_id = dict(zip(got_ids.tolist(), got))
    for i, r in ((1, rec[0]), (3, rec[1]), (5, rec[4]), (9, rec[3])):
        assert torch.equal(by_id[i], r)
    s.close()


def test_initial_rows_are_deterministic_and_seeded(tmp_path):
    a = _store(tmp_path, seed=1)
    r1 = a.lookup("b", torch.tensor([2**62, 7]))
    a.close()
    b = hm.HierarchicalStore([hm.TableSpec("a", 100, 2), hm.TableSpec("b", None, 2)],
                             hm.StoreConfig(path=tmp_path / "other", seed=1, device_rows=2, host_rows=2))
    assert torch.equal(b.lookup("b", torch.tensor([7, 2**62])), r1.flip(0))
    c = hm.HierarchicalStore([hm.TableSpec("a", 100, 2), hm.TableSpec("b", None, 2)],
                             hm.StoreConfig(path=tmp_path / "seed2", seed=2, device_rows=2, host_rows=2))
    assert not torch.equal(c.lookup("b", torch.tensor([2**62, 7])), r1)
    bound = 1 / 2**0.5
    assert bool((r1.abs() <= bound).all())
    b.close()
    c.close()


def test_batch_wider_than_device_is_served_from_host(tmp_path):
    s = _store(tmp_path, device_rows=2, host_rows=6)
    ids = torch.arange(7)
    before = s.lookup("a", ids[:1]).clone()
    rows = s.lookup("a", ids)
    assert rows.shape == (7, 2) and torch.equal(rows[:1], before)
    s.update("a", ids, torch.ones(7, 2))
    assert torch.allclose(s.lookup("a", ids[:1]), before - 1)
    s.audit()
    s.close()
