"""StoreConfig(write_combine=N): eviction write-backs held in memory, committed together.

Training through combined write-backs equals committing each and a flat reference; reads
(misses, ``where``, ``count``) see the rows held, newer than LMDB's copies; the rows are
committed when the limit would be passed, and with the next flush, checkpoint or write,
in its transaction; a commit that fails raises typed and changes nothing (the rows stay
held); ``clear`` drops them.  (A SIGKILL with rows held: tests/test_durability.py.)"""

from __future__ import annotations

import errno

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.tiers.combine import WriteCombiner
from reference import FlatStore


@pytest.fixture(autouse=True)
def _torch_plane(monkeypatch):
    """Bit-for-bit comparisons with tests/reference.py's torch-op FlatStore: the torch data
    plane (the compiled one equals it to ~1 ulp, tests/test_dataplane.py)."""
    monkeypatch.setenv("HIERMEM_DATA_PLANE", "torch")


from test_write_behind import TABLES, batches, snapshot, step  # the same tables, batches and steps


def make(path, combine, **kw):
    cfg = hm.StoreConfig(path=path, device_rows=kw.pop("device_rows", 6), host_rows=kw.pop("host_rows", 12),
                         optimizer=hm.Adagrad(lr=0.1), seed=3, write_combine=combine, **kw)
    return hm.HierarchicalStore(TABLES, cfg)


def commits(s) -> int:
    return s._disk.write_seconds.count


def lmdb_rows(s, ti) -> dict[int, np.ndarray]:
    """The records LMDB itself holds for table ``ti`` (no queue, no combining)."""
    db = s._disk.table_database(ti)
    out = {}
    with s._disk.env.begin(db=db, buffers=False) as txn:
        for k, v in txn.cursor():
            out[int(np.frombuffer(k, dtype="<u8")[0].astype(np.int64))] = np.frombuffer(v, dtype="<f4")
    return out


@pytest.mark.parametrize("combine", [1, 7, 64, 4096])
def test_training_equals_each_write_back_and_the_reference(tmp_path, combine):
    held, each = make(tmp_path / "held", combine), make(tmp_path / "each", 0)
    ref = FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    most = 0
    for name, ids, noise in batches(150):
        step([held, each, ref], name, ids, noise)
        most = max(most, held.stats()["_store"]["disk_combined_rows"])
        assert held._disk.combine.n <= combine or combine < 10  # a write-back of more rows than the limit commits whole
    st, st_each = held.stats()["_store"], each.stats()["_store"]
    assert st["bytes_host_to_disk"] == st_each["bytes_host_to_disk"] > 0  # the same rows went down
    if combine >= 64:
        assert most > 0 and commits(held) < commits(each) // 2  # fewer, larger transactions
    a, b, r = snapshot(held), snapshot(each), snapshot(ref)
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], r[k])
    held.close()
    each.close()
    s = hm.HierarchicalStore.open(tmp_path / "held")  # close flushed what was held
    try:
        got = snapshot(s)
        assert all(torch.equal(got[k], r[k]) for k in got)
    finally:
        s.close()


def _evict_into_held(s, ref):
    """Train until rows are held whose LMDB copy is stale or missing; returns them."""
    for name, ids, noise in batches(200, seed=1):
        step([s, ref], name, ids, noise)
        if s._disk.combined >= 8:
            return s._disk.combine.groups()
    raise AssertionError("no rows were held")


def test_reads_see_held_rows_newer_than_lmdb(tmp_path):
    s, ref = make(tmp_path / "s", 4096), FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    try:
        groups = _evict_into_held(s, ref)
        assert s._disk.queued == 0
        stale = 0
        for ti, ids, rec in groups:
            spec, in_lmdb = TABLES[ti], lmdb_rows(s, ti)
            found, got = s._disk.read(ti, ids, s.widths[ti])
            assert found.all() and np.array_equal(got, rec)
            want = ref.lookup(spec.name, torch.from_numpy(ids.copy()))
            assert torch.equal(torch.from_numpy(got[:, :spec.dim]), want)
            stale += sum(int(i) not in in_lmdb or not np.array_equal(in_lmdb[int(i)], r) for i, r in zip(ids, rec))
            assert (s.where(spec.name, torch.from_numpy(ids.copy())) == int(hm.Tier.DISK)).all()
        assert stale > 0  # LMDB alone would have answered wrong
        # count: every row of the disk tier once, held or in LMDB
        on_disk = set()
        for ti in range(len(TABLES)):
            on_disk |= {(ti, i) for i in lmdb_rows(s, ti)}
        on_disk |= {(ti, int(i)) for ti, ids, _ in groups for i in ids}
        assert s.stats()["_store"]["disk_rows"] == len(on_disk)
        # the store's own reads of those rows (misses brought up) give the latest values
        got, want = snapshot(s), snapshot(ref)
        assert all(torch.equal(got[k], want[k]) for k in got)
    finally:
        s.close()


def test_held_rows_commit_at_the_limit_and_with_flush(tmp_path):
    s, ref = make(tmp_path / "s", 40), FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    try:
        n0, seen_commit = commits(s), False
        for name, ids, noise in batches(120, seed=2):
            before, c0 = s._disk.combine.n, commits(s)
            step([s, ref], name, ids, noise)
            assert s._disk.combine.n <= 40
            if commits(s) > c0:
                seen_commit = True
                assert s._disk.combine.n <= before or before == 0  # what was held went down first
        assert seen_commit and commits(s) > n0
        groups = s._disk.combine.groups()
        assert groups
        s.flush()  # the held rows go down in the flush's own transaction
        assert s._disk.combined == 0
        for ti, ids, rec in groups:
            in_lmdb = lmdb_rows(s, ti)
            spec = TABLES[ti]
            want = ref.lookup(spec.name, torch.from_numpy(ids.copy()))
            for i, w in zip(ids.tolist(), want):  # evicted once, or later and flushed: LMDB has the latest
                assert np.array_equal(in_lmdb[i][:spec.dim], w.numpy())
    finally:
        s.close()


def test_writes_over_held_rows_win(tmp_path):
    """``write``/``import_records`` of rows that are held (not resident): the new values win."""
    s, ref = make(tmp_path / "s", 4096), FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    try:
        groups = _evict_into_held(s, ref)
        ti, ids, _ = next(g for g in groups if g[0] == 0)
        ids = torch.from_numpy(ids.copy())
        new = torch.arange(ids.numel() * 4, dtype=torch.float32).reshape(-1, 4)
        s.import_records("b", ids, torch.cat([new, torch.ones(ids.numel(), 4)], 1))  # Adagrad: weights | state
        assert torch.equal(s.lookup("b", ids), new)
        s.flush()
        in_lmdb = lmdb_rows(s, 0)
        assert all(np.array_equal(in_lmdb[i][:4], new[j].numpy()) for j, i in enumerate(ids.tolist()))
    finally:
        s.close()


class _FailingCommit:
    """Wraps an LMDB environment: write transactions fail to commit with ``error``."""

    def __init__(self, env, error):
        self._env, self.error, self.commits = env, error, 0

    def begin(self, write=False, **kw):
        txn = self._env.begin(write=write, **kw)
        if not write:
            return txn
        outer = self

        class Txn:
            def __enter__(self):
                txn.__enter__()
                return txn

            def __exit__(self, et, e, tb):
                if et is None:
                    outer.commits += 1
                    txn.abort()
                    raise outer.error
                return txn.__exit__(et, e, tb)
        return Txn()

    def __getattr__(self, name):
        return getattr(self._env, name)


@pytest.mark.parametrize("error,typed", [
    (lmdb.DiskError(errno.ENOSPC, "mdb_txn_commit: No space left on device"), hm.DiskFullError),
    (lmdb.Error("mdb_txn_commit: Input/output error"), hm.HierMemError),
], ids=["disk-full", "eio"])
def test_failed_commit_of_held_rows_changes_nothing(tmp_path, error, typed):
    s, twin = make(tmp_path / "s", 48), make(tmp_path / "twin", 48)
    ref = FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    try:
        it = batches(400, seed=3)
        while True:  # until the next step's write-back would pass the limit (a commit)
            name, ids, noise = next(it)
            step([s, twin, ref], name, ids, noise)
            if s._disk.combine.n > 40:
                break
        held = [(t, k.copy(), r.copy()) for t, k, r in s._disk.combine.groups()]
        real = s._disk.env
        s._disk.env = fake = _FailingCommit(real, error)
        raised = 0
        try:
            for _ in range(20):  # steps that evict: one of them must commit, and fails
                name, ids, noise = next(it)
                try:
                    step([s], name, ids, noise)
                except typed:
                    raised += 1
                    break
                step([twin, ref], name, ids, noise)
        finally:
            s._disk.env = real
        assert raised == 1 and fake.commits >= 1
        after = s._disk.combine.groups()
        assert len(after) == len(held) and all(
            a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2]) for a, b in zip(after, held))
        got, want = snapshot(s), snapshot(twin)
        assert all(torch.equal(got[k], want[k]) for k in got)
        s.flush()
        got = snapshot(s)
        assert all(torch.equal(got[k], want[k]) for k in got)
    finally:
        s.close()
        twin.close()


def test_clear_drops_held_rows(tmp_path):
    s, ref = make(tmp_path / "s", 4096), FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    try:
        _evict_into_held(s, ref)
        s.clear()
        assert s._disk.combined == 0 and s.stats()["_store"]["disk_rows"] == 0
        fresh = FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
        got, want = snapshot(s), snapshot(fresh)
        assert all(torch.equal(got[k], want[k]) for k in got)
    finally:
        s.close()


def test_config(tmp_path):
    for bad in (-1, True, 2.5, "4096"):
        with pytest.raises((hm.InvalidArgumentError, hm.InvalidTypeError)):
            hm.StoreConfig(path=tmp_path / "x", write_combine=bad)
    s = make(tmp_path / "s", 4096, sync_writebacks=True)  # every commit synced: none held back
    assert s._disk.combine is None
    s.close()
    s = make(tmp_path / "w", 4096, write_behind=True)  # the writer thread commits them instead
    assert s._disk.combine is None
    s.close()
    s = hm.HierarchicalStore.open(tmp_path / "s", write_combine=16)
    assert s._disk.combine is not None and s._disk.combine.limit == 16
    s.close()
    s = hm.HierarchicalStore.open(tmp_path / "s", write_combine=0)
    assert s._disk.combine is None
    s.close()


def test_default_limit_follows_the_store_size(tmp_path):
    """``write_combine=None`` (the default): three times the LMDB leaf pages the rows fill,
    within [16384 rows, 64 MiB of records]; an explicit limit is kept as given."""
    from hiermem.tiers.combine import COMBINE_MAX_BYTES, COMBINE_MIN, default_limit

    assert hm.StoreConfig(path=tmp_path / "c").write_combine is None
    assert default_limit([1000], [16]) == COMBINE_MIN  # a small store: the floor
    # 960k rows of 16 floats: 80 bytes a node, 51 a page, 18.8k pages -> 56k rows
    assert default_limit([120_000] * 8, [16] * 8) == int(3 * 960_000 * 80 / 4080)
    assert default_limit([120_000] * 8, [16] * 8) == default_limit([960_000], [16])  # pages add up
    assert default_limit([10**8], [128]) == COMBINE_MAX_BYTES // (4 * 128)  # the cap, by the widest record
    assert default_limit([10**8, 10], [16, 128]) == COMBINE_MAX_BYTES // (4 * 128)
    assert default_limit([None, 1000], [16, 16]) == COMBINE_MIN  # unbounded ids: rows unknown, none counted
    big = [hm.TableSpec("big", 600_000, 16)]
    s = hm.HierarchicalStore(big, hm.StoreConfig(path=tmp_path / "d", device_rows=8, host_rows=16, seed=1))
    try:  # SGD: records are the dim alone
        assert s._disk.combine.limit == default_limit([600_000], [16]) > COMBINE_MIN
    finally:
        s.close()
    opt = hm.Adagrad(lr=0.1)  # state as wide as the row: twice the bytes, half the rows a page
    s = hm.HierarchicalStore(big, hm.StoreConfig(path=tmp_path / "a", device_rows=8, host_rows=16, seed=1,
                                                 optimizer=opt))
    try:
        assert s._disk.combine.limit == default_limit([600_000], [32]) > default_limit([600_000], [16])
    finally:
        s.close()
    s = hm.HierarchicalStore(big, hm.StoreConfig(path=tmp_path / "e", device_rows=8, host_rows=16, seed=1,
                                                 write_combine=100))
    try:
        assert s._disk.combine.limit == 100
    finally:
        s.close()
    s = hm.HierarchicalStore.open(tmp_path / "e")  # the limit is not part of the layout: reopened, the default
    try:
        assert s._disk.combine.limit == default_limit([600_000], [16])
    finally:
        s.close()


def test_combiner_matches_a_dict():
    """The merge keeps each row once, its newest record, sorted; lookups by binary search."""
    rng = np.random.default_rng(0)
    c, want = WriteCombiner(1 << 20), {}
    widths = [2, 3, 5]
    for _ in range(60):
        m = int(rng.integers(0, 40))
        t = rng.integers(0, 3, m)
        k = rng.choice(np.array([-(2**63), -7, 0, 1, 5, 2**62, 2**63 - 1] + list(range(20, 60))), m)
        rec = rng.random((m, 5), dtype=np.float32)
        c.put(t, k, rec, widths)
        for i in range(m):
            want[(int(t[i]), int(k[i]))] = rec[i]
        assert c.rows == len(want)
        for ti, w in enumerate(widths):
            q = np.array([-(2**63), -7, -1, 0, 5, 19, 21, 2**62, 2**63 - 1, 3, 40], dtype=np.int64)
            found, out = np.zeros(q.size, bool), np.zeros((q.size, w), np.float32)
            c.lookup(ti, q, w, found, out)
            for j, i in enumerate(q.tolist()):
                assert found[j] == ((ti, i) in want)
                if found[j]:
                    assert np.array_equal(out[j], want[(ti, i)][:w])
    got = {(ti, int(i)): r for ti, ids, rec in c.groups() for i, r in zip(ids, rec)}
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[key], want[key][:widths[key[0]]]) for key in want)
    for ti, ids, _ in c.groups():
        assert (np.diff(ids) > 0).all()


def test_read_many_equals_reads_table_by_table(tmp_path):
    """One transaction for a step's misses of every table: the same records as
    ``DiskTier.read`` per table (ids unsorted, repeated, missing; held rows; a table never
    written; an empty group)."""
    from hiermem.tiers.disk import DiskTier

    d = DiskTier(tmp_path / "d", create=True, tables=3, combine=64)
    try:
        d.write([(0, np.arange(0, 40, 2), np.arange(80, dtype=np.float32).reshape(20, 4)),
                 (1, np.array([5, 9, 2**62]), np.ones((3, 3), np.float32))])
        d.enqueue_rows(np.array([0, 0, 1]), np.array([4, 7, 9]), np.full((3, 4), 7.0, np.float32), [4, 3, 2])
        assert d.combined == 3
        groups = [(0, np.array([38, 4, 3, 4, 0, 7, 100]), 4), (1, np.array([2**62, 9, 8]), 3),
                  (2, np.array([1, 2]), 2), (1, np.array([], dtype=np.int64), 3)]
        got = d.read_many(groups)
        for (t, ids, w), (f, r) in zip(groups, got):
            f1, r1 = d.read(t, ids, w)
            assert np.array_equal(f, f1) and np.array_equal(r, r1)
        f, r = got[0]
        assert f.tolist() == [True, True, False, True, True, True, False]
        assert r[1].tolist() == [7.0] * 4 and r[0].tolist() == [76.0, 77.0, 78.0, 79.0]  # held, LMDB
        assert got[1][0].tolist() == [True, True, False] and got[1][1][1].tolist() == [7.0] * 3
        assert not got[2][0].any() and got[3][0].size == 0
    finally:
        d.close()
