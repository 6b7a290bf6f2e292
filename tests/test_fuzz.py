"""Bad input, fuzzed: hypothesis drives every public method of a store with arbitrary ids
(huge, negative, every dtype, numpy and Python containers, 0-d/2-d, empty), gradient and
value tensors of any shape and dtype with NaN/inf, offsets that do not add up,
per-sample weights of the wrong length and unknown modes or tables.

The oracle is written from the documented contract, independently of the store's own
checks: a call whose arguments are valid must succeed and return what a flat in-memory
reference returns; any other call must raise a :class:`hm.HierMemError` and change no
row.  After every refused call, and at the end, every row of the (small) universe is
compared with the reference.
"""

from __future__ import annotations

import math
import shutil
import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import hiermem as hm
from reference import FlatStore

DEV, HOST = 4, 16
TABLES = [hm.TableSpec("b", 30, 3), hm.TableSpec("h", None, 2)]
SPECS = {s.name: s for s in TABLES}
HASHED = [0, 5, 77, 2**31, 2**40 + 1, 2**62, 2**63 - 1, 123456789]
UNIVERSE = {"b": list(range(30)), "h": HASHED}
EDGE_IDS = [-1, -7, -2**31, -2**63, 30, 31, 255, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
INT_TORCH = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OTHER_DTYPES = [torch.int64, torch.int32, torch.bool, torch.complex64]
ATOL = 1e-5


# -- strategies -----------------------------------------------------------------------------
def _cast(vals: list[int], kind: str):
    """``vals`` as a container of ``kind`` (values wrapped or rounded to fit it)."""
    if kind == "list":
        return vals
    if kind.startswith("np-"):
        dt = np.dtype(kind[3:])
        if dt.kind in "iu":
            info = np.iinfo(dt)
            return np.array([min(max(v, info.min), info.max) for v in vals], dtype=dt)
        return np.array(vals, dtype=np.float64).astype(dt)
    dt = getattr(torch, kind)
    if dt in INT_TORCH:
        info = torch.iinfo(dt)
        return torch.tensor([min(max(v, info.min), info.max) for v in vals], dtype=dt)
    if dt == torch.bool:
        return torch.tensor([v % 2 == 1 for v in vals], dtype=dt)
    return torch.tensor([float(v) for v in vals], dtype=dt)


ID_KINDS = (["int64"] * 6 + ["int32", "int16", "int8", "uint8", "float32", "float64", "bool", "complex64",
                              "np-int64", "np-int64", "np-uint64", "np-int32", "np-uint8", "np-float64", "np-bool",
                              "list"])


@st.composite
def id_args(draw, table: str, clean: bool = False):
    """(ids argument, expected int64 ids or None when the argument is invalid); ``clean``:
    always a valid one."""
    pool = st.sampled_from(UNIVERSE[table])
    if clean:
        ids = torch.tensor(draw(st.lists(pool, max_size=16)), dtype=torch.int64)
        return ids, ids
    vals = draw(st.lists(pool if draw(st.integers(0, 4)) else pool | st.sampled_from(EDGE_IDS), max_size=22))
    kind = draw(st.sampled_from(ID_KINDS))
    ids = _cast(vals, kind)
    shape = draw(st.sampled_from(["1d"] * 8 + ["0d", "2d"]))
    if shape != "1d" and isinstance(ids, (torch.Tensor, np.ndarray)):
        ids = ids.reshape(-1, 1) if shape == "2d" else (ids[:1].reshape(()) if len(vals) else ids.reshape(0, 1))
    return ids, expected_ids(ids, SPECS[table])


def expected_ids(ids, spec: hm.TableSpec) -> torch.Tensor | None:
    """The contract: a 1-D integer torch tensor or numpy array, every id in the table."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            return None
        vals = [int(v) for v in ids.tolist()]
    elif isinstance(ids, torch.Tensor):
        if ids.dtype not in INT_TORCH or ids.dim() != 1:
            return None
        vals = ids.tolist()
    else:
        return None
    if any(v < 0 or v > spec.max_id for v in vals):
        return None
    return torch.tensor(vals, dtype=torch.int64)


SPECIALS = [math.nan, math.inf, -math.inf, 1e30, 3e38, 1e300]


@st.composite
def float_tensor(draw, shape: tuple[int, ...], right_shape: tuple[int, ...], clean: bool = False):
    """A tensor meant to have ``right_shape``: usually right, sometimes off by one, another
    rank or another dtype; values occasionally NaN/inf/huge (``clean``: right shape and dtype)."""
    r = draw(st.integers(2 if clean else 0, 9))
    if r == 0:
        shape = tuple(max(0, d + draw(st.sampled_from([-1, 1]))) for d in right_shape)
    elif r == 1:
        shape = (int(np.prod(right_shape)),) if len(right_shape) != 1 else right_shape + (1,)
    else:
        shape = right_shape
    dtype = draw(st.sampled_from(FLOAT_DTYPES * 3 + OTHER_DTYPES)) if draw(st.integers(0, 3)) == 0 \
        and not clean else torch.float32
    seed = draw(st.integers(0, 2**16))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if t.numel() and draw(st.integers(0, 5)) == 0:
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    if dtype == torch.bool:
        return t > 0
    return t.to(dtype)


def valid_float(t, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A floating tensor of ``shape``, as float32 (None if it is not that)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
        return None
    return t.detach().to(torch.float32)


@st.composite
def offsets_arg(draw, n: int, clean: bool = False):
    """(offsets argument, valid?)."""
    r = draw(st.integers(0, 5 if clean else 9))
    if r <= 5:  # valid: sorted cut points starting at 0
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
        vals = [0] + cuts
    elif r == 6:
        vals = []
    elif r == 7:
        vals = [draw(st.integers(1, n + 2))] + sorted(draw(st.lists(st.integers(0, n + 2), max_size=3)))
    elif r == 8:
        vals = [0] + draw(st.lists(st.integers(0, n + 3), min_size=1, max_size=4))
    else:
        vals = [0, n + draw(st.integers(1, 3))]
    dtype = draw(st.sampled_from([torch.int64, torch.int32] if clean else
                                 [torch.int64] * 6 + [torch.int32, torch.float32, torch.int16]))
    offsets = torch.tensor(vals, dtype=dtype)
    if draw(st.integers(0, 15)) == 0 and not clean:
        offsets = offsets.reshape(-1, 1)
    ok = (dtype in (torch.int64, torch.int32) and offsets.dim() == 1 and len(vals) > 0 and vals[0] == 0
          and vals[-1] <= n and all(a <= b for a, b in zip(vals, vals[1:])))
    return offsets, ok


def bag_scale(n: int, offsets: torch.Tensor, mode: str, psw: torch.Tensor | None):
    lengths = torch.diff(offsets.long(), append=torch.tensor([n]))
    bag = torch.repeat_interleave(torch.arange(offsets.numel()), lengths)
    if psw is not None:
        return bag, psw.to(torch.float32)
    if mode == "mean":
        return bag, (1.0 / lengths.clamp(min=1).float())[bag]
    return bag, None


# -- the machine ------------------------------------------------------------------------------
tables = st.sampled_from(["b", "h"])


class FuzzMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lfu"]), opt=st.sampled_from(["sgd", "adagrad"]))
    def setup(self, policy, opt):
        self.dir = tempfile.mkdtemp(prefix="hm-fuzz-")
        optimizer = hm.SGD(lr=0.5) if opt == "sgd" else hm.Adagrad(lr=0.3)
        self.cfg = hm.StoreConfig(path=f"{self.dir}/s", device_rows=DEV, host_rows=HOST, policy=policy,
                                  optimizer=optimizer, seed=9)
        self.store = hm.HierarchicalStore(TABLES, self.cfg)
        self.ref = FlatStore(TABLES, optimizer, seed=9)
        self.refused = 0

    def teardown(self):
        if hasattr(self, "store"):
            try:
                self.same_as_reference()
            finally:
                self.store.close()
                shutil.rmtree(self.dir, ignore_errors=True)

    def same_as_reference(self):
        for name, ids in UNIVERSE.items():
            t = torch.tensor(ids, dtype=torch.int64)
            got = torch.cat([self.store.lookup(name, t[i:i + DEV + HOST]) for i in range(0, t.numel(), DEV + HOST)])
            assert torch.allclose(got, self.ref.lookup(name, t), atol=ATOL, rtol=1e-5), f"table {name} differs"

    def call(self, valid: bool | None, fn):
        """Run ``fn`` against the contract: ``valid`` True must succeed, False must raise a
        typed error and change nothing, None (valid arguments whose result may be NaN) may
        do either.  Returns ``(accepted, fn's result)``."""
        try:
            out = fn()
        except hm.HierMemError as e:
            assert valid is not True, f"valid call refused: {type(e).__name__}: {e}"
            assert str(e)
            self.refused += 1
            self.same_as_reference()
            return False, None
        assert valid is not False, "invalid call accepted"
        return True, out

    @staticmethod
    def fits(ids: torch.Tensor) -> bool:
        return torch.unique(ids).numel() <= DEV + HOST

    @rule(data=st.data(), table=tables)
    def lookup(self, data, table):
        ids, want = data.draw(id_args(table))
        ok = want is not None and self.fits(want)
        accepted, out = self.call(ok, lambda: self.store.lookup(table, ids))
        if accepted:
            assert out.dtype == torch.float32 and out.shape == (want.numel(), SPECS[table].dim)
            assert torch.allclose(out, self.ref.lookup(table, want), atol=ATOL, rtol=1e-5)

    def _grad_sums_finite(self, ids: torch.Tensor, g: torch.Tensor) -> bool:
        if ids.numel() == 0:
            return True
        _, inv = torch.unique(ids, return_inverse=True)
        return bool(torch.isfinite(torch.zeros(int(inv.max()) + 1, g.shape[1]).index_add_(0, inv, g)).all())

    @rule(data=st.data(), table=tables, via_lookup=st.booleans())
    def update(self, data, table, via_lookup):
        ids, want = data.draw(id_args(table, data.draw(st.booleans())))
        dim = SPECS[table].dim
        n = want.numel() if want is not None else 2
        grads = data.draw(float_tensor((n, dim), (n, dim), want is not None and data.draw(st.booleans())))
        g = valid_float(grads, (n, dim)) if want is not None else None
        ok = g is not None and self._grad_sums_finite(want, g) and (want.numel() == 0 or self.fits(want))
        if via_lookup and want is not None and self.fits(want):
            self.store.lookup(table, ids)  # the training pattern: update reuses the lookup's placement
        if self.call(ok, lambda: self.store.update(table, ids, grads))[0]:
            self.ref.update(table, want, g)

    @rule(data=st.data(), table=tables)
    def write(self, data, table):
        ids, want = data.draw(id_args(table))
        dim = SPECS[table].dim
        n = want.numel() if want is not None else 1
        values = data.draw(float_tensor((n, dim), (n, dim)))
        v = valid_float(values, (n, dim)) if want is not None else None
        ok = v is not None and bool(torch.isfinite(v).all()) and (n == 0 or self.fits(want))
        self.call(ok, lambda: self.store.write(table, ids, values))
        if ok and n:
            self.ref.write(table, want, v)

    def _pooled_args(self, data, table):
        clean = data.draw(st.booleans())  # half the calls: valid ids, mode and weights
        ids, want = data.draw(id_args(table, clean))
        n = want.numel() if want is not None else 3
        offsets, off_ok = data.draw(offsets_arg(n, clean))
        mode = data.draw(st.sampled_from(["sum", "mean"] if clean else ["sum"] * 4 + ["mean"] * 2 + ["max", "SUM", None]))
        psw, psw_ok = None, True
        if data.draw(st.integers(0, 2)) == 0 and not (clean and mode == "mean"):
            psw = data.draw(float_tensor((n,), (n,)))
            psw_ok = valid_float(psw, (n,)) is not None and mode == "sum"
        ok = want is not None and off_ok and mode in ("sum", "mean") and psw_ok and (n == 0 or self.fits(want))
        return ids, want, offsets, mode, psw, ok, clean

    @rule(data=st.data(), table=tables)
    def lookup_pooled(self, data, table):
        ids, want, offsets, mode, psw, ok, _ = self._pooled_args(data, table)
        nan_psw = ok and psw is not None and not bool(torch.isfinite(psw.float()).all())
        accepted, out = self.call(None if nan_psw else ok, lambda: self.store.lookup_pooled(
            table, ids, offsets, mode=mode, per_sample_weights=psw))
        if not accepted:
            return
        dim, n = SPECS[table].dim, want.numel()
        bag, scale = bag_scale(n, offsets, mode, psw)
        rows = self.ref.lookup(table, want)
        if scale is not None:
            rows = rows * scale.unsqueeze(1)
        ref = torch.zeros(offsets.numel(), dim).index_add_(0, bag, rows)
        assert out.shape == (offsets.numel(), dim)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4, equal_nan=True)

    @rule(data=st.data(), table=tables)
    def update_pooled(self, data, table):
        ids, want, offsets, mode, psw, ok, clean = self._pooled_args(data, table)
        dim = SPECS[table].dim
        nb = offsets.numel() if offsets.dim() == 1 else 1
        grad_out = data.draw(float_tensor((nb, dim), (nb, dim), clean))
        go = valid_float(grad_out, (nb, dim))
        g = None
        if ok and go is not None:
            bag, scale = bag_scale(want.numel(), offsets, mode, psw)
            g = go.index_select(0, bag)
            if scale is not None:
                g = g * scale.unsqueeze(1)
        ok = g is not None and self._grad_sums_finite(want, g)
        self.call(ok, lambda: self.store.update_pooled(table, ids, offsets, grad_out, mode=mode,
                                                       per_sample_weights=psw))
        if ok:
            self.ref.update(table, want, g)

    @rule(data=st.data(), table=st.sampled_from(["b", "h", "B", "nope", "", None, 0]))
    def where(self, data, table):
        spec_table = table if table in SPECS else "b"
        ids, want = data.draw(id_args(spec_table))
        ok = want is not None and table in SPECS
        accepted, out = self.call(ok, lambda: self.store.where(table, ids))
        if accepted:
            assert out.shape == (want.numel(),) and bool(((out >= 0) & (out <= int(hm.Tier.INIT))).all())
            written = torch.tensor([int(i) in self.ref.rows[table] for i in want.tolist()], dtype=torch.bool)
            assert not bool((out[written] == int(hm.Tier.INIT)).any()), "a written row is reported as INIT"

    @rule(table=st.sampled_from(["B", "nope", "", None, 3, ("b",)]), data=st.data())
    def unknown_table(self, table, data):
        ids, _ = data.draw(id_args("b"))
        self.call(False, lambda: self.store.lookup(table, ids))

    @rule()
    def flush(self):
        self.store.flush()

    @rule()
    def reopen(self):
        self.store.close()
        self.store = hm.HierarchicalStore.open(self.cfg.path)


FuzzMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                         suppress_health_check=list(HealthCheck))
TestFuzzPublicAPI = FuzzMachine.TestCase


def test_oracle_classifies_ids_like_the_contract():
    """The fuzz oracle's own rules, checked on hand-picked arguments (so the fuzzer cannot
    pass by agreeing with a wrong oracle)."""
    b, h = SPECS["b"], SPECS["h"]
    assert expected_ids(torch.tensor([0, 29]), b).tolist() == [0, 29]
    assert expected_ids(torch.tensor([30]), b) is None
    assert expected_ids(torch.tensor([-1]), h) is None
    assert expected_ids(np.array([2**63], dtype=np.uint64), h) is None
    assert expected_ids(np.array([2**63 - 1], dtype=np.uint64), h).tolist() == [2**63 - 1]
    assert expected_ids(torch.tensor([1.0]), b) is None
    assert expected_ids(torch.tensor([True]), b) is None
    assert expected_ids([1, 2], b) is None
    assert expected_ids(torch.tensor([[1]]), b) is None
    assert expected_ids(torch.empty(0, dtype=torch.int32), b).numel() == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused_by_every_writer(tmp_path, bad):
    s = hm.HierarchicalStore(TABLES, hm.StoreConfig(path=tmp_path / "s", device_rows=DEV, host_rows=HOST))
    try:
        before = s.lookup("b", torch.arange(5)).clone()
        v = torch.ones(5, 3)
        v[2, 1] = bad
        for call in (lambda: s.update("b", torch.arange(5), v), lambda: s.write("b", torch.arange(5), v),
                     lambda: s.update_pooled("b", torch.arange(5), torch.tensor([0, 2]), v[:2] * 0 + bad),
                     lambda: s.update_pooled("b", torch.arange(5), torch.tensor([0]), torch.ones(1, 3),
                                             per_sample_weights=torch.tensor([1.0, bad, 1.0, 1.0, 1.0]))):
            with pytest.raises(hm.NonFiniteGradientError):
                call()
        assert torch.equal(s.lookup("b", torch.arange(5)), before)
    finally:
        s.close()


# -- SparseFeatures: lengths that do not add up -------------------------------------------------
from hypothesis import given  # noqa: E402

INT_KINDS = [torch.int64, torch.int32, torch.int16, torch.uint8]


@st.composite
def sparse_args(draw):
    keys = draw(st.sampled_from([("a",), ("a", "b"), ("a", "b", "c"), ("a", "a"), (), "ab", ("a", 3)]))
    nk = max(1, len(keys)) if not isinstance(keys, str) else 1
    B = draw(st.integers(0, 4))
    lengths = draw(st.lists(st.integers(0, 4) | st.sampled_from([-1, -3]) if draw(st.integers(0, 5)) == 0
                            else st.integers(0, 4), min_size=nk * B, max_size=nk * B))
    if draw(st.integers(0, 5)) == 0:  # not a multiple of the keys
        lengths = lengths + [draw(st.integers(0, 3))]
    total = sum(lengths)
    nvals = max(0, total if draw(st.integers(0, 3)) else total + draw(st.sampled_from([-2, -1, 1, 2])))
    values = torch.arange(nvals).to(draw(st.sampled_from(INT_KINDS * 3 + [torch.float32, torch.bool])))
    lengths_t = torch.tensor(lengths, dtype=draw(st.sampled_from(INT_KINDS * 3 + [torch.float32])))
    if draw(st.integers(0, 10)) == 0:
        values = values.reshape(-1, 1)
    weights = None
    r = draw(st.integers(0, 3))
    if r == 1:
        weights = torch.rand(nvals)
    elif r == 2:
        weights = torch.rand(max(0, nvals + draw(st.sampled_from([-1, 1]))))
    elif r == 3:
        weights = torch.ones(nvals, dtype=torch.int64)
    return keys, values, lengths_t, weights, lengths


def _sparse_valid(keys, values, lengths_t, weights, lengths) -> bool:
    if isinstance(keys, str) or not keys or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        return False
    ints = all(t.dim() == 1 and t.dtype in INT_KINDS for t in (values, lengths_t))
    if not ints or len(lengths) % len(keys) or any(v < 0 for v in lengths) or sum(lengths) != values.numel():
        return False
    return weights is None or (weights.is_floating_point() and tuple(weights.shape) == (values.numel(),))


@settings(max_examples=300, deadline=None)
@given(sparse_args())
def test_sparse_features_accept_exactly_the_batches_that_add_up(args):
    keys, values, lengths_t, weights, lengths = args
    ok = _sparse_valid(*args)
    try:
        f = hm.SparseFeatures(keys, values, lengths_t, weights)
    except hm.HierMemError as e:
        assert not ok, f"valid batch refused: {e}"
        assert isinstance(e, (TypeError, ValueError))
        return
    assert ok, "a batch whose parts do not fit was accepted"
    B = len(lengths) // len(keys)
    assert f.batch_size == B
    assert f.offsets().tolist() == np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()
    d, start = f.to_dict(), 0
    for i, k in enumerate(keys):
        lens = lengths[i * B:(i + 1) * B]
        vals, offs, w = d[k]
        assert vals.tolist() == values[start:start + sum(lens)].tolist()
        assert offs.tolist() == (np.cumsum(lens, dtype=np.int64) - lens).tolist()
        if weights is not None:
            assert torch.equal(w, weights[start:start + sum(lens)])
        start += sum(lens)


# -- trace files, corrupted at random -------------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from hiermem.errors import TraceFormatError  # noqa: E402
from hiermem.observe.trace import TraceWriter, load_trace  # noqa: E402

_TRACE_DIR = Path(tempfile.mkdtemp(prefix="hm-fuzz-trace-"))


def _valid_trace() -> Path:
    """A 3-table trace of 3 chunks, with per-id table indices (the ``tabs`` files)."""
    path = _TRACE_DIR / "good"
    if not (path / "manifest.json").exists():
        g = np.random.default_rng(0)
        w = TraceWriter(path, ["a", "b", "c"], chunk_accesses=40)
        for _ in range(12):
            lens = g.integers(0, 6, 3)
            tabs = g.permutation(np.repeat(np.arange(3, dtype=np.int16), lens))
            w.add_flat(g.integers(0, 2**40, int(lens.sum())), lens.astype(np.int64), tabs)
        w.close()
    return path


@st.composite
def corruption(draw):
    files = sorted(p.name for p in _valid_trace().iterdir())
    return (draw(st.sampled_from(files)), draw(st.sampled_from(["truncate", "flip", "append", "delete", "empty",
                                                                "directory"])),
            draw(st.floats(0, 1)), draw(st.integers(0, 255)))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(corruption())
def test_a_corrupted_trace_loads_consistently_or_raises_trace_format_error(c):
    """Any one file of a trace truncated, a byte changed, garbage appended, deleted,
    emptied or replaced by a directory: load_trace raises TraceFormatError naming a file
    of the trace, or returns a trace whose parts agree (a changed id value inside a chunk
    cannot be detected: traces carry no checksums).  Never another exception."""
    name, how, where, byte = c
    d = Path(tempfile.mkdtemp(dir=_TRACE_DIR))
    t = d / "t"
    shutil.copytree(_valid_trace(), t)
    f = t / name
    raw = f.read_bytes()
    pos = min(int(where * len(raw)), max(0, len(raw) - 1))
    if how == "truncate":
        f.write_bytes(raw[:pos])
    elif how == "flip":
        f.write_bytes(raw[:pos] + bytes([byte if byte != raw[pos] else (byte + 1) % 256]) + raw[pos + 1:])
    elif how == "append":
        f.write_bytes(raw + os.urandom(1 + int(where * 64)))
    elif how == "delete":
        f.unlink()
    elif how == "empty":
        f.write_bytes(b"")
    else:
        f.unlink()
        f.mkdir()
    try:
        tr = load_trace(t)
    except TraceFormatError as e:
        assert str(t) in str(e)
    else:
        assert int(tr.lens.sum()) == tr.accesses and tr.lens.shape[1] == len(tr.tables)
        assert tr.batch_offsets[-1] == tr.accesses and (tr.ids >= 0).all()
        if tr.tabs is not None:
            assert tr.tabs.size == tr.accesses and ((tr.tabs >= 0) & (tr.tabs < len(tr.tables))).all()
        assert sum(sum(x.size for x in b) for b in tr.batches()) == tr.accesses
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_chunk_header_claiming_a_huge_array_is_refused_before_allocating(tmp_path):
    """A corrupt .npy header saying 10**12 ids used to make np.load allocate 7 TiB
    (MemoryError); it is a TraceFormatError naming the chunk."""
    src = _valid_trace()
    t = tmp_path / "t"
    shutil.copytree(src, t)
    chunk = t / json.loads((t / "manifest.json").read_text())["chunks"][0]["ids"]
    raw = chunk.read_bytes()
    hlen = int.from_bytes(raw[8:10], "little")
    header = raw[10:10 + hlen].decode()
    shape = header[header.index("'shape': (") + 10:header.index(")", header.index("'shape': ("))]
    huge = header.replace(f"'shape': ({shape})", "'shape': (1000000000000,)")
    huge = huge.rstrip().ljust(hlen - 1) + "\n"
    assert len(huge) == hlen
    chunk.write_bytes(raw[:10] + huge.encode() + raw[10 + hlen:])
    with pytest.raises(TraceFormatError) as ei:
        load_trace(t)
    assert chunk.name in str(ei.value)
