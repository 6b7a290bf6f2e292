"""CachedEmbeddingBagCollection and PrefetchPipeline: exact against plain nn.EmbeddingBag
training, pins under pressure, state dicts, checkpoints across a SIGKILL, thread stress."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hiermem as hm
from hiermem.nn.dlrm import DLRM, PlainEmbeddingBags

T, R, DIM, B = 4, 120, 8, 24


@pytest.fixture(autouse=True)
def watchdog():
    """No test here may hang: dump every thread's stack and exit after 240 s."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _tables():
    return [hm.TableSpec(f"t{i}", R, DIM) for i in range(T)]


def _batches(n, seed=1, weights=False):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        lengths = torch.randint(0, 4, (T * B,), generator=g)
        vals = (torch.rand(int(lengths.sum()), generator=g) ** 2 * R).long()  # skewed: hot rows repeat
        w = torch.rand(vals.numel(), generator=g) + 0.5 if weights else None
        dense = torch.randn(B, 13, generator=g)
        labels = (torch.rand(B, generator=g) < 0.3).float()
        yield dense, hm.SparseFeatures(tuple(f"t{i}" for i in range(T)), vals, lengths, w), labels


class RowWiseAdagradRef:
    """FBGEMM's row-wise Adagrad on nn.EmbeddingBag sparse gradients (the reference)."""

    def __init__(self, params, lr, eps):
        self.params, self.lr, self.eps = list(params), lr, eps
        self.acc = [torch.zeros(p.shape[0]) for p in self.params]

    def step(self):
        for p, acc in zip(self.params, self.acc):
            g = p.grad.coalesce()
            i, v = g.indices()[0], g.values()
            acc[i] += v.square().mean(1)
            p.data[i] -= self.lr * v / (acc[i].sqrt() + self.eps).unsqueeze(1)
            p.grad = None


def _train(kind, opt_name, steps, tmp_path, depth=0, device_rows=12, host_rows=260, policy="lru", mode="sum",
           weights=False, device="cpu", background="auto", counters=None):
    """Train the DLRM; returns (losses, final weights per table, pipeline stats)."""
    torch.manual_seed(0)
    plain = PlainEmbeddingBags(_tables(), mode=mode)  # same initial rows for every kind
    lr, eps = 0.05, 1e-8
    if kind == "plain":
        emb = plain
        eopt = torch.optim.SGD(plain.parameters(), lr=lr) if opt_name == "sgd" else \
            RowWiseAdagradRef(plain.parameters(), lr, eps)
    else:
        opt = hm.SGD(lr=lr) if opt_name == "sgd" else hm.RowWiseAdagrad(lr=lr, eps=eps)
        cfg = hm.StoreConfig(path=tmp_path / f"{kind}-{opt_name}-{depth}-{policy}-{background}", device_rows=device_rows,
                             host_rows=host_rows, policy=policy, optimizer=opt, device=device)
        emb = hm.CachedEmbeddingBagCollection.from_embedding_bags(dict(plain.bags.items()), cfg)
        eopt = None
    torch.manual_seed(1)
    model = DLRM(emb, T, DIM, bottom=(16,), top=(16,))
    dopt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
    data = _batches(steps, weights=weights)
    pipe = hm.PrefetchPipeline(data, emb, depth=depth, background=background) if depth else None
    losses = []
    model.to(device if kind != "plain" else "cpu")
    for dense, feats, labels in (pipe if pipe else data):
        if kind != "plain":
            dense, labels = dense.to(device), labels.to(device)
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, feats), labels)
        dopt.zero_grad()
        if eopt is not None and opt_name == "sgd":
            eopt.zero_grad()
        loss.backward()
        dopt.step()
        if eopt is not None:
            eopt.step()
        losses.append(float(loss.detach()))
    stats = pipe.stats() if pipe else None
    if kind == "plain":
        final = {n: b.weight.detach().clone() for n, b in plain.bags.items()}
    else:
        emb.store.audit()
        final = {n: emb.store.lookup(n, torch.arange(R)).cpu() for n in emb.names}
        assert int(emb.store._dev.pins.sum()) == 0 and int(emb.store._host.pins.sum()) == 0
        if counters is not None:
            counters.append((emb.store.counters.table.clone(), emb.store.counters.io.clone()))
        emb.store.close()
    return losses, final, stats


@pytest.mark.parametrize("opt_name", ["sgd", pytest.param("rowwise_adagrad", marks=pytest.mark.slow)])  # ~10 s
def test_dlrm_training_equals_plain_embedding_bags(tmp_path, opt_name):
    steps = 50
    ref_losses, ref_final, _ = _train("plain", opt_name, steps, tmp_path)
    assert ref_losses[-1] != ref_losses[0]
    for depth, policy in ((0, "lru"), (1, "lru"), (4, "lfu"), (2, "lfu")):
        # tiny tiers without prefetch; with it a device tier that can pin some batches
        # (~80 rows each; deeper ones are refused), still half of the 480 rows on disk
        tiers = dict(device_rows=240, host_rows=12) if depth else {}
        losses, final, stats = _train("hm", opt_name, steps, tmp_path, depth=depth, policy=policy, **tiers)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6, err_msg=f"depth {depth} {policy}")
        for n in ref_final:
            torch.testing.assert_close(final[n], ref_final[n], rtol=1e-5, atol=1e-5)
        if depth:
            assert stats["prefetched_batches"] > 0 and stats["prefetch_hits"] > 0


def test_mean_mode_and_per_sample_weights_equal_plain(tmp_path):
    for mode, weights in (("mean", False), ("sum", True)):
        ref, ref_final, _ = _train("plain", "sgd", 20, tmp_path, mode=mode, weights=weights)
        got, final, _ = _train("hm", "sgd", 20, tmp_path / mode, depth=2, mode=mode, weights=weights)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        for n in ref_final:
            torch.testing.assert_close(final[n], ref_final[n], rtol=1e-5, atol=1e-5)


def test_pins_exceeding_the_device_tier_degrade_depth_and_stay_exact(tmp_path):
    # ~150 distinct rows per batch; depth 4 would pin ~750, the device tier holds 40
    ref, ref_final, _ = _train("plain", "rowwise_adagrad", 30, tmp_path)
    got, final, st = _train("hm", "rowwise_adagrad", 30, tmp_path, depth=4, device_rows=40, host_rows=500)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for n in ref_final:
        torch.testing.assert_close(final[n], ref_final[n], rtol=1e-5, atol=1e-5)
    assert st["prefetch_degraded"] > 0 and st["min_effective_depth"] < 4
    # roomy tiers: every batch fully prefetched, the full depth held
    _, _, st = _train("hm", "sgd", 30, tmp_path / "roomy", depth=3, device_rows=2000, host_rows=100)
    assert st["prefetch_degraded"] == 0 and st["min_effective_depth"] == 3


def test_prefetch_never_evicts_pinned_rows(tmp_path):
    s = hm.HierarchicalStore([hm.TableSpec("a", 10_000, 4)], hm.StoreConfig(path=tmp_path / "s", device_rows=8,
                                                                           host_rows=24))
    t = torch.zeros(6, dtype=torch.int64)
    a = s.prefetch(t, torch.arange(6))
    assert a.pinned and a.on_device
    for i in range(20):  # pressure: later prefetches and lookups may not move batch a
        b = s.prefetch(t[:2], torch.arange(100 + 10 * i, 102 + 10 * i))  # fits beside a: pinned
        assert b.pinned and b.on_device
        assert bool((s.where("a", torch.arange(6)) == hm.Tier.DEVICE).all())
        s.lookup("a", torch.arange(1000 + i * 4, 1004 + i * 4))
        assert bool((s.where("a", torch.arange(6)) == hm.Tier.DEVICE).all())
        s.release(b)
    # admission: a batch pins only if it fits on the device beside the rows pinned there:
    # c (2 rows) does beside a (6), d (1 more) does not, so it pins nothing: no error
    c = s.prefetch(torch.zeros(2, dtype=torch.int64), torch.arange(200, 202))
    d = s.prefetch(torch.zeros(1, dtype=torch.int64), torch.arange(300, 301))
    assert c.pinned and c.on_device and not d.pinned and s.stats()["_store"]["prefetch_degraded"] == 1
    s.lookup("a", torch.arange(300, 301))  # d's plain lookup: the host tier takes it
    for x in (a, c, d):
        s.release(x)
        s.release(x)  # idempotent
    assert int(s._dev.pins.sum()) == 0 and int(s._host.pins.sum()) == 0
    s.audit()
    s.close()


def test_pinned_slot_counts_follow_every_pin_unpin_and_move(tmp_path):
    # admission reads each tier's count of pinned slots (kept per pin, unpin and move, not
    # scanned): overlapping prefetches, lookups, updates and releases keep it exact
    s = hm.HierarchicalStore([hm.TableSpec("a", 400, 4), hm.TableSpec("b", 300, 2)],
                             hm.StoreConfig(path=tmp_path / "s", device_rows=24, host_rows=40,
                                            optimizer=hm.SGD(lr=0.1)))
    g = torch.Generator().manual_seed(7)
    live = []
    for step in range(300):
        op = int(torch.randint(0, 4, (1,), generator=g))
        n = int(torch.randint(1, 20, (1,), generator=g))
        t = torch.randint(0, 2, (n,), generator=g)
        k = torch.randint(0, 40, (n,), generator=g)
        if op == 0:
            live.append(s.prefetch(t, k))
        elif op == 1 and live:
            s.release(live.pop(int(torch.randint(0, len(live), (1,), generator=g))))
        elif op == 2:
            try:
                s.lookup("a", k)
            except hm.CapacityError:
                pass
        else:
            try:
                s.update("b", k, torch.ones(n, 2))
            except hm.CapacityError:
                pass
        for tier in (s._dev, s._host):
            assert tier.pinned == int((tier.pins > 0).sum()), (step, tier.tier)
    assert any(x.pinned for x in live) or s.stats()["_store"]["prefetched_batches"] > 0
    for x in live:
        s.release(x)
    assert s._dev.pinned == 0 and s._host.pinned == 0
    s.audit()
    s.close()


def test_state_dict_round_trip_and_restore_in_a_fresh_process(tmp_path):
    tables = [hm.TableSpec("a", 500, 4), hm.TableSpec("h", None, 4)]
    cfg = hm.StoreConfig(path=tmp_path / "s", device_rows=16, host_rows=600, optimizer=hm.RowWiseAdagrad(lr=0.1))
    m = hm.CachedEmbeddingBagCollection(tables, cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        lengths = torch.randint(0, 3, (2 * 16,), generator=g)
        vals = torch.randint(0, 500, (int(lengths.sum()),), generator=g)
        f = hm.SparseFeatures(("a", "h"), vals, lengths)
        m(f).square().sum().backward()
    sd = m.state_dict()
    assert set(sd) == {f"{n}.{p}" for n in "ah" for p in ("ids", "weight", "optimizer_state", "step")}
    ids = torch.arange(500)
    want_a, want_h = m.store.lookup("a", ids), m.store.lookup("h", ids)
    torch.save(sd, tmp_path / "sd.pt")
    ck = m.checkpoint(tmp_path / "ck")
    m.store.close()
    # load into a fresh collection that has trained on other rows first
    m2 = hm.CachedEmbeddingBagCollection(tables, hm.StoreConfig(path=tmp_path / "s2", device_rows=8, host_rows=600,
                                                                optimizer=hm.RowWiseAdagrad(lr=0.1)))
    m2(hm.SparseFeatures(("a", "h"), torch.tensor([1, 2, 3]), torch.tensor([3, 0]))).sum().backward()
    m2.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    torch.testing.assert_close(m2.store.lookup("a", ids), want_a, rtol=0, atol=0)
    torch.testing.assert_close(m2.store.lookup("h", ids), want_h, rtol=0, atol=0)
    m2.store.close()
    # the checkpoint restores in another process
    code = ("import sys, torch, hiermem as hm\n"
            "m = hm.CachedEmbeddingBagCollection.restore(sys.argv[1], sys.argv[2])\n"
            "torch.save({'a': m.store.lookup('a', torch.arange(500)), 'h': m.store.lookup('h', torch.arange(500))},"
            " sys.argv[3])\n")
    subprocess.run([sys.executable, "-c", code, str(ck), str(tmp_path / "s3"), str(tmp_path / "out.pt")], check=True)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(got["a"], want_a, rtol=0, atol=0)
    torch.testing.assert_close(got["h"], want_h, rtol=0, atol=0)
    assert (ck / "data.mdb").is_file() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_from_embedding_bags_and_bad_input(tmp_path):
    bags = {"x": nn.EmbeddingBag(50, 4, mode="mean"), "y": nn.EmbeddingBag(30, 4, mode="mean")}
    m = hm.CachedEmbeddingBagCollection.from_embedding_bags(bags, hm.StoreConfig(path=tmp_path / "s", device_rows=8,
                                                                                 host_rows=100))
    f = hm.SparseFeatures.from_dict({"y": [[1, 2], [], [29]], "x": [[0], [49, 49, 3], []]})
    out = m(f, as_dict=True)
    torch.testing.assert_close(out["x"], bags["x"](torch.tensor([0, 49, 49, 3]), torch.tensor([0, 1, 4])))
    torch.testing.assert_close(out["y"], bags["y"](torch.tensor([1, 2, 29]), torch.tensor([0, 2, 2])))
    before = m.store.lookup("x", torch.arange(50)).clone()
    with pytest.raises(hm.InvalidIdError):
        m(hm.SparseFeatures.from_dict({"x": [[50]], "y": [[0]]}))
    with pytest.raises(hm.InvalidArgumentError):
        m(hm.SparseFeatures.from_dict({"x": [[1]]}))  # a table's feature is missing
    with pytest.raises(hm.InvalidTypeError):
        m(torch.tensor([1, 2]))
    with pytest.raises(hm.InvalidArgumentError):
        hm.SparseFeatures(("x", "y"), torch.tensor([1, 2]), torch.tensor([1, 0]))  # lengths do not add up
    with pytest.raises(hm.InvalidArgumentError):
        hm.SparseFeatures(("x",), torch.tensor([1]), torch.tensor([1]), torch.tensor([1.0, 2.0]))
    out = m(f)
    with pytest.raises(hm.NonFiniteGradientError):
        (out * float("nan")).sum().backward()
    torch.testing.assert_close(m.store.lookup("x", torch.arange(50)), before, rtol=0, atol=0)
    with pytest.raises(hm.InvalidArgumentError):
        hm.PrefetchPipeline([], m, depth=0)
    m.store.close()


def test_accepts_a_torchrec_keyed_jagged_tensor(tmp_path):
    jt = pytest.importorskip("torchrec.sparse.jagged_tensor", reason="torchrec not installed")
    m = hm.CachedEmbeddingBagCollection([hm.TableSpec("a", 10, 4), hm.TableSpec("b", None, 4)],
                                        hm.StoreConfig(path=tmp_path / "s", device_rows=8, host_rows=8))
    kjt = jt.KeyedJaggedTensor.from_lengths_sync(keys=["b", "a"], values=torch.tensor([7, 1, 2, 3]),
                                                 lengths=torch.tensor([1, 0, 2, 1]))
    f = hm.SparseFeatures(("b", "a"), torch.tensor([7, 1, 2, 3]), torch.tensor([1, 0, 2, 1]))
    torch.testing.assert_close(m(kjt), m(f))
    m.store.close()


def test_prefetch_thread_stress(tmp_path):
    """Many short runs, random depths, tiers and policies: rows equal a no-prefetch reference."""
    rng = np.random.default_rng(0)
    for run in range(30):
        depth, dev, pol = int(rng.integers(1, 6)), int(rng.integers(4, 80)), str(rng.choice(["lru", "lfu"]))
        steps = int(rng.integers(3, 12))
        want = None
        for d in (0, depth):
            m = hm.CachedEmbeddingBagCollection(_tables(), hm.StoreConfig(
                path=tmp_path / f"r{run}-{d}", device_rows=dev, host_rows=400, policy=pol,
                optimizer=hm.RowWiseAdagrad(lr=0.1)))
            data = [f for _, f, _ in _batches(steps, seed=run)]
            it = hm.PrefetchPipeline(iter(data), m, depth=d, timeout=60) if d else data
            for f in it:
                m(f).square().sum().backward()
            if d:
                it.close()
            rows = torch.cat([m.store.lookup(n, torch.arange(R)) for n in m.names])
            m.store.audit()
            m.store.close()
            if want is None:
                want = rows
            else:
                torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-6, msg=f"run {run} depth {depth}")


def test_checkpoint_survives_sigkill_and_resume_reproduces_losses(tmp_path):
    args = ["--synthetic", "--batch", "64", "--device-rows", "4096", "--host-rows", "16384", "--dim", "8",
            "--checkpoint-every", "5", "--no-progress", "--depth", "2"]
    full = tmp_path / "full"
    r = subprocess.run([sys.executable, "-m", "hiermem", "demo", "--steps", "30", "--path", str(full), *args],
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    ref_losses = torch.load(Path(ref["checkpoint"]) / "dense.pt", weights_only=True)["losses"]
    killed = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "hiermem", "demo", "--steps", "100000", "--path", str(killed),
                          *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "ckpt" / "LATEST"
    deadline = time.monotonic() + 150
    while not latest.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    time.sleep(float(np.random.default_rng().uniform(0, 0.2)))  # a random moment after a checkpoint
    p.send_signal(signal.SIGKILL)
    p.wait()
    step = int(latest.read_text().strip().split("-")[1])
    assert 5 <= step < 30, step
    r = subprocess.run([sys.executable, "-m", "hiermem", "demo", "--steps", "30", "--path", str(killed),
                        "--resume", *args], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["start_step"] == step
    losses = torch.load(Path(got["checkpoint"]) / "dense.pt", weights_only=True)["losses"]
    assert losses.numel() == 30
    torch.testing.assert_close(losses[step:], ref_losses[step:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[:step], ref_losses[:step], rtol=0, atol=0)


def test_adam_through_the_module_equals_sparse_adam_with_empty_tables(tmp_path):
    """A table with no ids in a batch still takes a step (as SparseAdam's state['step'])."""
    torch.manual_seed(0)
    bags = {"a": nn.EmbeddingBag(40, 4, mode="sum", sparse=True), "b": nn.EmbeddingBag(40, 4, mode="sum", sparse=True)}
    ref = {k: nn.EmbeddingBag(40, 4, mode="sum", sparse=True) for k in bags}
    for k in bags:
        ref[k].weight.data.copy_(bags[k].weight.data)
    m = hm.CachedEmbeddingBagCollection.from_embedding_bags(
        bags, hm.StoreConfig(path=tmp_path / "s", device_rows=6, host_rows=60, optimizer=hm.Adam(lr=0.05)))
    opt = torch.optim.SparseAdam([r.weight for r in ref.values()], lr=0.05)
    g = torch.Generator().manual_seed(3)
    for step in range(15):
        nb = 0 if step % 3 == 1 else 2  # table b has no ids every third step
        la = torch.randint(1, 3, (4,), generator=g)
        lb = torch.randint(1, 3, (4,), generator=g) * (nb > 0)
        va = torch.randint(0, 40, (int(la.sum()),), generator=g)
        vb = torch.randint(0, 40, (int(lb.sum()),), generator=g)
        f = hm.SparseFeatures(("a", "b"), torch.cat((va, vb)), torch.cat((la, lb)))
        target = torch.randn(4, 8, generator=g)
        ((m(f) - target) ** 2).sum().backward()
        d = f.to_dict()
        out = torch.cat([ref[k](d[k][0], d[k][1]) for k in ("a", "b")], 1)
        opt.zero_grad()
        ((out - target) ** 2).sum().backward()
        opt.step()
    for k in bags:
        torch.testing.assert_close(m.store.lookup(k, torch.arange(40)), ref[k].weight.detach(), rtol=1e-5, atol=1e-6)
    m.store.close()


def test_inline_prefetch_equals_background_threads(tmp_path):
    """Prefetch and read-ahead inline on the training thread (``background=False``; the
    default for a lookahead policy where no core is free) make the same store calls in the same order as the threads: same losses, rows
    and counters, exactly."""
    runs = {}
    for bg in (True, False):
        got = []
        losses, final, stats = _train("hm", "rowwise_adagrad", 40, tmp_path, depth=2, device_rows=240,
                                      host_rows=12, background=bg, counters=got)
        runs[bg] = (losses, final, stats, got[0])
    (l1, f1, s1, c1), (l0, f0, s0, c0) = runs[True], runs[False]
    assert l1 == l0
    for n in f1:
        assert torch.equal(f1[n], f0[n])
    assert torch.equal(c1[0], c0[0])
    from hiermem.observe.stats import IO
    timing = [IO.LATE_PREFETCHES]  # rows whose prefetch was still running at their lookup: threads only
    keep = torch.ones(len(IO), dtype=torch.bool)
    keep[timing] = False
    assert torch.equal(c1[1][keep], c0[1][keep]) and int(c0[1][IO.LATE_PREFETCHES]) == 0
    assert s0["prefetched_batches"] == s1["prefetched_batches"] > 0 and s0["late_batches"] == 0


def test_background_auto_decides_from_the_machine(monkeypatch):
    from hiermem.store import overlap
    from hiermem.nn import pipeline as pl

    monkeypatch.setenv("HIERMEM_BACKGROUND", "auto")
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(overlap, "free_cores", lambda: 0)
    mode, why = pl.choose_background("auto", cpu)
    assert mode == "foreground" and "no core free" in why and "no prefetch" in why
    assert pl.choose_background("auto", cpu, lookahead=True)[0] == "inline"  # it learns the coming rows
    assert pl.choose_background("auto", gpu)[0] == "threads"  # a GPU computes while the host's threads work
    assert overlap.resolve_write_behind("auto", cpu)[0] is False
    assert overlap.resolve_write_behind("auto", gpu)[0] is True
    monkeypatch.setattr(overlap, "free_cores", lambda: 2)
    assert pl.choose_background("auto", cpu) == ("threads", "2 core(s) free beside torch's "
                                                 f"{torch.get_num_threads()} intra-op threads")
    assert overlap.resolve_write_behind("auto", cpu)[0] is True
    assert overlap.resolve_write_behind(False, cpu) == (False, "asked for")
    assert pl.choose_background(False, cpu)[0] == "inline" and pl.choose_background(True, cpu)[0] == "threads"
    monkeypatch.setenv("HIERMEM_BACKGROUND", "inline")
    assert pl.choose_background("auto", cpu)[0] == "inline"
    monkeypatch.setenv("HIERMEM_BACKGROUND", "foreground")
    assert pl.choose_background("auto", cpu)[0] == "foreground"
    with pytest.raises(hm.InvalidArgumentError, match="background"):
        pl.choose_background("sometimes", cpu)
    with pytest.raises(hm.InvalidTypeError, match="write_behind"):
        hm.StoreConfig(path="x", write_behind="sometimes")


def test_foreground_pipeline_equals_no_pipeline(tmp_path, monkeypatch):
    """Where nothing can overlap, the pipeline prefetches nothing: the same losses, rows
    and counters as training without it."""
    monkeypatch.setenv("HIERMEM_BACKGROUND", "foreground")
    got_fg, got_none = [], []
    lf, ff, sf = _train("hm", "rowwise_adagrad", 30, tmp_path, depth=2, device_rows=120, host_rows=200,
                        counters=got_fg)
    ln, fn, _ = _train("hm", "rowwise_adagrad", 30, tmp_path / "none", depth=0, device_rows=120, host_rows=200,
                       counters=got_none)
    assert lf == ln
    for n in ff:
        assert torch.equal(ff[n], fn[n])
    assert torch.equal(got_fg[0][0], got_none[0][0]) and torch.equal(got_fg[0][1], got_none[0][1])
    assert sf["mode"] == "foreground" and sf["background"] is False and sf["steps"] == 30
    assert sf["prefetched_batches"] == 0 and sf["late_batches"] == 0
    assert sf["min_effective_depth"] == 0 and sf["mean_effective_depth"] == 0


def test_write_behind_auto_is_reported(tmp_path, monkeypatch):
    from hiermem.store import overlap

    for free, on in ((0, False), (1, True)):
        monkeypatch.setattr(overlap, "free_cores", lambda: free)
        s = hm.HierarchicalStore(_tables(), hm.StoreConfig(path=tmp_path / f"wb{free}", device_rows=8, host_rows=16,
                                                           write_behind="auto"))
        st = s.stats()["_store"]
        assert s.write_behind is on and st["write_behind"] is on and st["write_behind_reason"].startswith("auto: ")
        assert s._disk.write_behind is on
        s.close()
