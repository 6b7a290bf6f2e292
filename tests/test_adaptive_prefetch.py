"""``background="auto"`` where background work *could* overlap the step (a GPU, a free
core): the pipeline measures whether prefetch threads make the loop faster (steps timed
in alternating windows with and without prefetch) and keeps them only if they do.  The
switches change where rows are placed, never a value: training stays exact."""

import time

import pytest
import torch

import hiermem as hm
from hiermem.nn import pipeline as pl
from test_modules import _batches, _tables, _train


@pytest.fixture
def adaptive(monkeypatch):
    """An "auto" pipeline that may overlap (as on a GPU host), with a short trial."""
    monkeypatch.setenv("HIERMEM_BACKGROUND", "auto")
    monkeypatch.setattr(pl, "can_overlap", lambda device: (True, "a test's free core"))
    monkeypatch.setattr(pl, "ADAPT_AFTER", 3)
    monkeypatch.setattr(pl, "ADAPT_STEPS", 3)
    monkeypatch.setattr(pl, "ADAPT_EVERY", 1000)


def _loop(tmp_path, steps, slow_prefetch=0.0, slow_foreground=0.0):
    """Train embeddings alone through an auto pipeline; a slow prefetch job, or a step
    that costs more without prefetch; returns (pipeline stats, modes per step)."""
    cfg = hm.StoreConfig(path=tmp_path / "s", device_rows=120, host_rows=200, optimizer=hm.SGD(lr=0.1))
    emb = hm.CachedEmbeddingBagCollection(_tables(), cfg)
    if slow_prefetch:
        real = emb.store.prefetch

        def prefetch(*a, **k):
            time.sleep(slow_prefetch)
            return real(*a, **k)
        emb.store.prefetch = prefetch
    modes = []
    with hm.PrefetchPipeline(_batches(steps), emb, depth=2) as pipe:
        assert pipe.adaptive and pipe.mode == "threads" and not pipe.mode_settled
        for _, feats, _ in pipe:
            modes.append(pipe.mode)
            if pipe.mode == "foreground" and slow_foreground:
                time.sleep(slow_foreground)
            emb(feats).sum().backward()
        assert pipe.mode_settled
        st = pipe.stats()
        st["disk_read_ahead_cached"] = len(emb.store.disk.ahead)
    emb.store.audit()
    assert int(emb.store.device_tier.pins.sum()) == 0 and int(emb.store.host_tier.pins.sum()) == 0
    emb.store.close()
    return st, modes


def test_a_prefetch_that_costs_more_than_it_hides_is_turned_off(tmp_path, adaptive):
    st, modes = _loop(tmp_path, 70, slow_prefetch=0.02)
    assert len(st["trials"]) == 1 and st["trials"][0]["chose"] == "foreground", st["trials"]
    assert st["trials"][0]["threads_ms"] > st["trials"][0]["foreground_ms"]
    assert modes[-1] == "foreground" and st["mode"] == "foreground"
    assert "measured at step 3" in st["background_reason"] and st["background_reason"].endswith("foreground")
    assert "threads" in modes[:3] and modes.count("foreground") > 30
    assert st["disk_read_ahead_cached"] == 0  # the read-ahead cache was dropped with the threads


def test_a_prefetch_that_hides_work_stays_on(tmp_path, adaptive):
    st, modes = _loop(tmp_path, 70, slow_foreground=0.02)
    assert len(st["trials"]) == 1 and st["trials"][0]["chose"] == "threads", st["trials"]
    assert modes[-1] == "threads" and st["mode"] == "threads" and st["prefetched_batches"] > 0
    assert "foreground" in modes  # it did measure the other mode


def test_switching_modes_trains_exactly(tmp_path, adaptive, monkeypatch):
    """Trials every 12 steps switch back and forth; losses, rows and every pin equal
    training without a pipeline."""
    monkeypatch.setattr(pl, "ADAPT_EVERY", 12)
    ls, fs, st = _train("hm", "rowwise_adagrad", 90, tmp_path, depth=2, device_rows=120, host_rows=200)
    ln, fn, _ = _train("hm", "rowwise_adagrad", 90, tmp_path / "none", depth=0, device_rows=120, host_rows=200)
    assert st["adaptive"] and len(st["trials"]) >= 2
    assert ls == ln
    for n in fs:
        assert torch.equal(fs[n], fn[n])


def test_an_explicit_mode_is_never_second_guessed(tmp_path, adaptive, monkeypatch):
    monkeypatch.setenv("HIERMEM_BACKGROUND", "threads")
    cfg = hm.StoreConfig(path=tmp_path / "s", device_rows=120, host_rows=200)
    emb = hm.CachedEmbeddingBagCollection(_tables(), cfg)
    for background, env in ((True, "auto"), ("auto", "threads")):
        monkeypatch.setenv("HIERMEM_BACKGROUND", env)
        with hm.PrefetchPipeline(_batches(4), emb, depth=2, background=background) as pipe:
            assert not pipe.adaptive and pipe.stats()["trials"] == [] and pipe.mode_settled
    emb.store.close()
