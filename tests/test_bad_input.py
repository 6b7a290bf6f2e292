"""Bad input: every case raises its typed error and changes no stored row.

Each store case runs on a fresh copy of one small store whose tiers are full of dirty rows
(device_rows=4, host_rows=16), then compares every row's value with the values of a twin
store with the same history that never saw the bad call.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

import hiermem as hm

DEV, HOST = 4, 16
BOUNDED_ROWS = 40
HASHED_IDS = torch.tensor([0, 1, 7, 12345, 2**31, 2**40 + 3, 2**62, 2**63 - 1, 99, 1000, 31337, 2**33], dtype=torch.int64)


def tables():
    return [hm.TableSpec("bounded", BOUNDED_ROWS, 4), hm.TableSpec("hashed", None, 3)]


def config(path, **kw):
    return hm.StoreConfig(path=path, device_rows=kw.pop("device_rows", DEV), host_rows=kw.pop("host_rows", HOST),
                          optimizer=kw.pop("optimizer", hm.Adagrad(lr=0.1)), seed=5, **kw)


def snapshot(store):
    """Values of every bounded row and of the hashed ids (lookups in chunks that fit the tiers)."""
    out = {}
    for name, ids in (("bounded", torch.arange(BOUNDED_ROWS)), ("hashed", HASHED_IDS)):
        out[name] = torch.cat([store.lookup(name, ids[i:i + DEV + HOST]).clone()
                               for i in range(0, ids.numel(), DEV + HOST)])
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"table {name}: a stored row changed"


def prime(store):
    """A deterministic history that leaves both tiers full of dirty rows (and rows on disk)."""
    g = torch.Generator().manual_seed(3)
    for step in range(8):
        if step % 2:
            ids = HASHED_IDS[torch.randint(0, HASHED_IDS.numel(), (6,), generator=g)]
            emb = store.lookup("hashed", ids)
            store.update("hashed", ids, emb + torch.randn(emb.shape, generator=g))
        else:
            ids = torch.randint(0, BOUNDED_ROWS, (10,), generator=g)
            if step % 4:
                store.write("bounded", ids, torch.randn(10, 4, generator=g))
            else:
                store.update("bounded", ids, torch.randn(10, 4, generator=g))
    st = store.stats()["_store"]
    assert st["device_dirty"] > 0 and st["host_dirty"] > 0


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A closed store with rows on disk, and the values a copy holds after prime()."""
    path = tmp_path_factory.mktemp("bad_input") / "store"
    s = hm.HierarchicalStore(tables(), config(path))
    g = torch.Generator().manual_seed(0)
    s.write("bounded", torch.arange(0, 20), torch.randn(20, 4, generator=g))
    s.update("hashed", HASHED_IDS[:6], torch.randn(6, 3, generator=g))
    s.close()
    twin = hm.HierarchicalStore.open(_copy(path, path.parent / "twin"))
    prime(twin)
    expected = snapshot(twin)
    twin.close()
    return path, expected


def _copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock.mdb"))
    return dst


@pytest.fixture
def primed(template, tmp_path):
    """(open store with dirty tiers, the values it must still hold)."""
    path, expected = template
    s = hm.HierarchicalStore.open(_copy(path, tmp_path / "store"))
    prime(s)
    yield s, expected
    s.close()


B = "bounded"
H = "hashed"
i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
ones = lambda n, d=4: torch.ones(n, d)  # noqa: E731
FRESH21 = torch.arange(BOUNDED_ROWS - 21, BOUNDED_ROWS)  # 21 distinct rows > DEV + HOST
FRESH21H = torch.arange(21, dtype=torch.int64) * 1_000_003 + 17


def _grads_with(value, n=3, d=4, dtype=torch.float32):
    g = torch.ones(n, d, dtype=dtype)
    g[1, 2] = value
    return g


STORE_CASES = [
    # ids out of range / negative
    ("lookup-id=num_rows", lambda s: s.lookup(B, i64(0, BOUNDED_ROWS)), hm.InvalidIdError),
    ("lookup-id-huge", lambda s: s.lookup(B, i64(2**62)), hm.InvalidIdError),
    ("lookup-negative", lambda s: s.lookup(B, i64(3, -1)), hm.InvalidIdError),
    ("lookup-int64-min", lambda s: s.lookup(H, i64(-2**63)), hm.InvalidIdError),
    ("lookup-hashed-negative", lambda s: s.lookup(H, i64(5, -5)), hm.InvalidIdError),
    ("lookup-int32-negative", lambda s: s.lookup(B, torch.tensor([1, -2], dtype=torch.int32)), hm.InvalidIdError),
    ("lookup-numpy-uint64-above-int64", lambda s: s.lookup(H, np.array([1, 2**63], dtype=np.uint64)),
     hm.InvalidIdError),
    ("update-oob", lambda s: s.update(B, i64(1, 2, BOUNDED_ROWS), ones(3)), hm.InvalidIdError),
    ("update-negative", lambda s: s.update(B, i64(-1, 2, 3), ones(3)), hm.InvalidIdError),
    ("update-hashed-negative", lambda s: s.update(H, i64(1, -7), ones(2, 3)), hm.InvalidIdError),
    ("write-oob", lambda s: s.write(B, i64(0, 100), ones(2)), hm.InvalidIdError),
    ("write-negative", lambda s: s.write(B, i64(-3), ones(1)), hm.InvalidIdError),
    ("where-oob", lambda s: s.where(B, i64(BOUNDED_ROWS)), hm.InvalidIdError),
    # id types and shapes
    ("lookup-float-ids", lambda s: s.lookup(B, torch.tensor([1.0, 2.0])), hm.InvalidTypeError),
    ("lookup-float64-ids", lambda s: s.lookup(B, torch.tensor([1.0], dtype=torch.float64)), hm.InvalidTypeError),
    ("lookup-bool-ids", lambda s: s.lookup(B, torch.tensor([True, False])), hm.InvalidTypeError),
    ("lookup-complex-ids", lambda s: s.lookup(B, torch.tensor([1 + 0j])), hm.InvalidTypeError),
    ("lookup-numpy-float-ids", lambda s: s.lookup(B, np.array([1.0, 2.0])), hm.InvalidTypeError),
    ("lookup-numpy-bool-ids", lambda s: s.lookup(B, np.array([True])), hm.InvalidTypeError),
    ("lookup-list-ids", lambda s: s.lookup(B, [1, 2]), hm.InvalidTypeError),
    ("lookup-tuple-ids", lambda s: s.lookup(B, (1, 2)), hm.InvalidTypeError),
    ("lookup-int-ids", lambda s: s.lookup(B, 3), hm.InvalidTypeError),
    ("lookup-none-ids", lambda s: s.lookup(B, None), hm.InvalidTypeError),
    ("lookup-2d-ids", lambda s: s.lookup(B, torch.tensor([[1, 2], [3, 4]])), hm.InvalidArgumentError),
    ("lookup-0d-ids", lambda s: s.lookup(B, torch.tensor(3)), hm.InvalidArgumentError),
    ("update-float-ids", lambda s: s.update(B, torch.tensor([1.0]), ones(1)), hm.InvalidTypeError),
    ("update-bool-ids", lambda s: s.update(B, torch.tensor([True]), ones(1)), hm.InvalidTypeError),
    ("update-2d-ids", lambda s: s.update(B, torch.tensor([[1], [2]]), ones(2)), hm.InvalidArgumentError),
    ("update-list-ids", lambda s: s.update(B, [1], ones(1)), hm.InvalidTypeError),
    ("write-float-ids", lambda s: s.write(B, torch.tensor([1.5]), ones(1)), hm.InvalidTypeError),
    ("write-bool-ids", lambda s: s.write(B, torch.tensor([False]), ones(1)), hm.InvalidTypeError),
    ("write-2d-ids", lambda s: s.write(B, torch.tensor([[1, 2]]), ones(2)), hm.InvalidArgumentError),
    ("write-list-ids", lambda s: s.write(B, [1], ones(1)), hm.InvalidTypeError),
    ("where-float-ids", lambda s: s.where(B, torch.tensor([1.0])), hm.InvalidTypeError),
    # gradient shape / dim / type
    ("grad-too-many-rows", lambda s: s.update(B, i64(1, 2), ones(3)), hm.InvalidArgumentError),
    ("grad-too-few-rows", lambda s: s.update(B, i64(1, 2, 3), ones(2)), hm.InvalidArgumentError),
    ("grad-wrong-dim", lambda s: s.update(B, i64(1, 2), ones(2, 5)), hm.InvalidArgumentError),
    ("grad-other-tables-dim", lambda s: s.update(H, i64(1, 2), ones(2, 4)), hm.InvalidArgumentError),
    ("grad-1d", lambda s: s.update(B, i64(1, 2), torch.ones(8)), hm.InvalidArgumentError),
    ("grad-3d", lambda s: s.update(B, i64(1, 2), torch.ones(2, 4, 1)), hm.InvalidArgumentError),
    ("grad-transposed", lambda s: s.update(B, i64(1, 2, 3), ones(4, 3)), hm.InvalidArgumentError),
    ("grad-int64", lambda s: s.update(B, i64(1, 2), torch.ones(2, 4, dtype=torch.int64)), hm.InvalidTypeError),
    ("grad-int32", lambda s: s.update(B, i64(1, 2), torch.ones(2, 4, dtype=torch.int32)), hm.InvalidTypeError),
    ("grad-bool", lambda s: s.update(B, i64(1, 2), torch.ones(2, 4, dtype=torch.bool)), hm.InvalidTypeError),
    ("grad-complex", lambda s: s.update(B, i64(1, 2), torch.ones(2, 4, dtype=torch.complex64)), hm.InvalidTypeError),
    ("grad-numpy", lambda s: s.update(B, i64(1, 2), np.ones((2, 4), dtype=np.float32)), hm.InvalidTypeError),
    ("grad-list", lambda s: s.update(B, i64(1), [[1.0, 2.0, 3.0, 4.0]]), hm.InvalidTypeError),
    ("grad-empty-wrong-shape", lambda s: s.update(B, i64(), torch.ones(0)), hm.InvalidArgumentError),
    # non-finite gradients
    ("grad-nan", lambda s: s.update(B, i64(1, 2, 3), _grads_with(math.nan)), hm.NonFiniteGradientError),
    ("grad-inf", lambda s: s.update(B, i64(1, 2, 3), _grads_with(math.inf)), hm.NonFiniteGradientError),
    ("grad-neg-inf", lambda s: s.update(B, i64(1, 2, 3), _grads_with(-math.inf)), hm.NonFiniteGradientError),
    ("grad-nan-hashed", lambda s: s.update(H, i64(0, 7, 2**63 - 1), _grads_with(math.nan, d=3)),
     hm.NonFiniteGradientError),
    ("grad-nan-duplicates", lambda s: s.update(B, i64(5, 5, 5), _grads_with(math.nan)), hm.NonFiniteGradientError),
    ("grad-inf-minus-inf", lambda s: s.update(B, i64(5, 5),
                                              torch.tensor([[math.inf] * 4, [-math.inf] * 4])),
     hm.NonFiniteGradientError),
    ("grad-duplicate-sum-overflows", lambda s: s.update(B, i64(5, 5, 6), torch.full((3, 4), 3e38)),
     hm.NonFiniteGradientError),
    ("grad-all-nan", lambda s: s.update(B, i64(1, 2), torch.full((2, 4), math.nan)), hm.NonFiniteGradientError),
    ("grad-float16-inf", lambda s: s.update(B, i64(1, 2, 3), _grads_with(math.inf).half()),
     hm.NonFiniteGradientError),
    ("grad-float64-overflows-float32", lambda s: s.update(B, i64(1, 2, 3), _grads_with(1e300, dtype=torch.float64)),
     hm.NonFiniteGradientError),
    ("grad-nan-that-would-evict", lambda s: s.update(B, FRESH21[:20], _grads_with(math.nan, n=20)),
     hm.NonFiniteGradientError),
    ("write-nan", lambda s: s.write(B, i64(1, 2, 3), _grads_with(math.nan)), hm.NonFiniteGradientError),
    ("write-inf", lambda s: s.write(B, i64(1, 2, 3), _grads_with(math.inf)), hm.NonFiniteGradientError),
    ("write-neg-inf", lambda s: s.write(H, i64(1, 2, 3), _grads_with(-math.inf, d=3)), hm.NonFiniteGradientError),
    ("write-int-values", lambda s: s.write(B, i64(1, 2), torch.ones(2, 4, dtype=torch.int64)), hm.InvalidTypeError),
    ("write-wrong-shape", lambda s: s.write(B, i64(1, 2), ones(2, 3)), hm.InvalidArgumentError),
    ("write-list-values", lambda s: s.write(B, i64(1), [[0.0] * 4]), hm.InvalidTypeError),
    # unknown tables
    ("lookup-unknown-table", lambda s: s.lookup("nope", i64(1)), hm.UnknownTableError),
    ("update-unknown-table", lambda s: s.update("nope", i64(1), ones(1)), hm.UnknownTableError),
    ("write-unknown-table", lambda s: s.write("nope", i64(1), ones(1)), hm.UnknownTableError),
    ("where-unknown-table", lambda s: s.where("nope", i64(1)), hm.UnknownTableError),
    ("lookup-table-none", lambda s: s.lookup(None, i64(1)), hm.UnknownTableError),
    ("lookup-table-index", lambda s: s.lookup(0, i64(1)), hm.UnknownTableError),
    ("lookup-table-unhashable", lambda s: s.lookup(["bounded"], i64(1)), hm.UnknownTableError),
    ("lookup-table-wrong-case", lambda s: s.lookup("Bounded", i64(1)), hm.UnknownTableError),
    # batches larger than device + host
    ("lookup-capacity", lambda s: s.lookup(B, FRESH21), hm.CapacityError),
    ("lookup-capacity-hashed", lambda s: s.lookup(H, FRESH21H), hm.CapacityError),
    ("lookup-capacity-with-duplicates", lambda s: s.lookup(B, torch.cat((FRESH21, FRESH21))), hm.CapacityError),
    ("update-capacity", lambda s: s.update(B, FRESH21, ones(21)), hm.CapacityError),
    ("write-capacity", lambda s: s.write(B, FRESH21, ones(21)), hm.CapacityError),
    ("write-capacity-hashed", lambda s: s.write(H, FRESH21H, ones(21, 3)), hm.CapacityError),
    # bad policies and overrides when reopening the (open) store's path
    ("open-unknown-override", lambda s: hm.HierarchicalStore.open(s.path, dim=3), hm.InvalidArgumentError),
    ("second-store-unknown-policy", lambda s: hm.HierarchicalStore(tables(), config(s.path, policy="mru")),
     hm.PolicyFileError),
]


def test_cases_are_typed_errors():
    for name, _, exc in STORE_CASES:
        assert issubclass(exc, hm.HierMemError), name
    assert issubclass(hm.InvalidIdError, ValueError) and issubclass(hm.InvalidArgumentError, ValueError)
    assert issubclass(hm.InvalidTypeError, TypeError) and issubclass(hm.NonFiniteGradientError, ValueError)
    assert issubclass(hm.DiskFullError, OSError) and issubclass(hm.PolicyFileError, ValueError)
    assert issubclass(hm.LayoutMismatchError, hm.StoreFormatError)


@pytest.mark.parametrize("call,exc", [c[1:] for c in STORE_CASES], ids=[c[0] for c in STORE_CASES])
def test_bad_call_raises_and_changes_nothing(primed, call, exc):
    s, expected = primed
    stats = s.stats()["_store"]
    with pytest.raises(exc) as ei:
        call(s)
    assert isinstance(ei.value, hm.HierMemError)
    assert str(ei.value)  # a message
    after = s.stats()["_store"]
    for k in ("updates", "updated_rows", "flushes"):
        assert after[k] == stats[k], k
    assert not s.closed
    assert_same(snapshot(s), expected)


def test_capacity_error_message_names_the_tiers(primed):
    s, _ = primed
    with pytest.raises(hm.CapacityError) as ei:
        s.lookup(B, FRESH21)
    msg = str(ei.value)
    assert "21" in msg and str(DEV) in msg and str(HOST) in msg


def test_batch_exactly_filling_the_tiers_works(primed):
    s, expected = primed
    ids = torch.cat((FRESH21[:20], FRESH21[:20].flip(0)))  # 20 distinct rows, duplicated
    got = s.lookup(B, ids)
    assert got.shape == (40, 4)
    assert torch.equal(got[:20], expected[B][FRESH21[:20]])
    assert torch.equal(got[20:], got[:20].flip(0))


@pytest.mark.parametrize("bad", ["capacity", "nan", "shape", "unknown-table", "oob"])
def test_failed_update_is_not_an_optimizer_step(tmp_path, bad):
    """Adam's bias correction uses the table's step count: a refused update must not count."""
    stores = [hm.HierarchicalStore(tables(), config(tmp_path / n, optimizer=hm.Adam(lr=0.1))) for n in "ab"]
    a, b = stores
    try:
        for s in stores:
            s.update(B, i64(1, 2, 3), ones(3))
        with pytest.raises(hm.HierMemError):
            if bad == "capacity":
                a.update(B, FRESH21, ones(21))
            elif bad == "nan":
                a.update(B, i64(1, 2, 3), _grads_with(math.nan))
            elif bad == "shape":
                a.update(B, i64(1, 2, 3), ones(2))
            elif bad == "unknown-table":
                a.update("nope", i64(1, 2, 3), ones(3))
            else:
                a.update(B, i64(1, 2, BOUNDED_ROWS), ones(3))
        for s in stores:
            s.update(B, i64(1, 2, 3, 4), ones(4) * 0.5)
        assert torch.equal(a.lookup(B, torch.arange(8)), b.lookup(B, torch.arange(8)))
        assert a.stats()["_store"]["updates"] == b.stats()["_store"]["updates"] == 2
    finally:
        for s in stores:
            s.close()


# -- empty batches -------------------------------------------------------------------------
EMPTY_IDS = [
    ("int64", lambda: torch.empty(0, dtype=torch.int64)),
    ("int32", lambda: torch.empty(0, dtype=torch.int32)),
    ("uint8", lambda: torch.empty(0, dtype=torch.uint8)),
    ("numpy-int64", lambda: np.empty(0, dtype=np.int64)),
    ("numpy-uint64", lambda: np.empty(0, dtype=np.uint64)),
]


@pytest.mark.parametrize("make_ids", [e[1] for e in EMPTY_IDS], ids=[e[0] for e in EMPTY_IDS])
@pytest.mark.parametrize("table,dim", [(B, 4), (H, 3)])
def test_empty_ids_succeed_and_change_nothing(primed, make_ids, table, dim):
    s, expected = primed
    out = s.lookup(table, make_ids())
    assert out.shape == (0, dim) and out.dtype == torch.float32
    s.update(table, make_ids(), torch.empty(0, dim))
    s.update(table, make_ids(), torch.empty(0, dim, dtype=torch.float64))
    s.write(table, make_ids(), torch.empty(0, dim))
    assert s.where(table, make_ids()).shape == (0,)
    assert_same(snapshot(s), expected)


def test_empty_float_ids_are_still_a_type_error(primed):
    s, expected = primed
    with pytest.raises(hm.InvalidTypeError):
        s.lookup(B, torch.tensor([]))  # torch.tensor([]) is float32
    assert_same(snapshot(s), expected)


# -- use after close -----------------------------------------------------------------------
CLOSED_OPS = [
    ("lookup", lambda s: s.lookup(B, i64(1, 2))),
    ("lookup-empty", lambda s: s.lookup(B, i64())),
    ("update", lambda s: s.update(B, i64(1, 2), ones(2))),
    ("write", lambda s: s.write(B, i64(1, 2), ones(2))),
    ("flush", lambda s: s.flush()),
    ("where", lambda s: s.where(B, i64(1))),
    # validation does not come first: a closed store says it is closed
    ("lookup-bad-table", lambda s: s.lookup("nope", i64(1))),
    ("update-nan", lambda s: s.update(B, i64(1), torch.full((1, 4), math.nan))),
]


@pytest.mark.parametrize("call", [c[1] for c in CLOSED_OPS], ids=[c[0] for c in CLOSED_OPS])
def test_use_after_close_raises_store_closed(primed, call):
    s, expected = primed
    s.close()
    with pytest.raises(hm.StoreClosedError) as ei:
        call(s)
    assert str(s.path) in str(ei.value)
    s.close()  # idempotent
    assert s.closed
    s2 = hm.HierarchicalStore.open(s.path)
    try:
        assert_same(snapshot(s2), expected)
    finally:
        s2.close()
    with pytest.raises(hm.StoreClosedError):  # the old handle stays closed
        call(s)


def test_context_manager_closes(tmp_path):
    with hm.HierarchicalStore(tables(), config(tmp_path / "s")) as s:
        s.write(B, i64(1), ones(1))
    assert s.closed
    with pytest.raises(hm.StoreClosedError):
        s.lookup(B, i64(1))


# -- bad configuration ---------------------------------------------------------------------
def _store(path, **kw):
    return hm.HierarchicalStore(tables(), config(path, **kw))


CONFIG_CASES = [
    # capacities
    ("device_rows=0", lambda p: hm.StoreConfig(path=p, device_rows=0), hm.InvalidArgumentError),
    ("device_rows<0", lambda p: hm.StoreConfig(path=p, device_rows=-4), hm.InvalidArgumentError),
    ("host_rows=0", lambda p: hm.StoreConfig(path=p, host_rows=0), hm.InvalidArgumentError),
    ("host_rows<0", lambda p: hm.StoreConfig(path=p, host_rows=-1), hm.InvalidArgumentError),
    ("device_rows-float", lambda p: hm.StoreConfig(path=p, device_rows=4.0), hm.InvalidTypeError),
    ("device_rows-bool", lambda p: hm.StoreConfig(path=p, device_rows=True), hm.InvalidTypeError),
    ("host_rows-str", lambda p: hm.StoreConfig(path=p, host_rows="16"), hm.InvalidTypeError),
    # host_rows=None is the policy file's value, else the default (issue 19)
    ("prefetch_depth<0", lambda p: hm.StoreConfig(path=p, prefetch_depth=-1), hm.InvalidArgumentError),
    ("prefetch_depth-float", lambda p: hm.StoreConfig(path=p, prefetch_depth=1.5), hm.InvalidArgumentError),
    ("map_size-small", lambda p: hm.StoreConfig(path=p, map_size=(1 << 20) - 1), hm.InvalidArgumentError),
    ("map_size-0", lambda p: hm.StoreConfig(path=p, map_size=0), hm.InvalidArgumentError),
    ("map_size-negative", lambda p: hm.StoreConfig(path=p, map_size=-(1 << 30)), hm.InvalidArgumentError),
    ("map_size-float", lambda p: hm.StoreConfig(path=p, map_size=float(1 << 30)), hm.InvalidArgumentError),
    ("seed<0", lambda p: hm.StoreConfig(path=p, seed=-1), hm.InvalidArgumentError),
    ("seed-2**63", lambda p: hm.StoreConfig(path=p, seed=2**63), hm.InvalidArgumentError),
    ("seed-float", lambda p: hm.StoreConfig(path=p, seed=1.0), hm.InvalidArgumentError),
    ("seed-bool", lambda p: hm.StoreConfig(path=p, seed=True), hm.InvalidArgumentError),
    ("policy-int", lambda p: hm.StoreConfig(path=p, policy=3), hm.InvalidTypeError),
    ("policy-none", lambda p: hm.StoreConfig(path=p, policy=None), hm.InvalidTypeError),
    ("write_behind-int", lambda p: hm.StoreConfig(path=p, write_behind=1), hm.InvalidTypeError),
    ("io_process-str", lambda p: hm.StoreConfig(path=p, io_process="yes"), hm.InvalidTypeError),
    # table specs
    ("name-empty", lambda p: hm.TableSpec("", 10, 4), hm.InvalidArgumentError),
    ("name-space", lambda p: hm.TableSpec("a b", 10, 4), hm.InvalidArgumentError),
    ("name-digit-first", lambda p: hm.TableSpec("1abc", 10, 4), hm.InvalidArgumentError),
    ("name-slash", lambda p: hm.TableSpec("a/b", 10, 4), hm.InvalidArgumentError),
    ("name-too-long", lambda p: hm.TableSpec("t" * 129, 10, 4), hm.InvalidArgumentError),
    ("name-int", lambda p: hm.TableSpec(5, 10, 4), hm.InvalidArgumentError),
    ("name-none", lambda p: hm.TableSpec(None, 10, 4), hm.InvalidArgumentError),
    pytest.param("name-newline", lambda p: hm.TableSpec("abc\n", 10, 4), hm.InvalidArgumentError),
    ("num_rows=0", lambda p: hm.TableSpec("t", 0, 4), hm.InvalidArgumentError),
    ("num_rows<0", lambda p: hm.TableSpec("t", -1, 4), hm.InvalidArgumentError),
    ("num_rows-float", lambda p: hm.TableSpec("t", 10.0, 4), hm.InvalidTypeError),
    ("num_rows-bool", lambda p: hm.TableSpec("t", True, 4), hm.InvalidTypeError),
    ("num_rows-str", lambda p: hm.TableSpec("t", "10", 4), hm.InvalidTypeError),
    ("dim=0", lambda p: hm.TableSpec("t", 10, 0), hm.InvalidArgumentError),
    ("dim<0", lambda p: hm.TableSpec("t", 10, -3), hm.InvalidArgumentError),
    ("dim-float", lambda p: hm.TableSpec("t", 10, 4.0), hm.InvalidArgumentError),
    ("dim-bool", lambda p: hm.TableSpec("t", 10, True), hm.InvalidArgumentError),
    ("dim-none", lambda p: hm.TableSpec("t", 10, None), hm.InvalidArgumentError),
    ("init_bound-nan", lambda p: hm.TableSpec("t", 10, 4, init_bound=math.nan), hm.InvalidArgumentError),
    ("init_bound-inf", lambda p: hm.TableSpec("t", 10, 4, init_bound=math.inf), hm.InvalidArgumentError),
    ("init_bound<0", lambda p: hm.TableSpec("t", 10, 4, init_bound=-0.1), hm.InvalidArgumentError),
    pytest.param("init_bound-str", lambda p: hm.TableSpec("t", 10, 4, init_bound="0.1"), hm.InvalidTypeError),
    # optimizers
    ("sgd-lr<0", lambda p: hm.SGD(lr=-0.1), hm.InvalidArgumentError),
    ("sgd-lr-nan", lambda p: hm.SGD(lr=math.nan), hm.InvalidArgumentError),
    ("adagrad-eps<0", lambda p: hm.Adagrad(eps=-1.0), hm.InvalidArgumentError),
    ("adagrad-acc<0", lambda p: hm.Adagrad(initial_accumulator_value=-1.0), hm.InvalidArgumentError),
    ("rowwise-lr-inf", lambda p: hm.RowWiseAdagrad(lr=math.inf), hm.InvalidArgumentError),
    ("adam-beta1=1", lambda p: hm.Adam(beta1=1.0), hm.InvalidArgumentError),
    ("adam-beta2<0", lambda p: hm.Adam(beta2=-0.1), hm.InvalidArgumentError),
    pytest.param("sgd-lr-str", lambda p: hm.SGD(lr="0.1"), hm.InvalidTypeError),
    # the store itself
    ("config-not-storeconfig", lambda p: hm.HierarchicalStore(tables(), {"path": p}), hm.InvalidTypeError),
    ("no-tables", lambda p: hm.HierarchicalStore([], config(p)), hm.InvalidArgumentError),
    ("tables-not-specs", lambda p: hm.HierarchicalStore([{"name": "t", "num_rows": 3, "dim": 2}], config(p)),
     hm.InvalidArgumentError),
    ("duplicate-table-names", lambda p: hm.HierarchicalStore([hm.TableSpec("t", 3, 2), hm.TableSpec("t", None, 4)],
                                                             config(p)), hm.InvalidArgumentError),
    ("unknown-policy", lambda p: _store(p, policy="mru"), hm.PolicyFileError),
    ("policy-empty-name", lambda p: _store(p, policy=""), hm.PolicyFileError),
    ("policy-missing-toml", lambda p: _store(p, policy=str(p.parent / "missing.toml")), hm.PolicyFileError),
]
if not torch.cuda.is_available():
    CONFIG_CASES.append(("cuda-without-gpu", lambda p: _store(p, device="cuda"), hm.InvalidArgumentError))


def _case_args(c):
    return pytest.param(*c.values[1:], marks=c.marks, id=c.values[0]) if hasattr(c, "values") else \
        pytest.param(*c[1:], id=c[0])


@pytest.mark.parametrize("make,exc", [_case_args(c) for c in CONFIG_CASES])
def test_bad_configuration_is_refused(tmp_path, make, exc):
    path = tmp_path / "store"
    with pytest.raises(exc) as ei:
        make(path)
    assert isinstance(ei.value, hm.HierMemError)
    assert not path.exists()  # nothing was created


POLICY_FILES = [
    ("unknown-key", 'name = "lru"\ncapacity = 3\n'),
    ("unknown-keys", 'name = "lfu"\nfoo = 1\n[bar]\nx = 2\n'),
    ("unknown-name", 'name = "mru"\n'),
    ("no-name", 'description = "no name"\n'),
    ("name-not-str", "name = 3\n"),
    ("syntax", 'name = "lru\n'),
    ("params-not-table", 'name = "lru"\nparams = 3\n'),
    pytest.param('name = "lru"\n[params]\nwindow = 4\n', id="params-for-lru"),
    ("binary", b"\xff\xfe\x00name"),
]


@pytest.mark.parametrize("content", [c if hasattr(c, "values") else pytest.param(c[1], id=c[0])
                                     for c in POLICY_FILES])
def test_bad_policy_file_is_refused(tmp_path, primed, content):
    pf = tmp_path / "policy.toml"
    if isinstance(content, bytes):
        pf.write_bytes(content)
    else:
        pf.write_text(content)
    with pytest.raises(hm.PolicyFileError) as ei:
        hm.resolve_policy(str(pf))
    assert str(pf) in str(ei.value)
    with pytest.raises(hm.PolicyFileError):
        _store(tmp_path / "new", policy=str(pf))
    assert not (tmp_path / "new").exists()
    _reopen_with_bad_policy_changes_nothing(primed, str(pf))


def _reopen_with_bad_policy_changes_nothing(primed, policy):
    s, expected = primed
    s.close()
    with pytest.raises(hm.PolicyFileError):
        hm.HierarchicalStore.open(s.path, policy=policy)
    with pytest.raises(hm.PolicyFileError):
        hm.HierarchicalStore(tables(), config(s.path, policy=policy))
    s2 = hm.HierarchicalStore.open(s.path)
    try:
        assert_same(snapshot(s2), expected)
        assert s2.stats()["_store"]["policy"] == "lru"
    finally:
        s2.close()


@pytest.mark.parametrize("policy", ["mru", "LRU", "", "lru.toml"])
def test_reopen_with_unknown_policy_is_refused(primed, policy):
    _reopen_with_bad_policy_changes_nothing(primed, policy)


def test_policy_file_with_wrong_suffix_is_refused(tmp_path):
    pf = tmp_path / "policy.txt"
    pf.write_text('name = "lru"\n')
    with pytest.raises(hm.PolicyFileError):
        _store(tmp_path / "s", policy=str(pf))


def test_good_policy_file_is_accepted(tmp_path):
    pf = tmp_path / "policy.toml"
    pf.write_text('name = "lfu"\ndescription = "frequency"\ndevice_rows = 4\n[params]\n')
    with _store(tmp_path / "s", policy=str(pf)) as s:
        assert s.stats()["_store"]["policy"] == "lfu"


def test_numpy_ids_in_every_single_table_call(tmp_path):
    """ids given as numpy arrays (int32 and int64) work in lookup, lookup_pooled and the
    updates that follow them (the lookup's memo is keyed by torch tensors only)."""
    import numpy as np

    s = hm.HierarchicalStore([hm.TableSpec("t", 100, 4)],
                             hm.StoreConfig(path=tmp_path / "s", device_rows=8, host_rows=16))
    try:
        for dt in (np.int64, np.int32):
            ids = np.array([1, 2, 3, 2], dtype=dt)
            assert s.lookup("t", ids).shape == (4, 4)
            s.update("t", ids, torch.ones(4, 4))
            off = torch.tensor([0, 2])
            assert s.lookup_pooled("t", ids, off).shape == (2, 4)
            s.update_pooled("t", ids, off, torch.ones(2, 4))
    finally:
        s.close()
