"""The disk tier's record format (version 2): a database per table with native uint64
integer keys; version-1 stores migrated on a writable open, refused by read-only ones;
unknown versions refused by name (issue 16)."""

from __future__ import annotations

import json
import sys

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.cli.main import main as cli_main
from hiermem.tiers import disk as disk_mod
from hiermem.tiers.disk import DiskTier
from hiermem.tiers.records import FORMAT_VERSION, encode_keys_v1

TABLES = [hm.TableSpec("wide", 300, 16), hm.TableSpec("narrow", 200, 4), hm.TableSpec("third", 100, 8)]


def _cfg(path, **kw):
    return hm.StoreConfig(path=path, device_rows=64, host_rows=64, optimizer=hm.Adagrad(lr=0.1), **kw)


def _populate(path) -> dict[str, torch.Tensor]:
    """A closed store at ``path`` with some rows of every table written; every row's
    record as the store serves it."""
    g = torch.Generator().manual_seed(0)
    with hm.HierarchicalStore(TABLES, _cfg(path)) as s:
        for t in TABLES:
            for i in range(0, t.num_rows, 50):
                ids = torch.arange(i, i + 50, 2)  # every other row: some are never written
                s.write(t.name, ids, torch.randn(ids.numel(), t.dim, generator=g))
        return {t.name: _all(s, t) for t in TABLES}


def _all(s, t) -> torch.Tensor:
    """Every row's weights of table ``t`` as store or read-only handle ``s`` serves them."""
    return torch.cat([s.lookup(t.name, torch.arange(i, min(t.num_rows, i + 50))) for i in range(0, t.num_rows, 50)])


def _names(path) -> set[bytes]:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as txn:
            return {k for k, _ in txn.cursor()}
    finally:
        env.close()


def _meta(path) -> dict:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin(db=env.open_db(b"meta", create=False)) as txn:
            return json.loads(txn.get(b"store"))
    finally:
        env.close()


def to_v1(path, partial: bool = False) -> None:
    """Rewrite the (closed) version-2 store at ``path`` as version 1 wrote it: one ``rows``
    database of 12-byte big-endian ``(table, id)`` keys, metadata version 1.  ``partial``:
    keep the table databases, holding wrong values (a migration killed midway)."""
    env = lmdb.open(str(path), max_dbs=64, map_size=1 << 30)
    try:
        with env.begin() as txn:
            names = sorted(k for k, _ in txn.cursor() if k.startswith(b"t"))
        dbs = {int(n[1:]): env.open_db(n, create=False, integerkey=True) for n in names}
        rows = env.open_db(b"rows")
        meta_db = env.open_db(b"meta", create=False)
        with env.begin(write=True) as txn:
            for t, db in dbs.items():
                kv = list(txn.cursor(db=db))
                ids = np.frombuffer(b"".join(k for k, _ in kv), dtype=np.uint64)
                keys = encode_keys_v1(np.full(len(ids), t, dtype=np.uint32), ids).view("V12").tolist()
                txn.cursor(db=rows).putmulti(zip(keys, [v for _, v in kv]))
                if partial:  # a wrong copy of the first half
                    cur = txn.cursor(db=db)
                    for k, v in kv[:len(kv) // 2]:
                        cur.put(k, b"\xff" * len(v))
                else:
                    txn.drop(db, delete=True)
            meta = json.loads(txn.get(b"store", db=meta_db))
            meta["version"] = 1
            txn.put(b"store", json.dumps(meta, sort_keys=True).encode(), db=meta_db)
    finally:
        env.close()


def test_rows_live_in_a_database_per_table_with_native_integer_keys(tmp_path):
    _populate(tmp_path / "s")
    assert _names(tmp_path / "s") == {b"meta", b"t0", b"t1", b"t2"}
    assert _meta(tmp_path / "s")["version"] == FORMAT_VERSION == 2
    env = lmdb.open(str(tmp_path / "s"), readonly=True, lock=False, max_dbs=64)
    try:
        db = env.open_db(b"t1", create=False, integerkey=True)
        with env.begin() as txn:
            assert db.flags(txn)["integerkey"]
            kv = list(txn.cursor(db=db))
    finally:
        env.close()
    ids = [int.from_bytes(k, sys.byteorder) for k, _ in kv]
    assert all(len(k) == 8 for k, _ in kv) and ids == list(range(0, 200, 2))
    opt = hm.Adagrad(lr=0.1)
    assert {len(v) for _, v in kv} == {4 * (4 + opt.state_width(4))}


def test_version_1_store_migrates_on_open_keeping_every_record(tmp_path, monkeypatch):
    path = tmp_path / "s"
    before = _populate(path)
    to_v1(path)
    assert _names(path) == {b"meta", b"rows"}
    monkeypatch.setattr(disk_mod, "MIGRATE_CHUNK", 7)  # many transactions, chunks across tables
    with hm.HierarchicalStore.open(path) as s:
        for t in TABLES:
            assert torch.equal(_all(s, t), before[t.name])
    assert _names(path) == {b"meta", b"t0", b"t1", b"t2"}
    assert _meta(path)["version"] == 2
    with hm.HierarchicalStore.open(path, readonly=True) as r:  # readers read the migrated store
        for t in TABLES:
            assert torch.equal(_all(r, t), before[t.name])


def test_a_migration_killed_midway_starts_over(tmp_path):
    path = tmp_path / "s"
    before = _populate(path)
    to_v1(path, partial=True)  # rows in both layouts, the table databases' half wrong
    with hm.HierarchicalStore.open(path) as s:
        for t in TABLES:
            assert torch.equal(_all(s, t), before[t.name])
    assert b"rows" not in _names(path)


def test_read_only_open_of_a_version_1_store_is_refused_naming_the_version(tmp_path):
    path = tmp_path / "s"
    before = _populate(path)
    to_v1(path)
    with pytest.raises(hm.StoreVersionError) as ei:
        hm.HierarchicalStore.open(path, readonly=True)
    assert ei.value.version == 1 and "version 1" in str(ei.value) and str(path) in str(ei.value)
    assert isinstance(ei.value, hm.StoreFormatError)
    assert _names(path) == {b"meta", b"rows"}  # untouched
    out = tmp_path / "t.npy"
    assert cli_main(["export", str(path), "--table", "wide", "--out", str(out)]) != 0
    hm.HierarchicalStore.open(path).close()  # a writable open migrates it
    with hm.HierarchicalStore.open(path, readonly=True) as r:
        assert torch.equal(_all(r, TABLES[1]), before["narrow"])
    assert cli_main(["export", str(path), "--table", "wide", "--out", str(out)]) == 0
    a = np.load(out)
    assert list(a["id"]) == list(range(0, 300, 2))
    assert np.array_equal(a["weight"], before["wide"][::2].numpy())


@pytest.mark.parametrize("version", [3, 0, "2"])
def test_unknown_version_is_refused_naming_it(tmp_path, version):
    path = tmp_path / "s"
    _populate(path)
    env = lmdb.open(str(path), max_dbs=64, map_size=1 << 30)
    try:
        meta_db = env.open_db(b"meta", create=False)
        with env.begin(write=True, db=meta_db) as txn:
            meta = json.loads(txn.get(b"store"))
            meta["version"] = version
            txn.put(b"store", json.dumps(meta).encode())
    finally:
        env.close()
    for ro in (False, True):
        with pytest.raises(hm.StoreVersionError) as ei:
            hm.HierarchicalStore.open(path, readonly=ro)
        assert ei.value.version == version and f"version {version!r}" in str(ei.value)


def test_restoring_a_version_1_checkpoint_migrates_the_copy_only(tmp_path):
    path = tmp_path / "s"
    before = _populate(path)
    with hm.HierarchicalStore.open(path) as s:
        s.checkpoint(tmp_path / "ck")
    to_v1(tmp_path / "ck")  # a checkpoint written before version 2
    with hm.HierarchicalStore.restore(tmp_path / "ck", tmp_path / "r") as s:
        for t in TABLES:
            assert torch.equal(_all(s, t), before[t.name])
        ids, rec = s.export("third")
        assert ids.tolist() == list(range(0, 100, 2))
    assert _names(tmp_path / "ck") == {b"meta", b"rows"}
    assert _names(tmp_path / "r") == {b"meta", b"t0", b"t1", b"t2"}  # the copy migrated


def test_writes_append_past_the_last_key_and_put_the_rest(tmp_path):
    d = DiskTier(tmp_path / "d", create=True, sync=False, tables=2)
    try:
        def rec(ids):
            return np.repeat(np.asarray(ids, dtype=np.float32)[:, None], 3, axis=1)
        d.write([(0, np.array([10, 5]), rec([10, 5]))])
        d.write([(0, np.array([20, 1, 7, 12, 2 ** 63 + 3], dtype=np.uint64), rec([20, 1, 7, 12, 3])),
                 (1, np.array([4]), rec([4]))])
        d.write([(0, np.array([7, 30]), rec([70, 30]))])
        ids = np.array([1, 5, 7, 10, 12, 20, 30, 2 ** 63 + 3, 6], dtype=np.uint64)
        found, got = d.read(0, ids, 3)
        assert found.tolist() == [True] * 8 + [False]
        assert got[:, 0].tolist() == [1, 5, 70, 10, 12, 20, 30, 3, 0]
        found, got = d.read(1, np.array([4, 0]), 3)
        assert found.tolist() == [True, False] and got[0, 0] == 4
        assert d.count() == 9
    finally:
        d.close()
