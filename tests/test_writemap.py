"""StoreConfig(writemap=...): LMDB commits through the shared map over a data file
allocated in full (posix_fallocate), so a write into the map can never fault for lack
of disk.  Training is exact either way; the file is allocated for the whole map as it
grows; the file never shrinks under a reopen; a disk without room for the map raises
DiskFullError (writemap=True) or falls back to plain writes (the default); a filesystem
not known to honour preallocation gets plain writes by default."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import hiermem as hm
import hiermem.tiers.disk as disk_mod
import hiermem.tiers.mapgrow as mapgrow_mod
from conftest import mounted_tmpfs
from reference import FlatStore

@pytest.fixture(autouse=True)
def _torch_plane(monkeypatch):
    """These tests compare bit for bit with tests/reference.py's torch-op FlatStore: run the
    torch data plane (the compiled one equals it to ~1 ulp, tests/test_dataplane.py)."""
    monkeypatch.setenv("HIERMEM_DATA_PLANE", "torch")


SPEC = [hm.TableSpec("t", None, 32), hm.TableSpec("b", 500, 8)]


def make(path, **kw):
    cfg = hm.StoreConfig(path=path, device_rows=kw.pop("device_rows", 24), host_rows=kw.pop("host_rows", 64),
                         optimizer=hm.RowWiseAdagrad(lr=0.1), seed=5, **kw)
    return hm.HierarchicalStore(SPEC, cfg)


def allocated(path) -> int:
    return os.stat(path / "data.mdb").st_blocks * 512


def train(s, ref, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _ in range(3):
            ids = torch.randint(0, 40_000, (60,), generator=g) * 104729
            grads = torch.randn(60, 32, generator=g)
            s.update("t", ids, grads)
            ref.update("t", ids, grads)
        ids = torch.randint(0, 500, (40,), generator=g)
        emb = s.lookup("b", ids)
        assert torch.equal(emb, ref.lookup("b", ids))
        s.update("b", ids, 0.5 * emb)
        ref.update("b", ids, 0.5 * emb)


def check(s, ref):
    for name in ("t", "b"):
        ids = torch.tensor(sorted(ref.rows[name]), dtype=torch.int64)
        for i in range(0, ids.numel(), 80):
            assert torch.allclose(s.lookup(name, ids[i:i + 80]), ref.lookup(name, ids[i:i + 80]), atol=1e-6)


@pytest.mark.parametrize("wb", [False, True], ids=["sync-writebacks", "write-behind"])
@pytest.mark.parametrize("writemap", [True, False], ids=["writemap", "plain"])
def test_training_through_a_growing_map_is_exact_and_the_map_is_allocated(tmp_path, writemap, wb):
    opt = hm.RowWiseAdagrad(lr=0.1)
    # each write-back commits in its step (sync) or on the writer thread: the map grows
    # inside training (combined commits: tests/test_faults.py's map-full test)
    s = make(tmp_path / "s", writemap=writemap, write_behind=wb, map_size=1 << 20, write_combine=0)
    ref = FlatStore(SPEC, opt, seed=5)
    try:
        assert s.stats()["_store"]["disk_writemap"] is writemap
        sizes = set()
        for round_ in range(6):
            train(s, ref, 25, seed=round_)
            st = s.stats()["_store"]
            sizes.add(st["lmdb_map_size"])
            if writemap:  # every byte of the map is backed by the disk before LMDB writes there
                assert allocated(s.path) >= st["lmdb_map_size"]
        assert max(sizes) >= 4 << 20, sizes  # it grew, more than once
        check(s, ref)
        s.close()
        s = hm.HierarchicalStore.open(tmp_path / "s", writemap=writemap)
        check(s, ref)
    finally:
        s.close()


def test_reopening_with_a_smaller_map_never_shrinks_the_file(tmp_path):
    ref = FlatStore(SPEC, hm.RowWiseAdagrad(lr=0.1), seed=5)
    s = make(tmp_path / "s", writemap=True, map_size=1 << 20)
    train(s, ref, 120)
    s.close()
    size = (tmp_path / "s" / "data.mdb").stat().st_size
    assert size >= 4 << 20
    s = hm.HierarchicalStore.open(tmp_path / "s", map_size=1 << 20)
    try:
        assert s.stats()["_store"]["disk_writemap"]
        assert (tmp_path / "s" / "data.mdb").stat().st_size >= size
        assert s.stats()["_store"]["lmdb_map_size"] >= size
        check(s, ref)
        train(s, ref, 10, seed=9)
        check(s, ref)
    finally:
        s.close()
    # and a store written through the map reads back without it
    s = hm.HierarchicalStore.open(tmp_path / "s", writemap=False)
    try:
        assert not s.stats()["_store"]["disk_writemap"]
        check(s, ref)
    finally:
        s.close()


def test_filesystem_type_names_the_mount(tmp_path):
    fs = disk_mod.filesystem_type(tmp_path)
    with open("/proc/self/mountinfo") as f:
        types = {line.partition(" - ")[2].split()[0] for line in f if " - " in line}
    assert fs in types
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        assert disk_mod.filesystem_type(mnt) == "tmpfs"
        (mnt / "a b").mkdir()  # a path below the mount point, with a space in it
        assert disk_mod.filesystem_type(mnt / "a b") == "tmpfs"
        assert disk_mod.writemap_safe(mnt)


def test_default_is_off_where_preallocation_is_not_known_to_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(mapgrow_mod, "PREALLOCATING_FILESYSTEMS", frozenset())
    s = make(tmp_path / "s")
    try:
        assert not s.stats()["_store"]["disk_writemap"]
    finally:
        s.close()
    s = make(tmp_path / "forced", writemap=True)  # asked for: on anyway
    try:
        assert s.stats()["_store"]["disk_writemap"]
    finally:
        s.close()


def test_no_room_for_the_map(tmp_path):
    """A 4 MiB tmpfs and a 16 MiB map: writemap=True refuses (typed, no store left open);
    the default writes without the map, in the pages it uses."""
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        with pytest.raises(hm.DiskFullError) as ei:
            make(mnt / "forced", writemap=True, map_size=16 << 20)
        assert ei.value.errno == errno.ENOSPC and str(mnt / "forced") in str(ei.value)
        ref = FlatStore(SPEC, hm.RowWiseAdagrad(lr=0.1), seed=5)
        s = make(mnt / "auto", map_size=16 << 20)
        try:
            assert s.stats()["_store"]["disk_writemap"] is False
            train(s, ref, 20)
            s.flush()
            check(s, ref)
        finally:
            s.close()
        # the default on the same disk with a map that fits: through the map
        s = make(mnt / "small", map_size=1 << 20)
        try:
            assert s.stats()["_store"]["disk_writemap"] is True
        finally:
            s.close()


def test_a_full_disk_during_map_growth_changes_nothing_and_recovers(tmp_path):
    """The map cannot double on a nearly full tmpfs: the growth falls back to a smaller
    step, then to DiskFullError with the store as it was; room again, it carries on."""
    with mounted_tmpfs(tmp_path / "mnt", "6m") as mnt:
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (3 << 20))
        ref = FlatStore(SPEC, hm.RowWiseAdagrad(lr=0.1), seed=5)
        # each write-back its own commit: on a 6 MiB disk a combined one (thousands of rows,
        # whose copy-on-write pages LMDB keeps until it commits) would not fit after the refill
        s = make(mnt / "s", writemap=True, map_size=1 << 20, write_combine=0)
        g = torch.Generator().manual_seed(3)
        err = None
        try:
            for _ in range(400):
                ids = torch.randint(0, 10**9, (60,), generator=g)
                grads = torch.randn(60, 32, generator=g)
                try:
                    s.update("t", ids, grads)
                except hm.DiskFullError as e:
                    err = e
                    break
                ref.update("t", ids, grads)
            assert err is not None and err.errno == errno.ENOSPC
            assert allocated(s.path) >= s.stats()["_store"]["lmdb_map_size"]
            filler.unlink()  # room again (looking rows up evicts, which writes)
            check(s, ref)  # the failed update changed nothing
            train(s, ref, 10, seed=4)
            s.flush()
            check(s, ref)
            s.close()
            s = hm.HierarchicalStore.open(mnt / "s")
            check(s, ref)
        finally:
            s.close()


def test_writemap_must_be_a_bool_or_none(tmp_path):
    with pytest.raises(hm.InvalidTypeError):
        hm.StoreConfig(path=tmp_path / "s", writemap="yes")
    assert not (tmp_path / "s").exists()
