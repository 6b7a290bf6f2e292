"""Read-only handles (issue 19): other processes read a store while one process trains it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import hiermem as hm

ROOT = Path(__file__).resolve().parent.parent
TABLES = [hm.TableSpec("b", 300, 4), hm.TableSpec("h", None, 3)]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# a reader process: on each line "read" it prints the flush number and the records of
# table b's rows 0..299 (hex), and tries writes, which must be refused
_READER = textwrap.dedent("""
    import json, sys, torch, hiermem as hm
    r = hm.HierarchicalStore.open(sys.argv[1], readonly=True)
    refused = []
    for name, call in (("update", lambda: r.update("b", torch.arange(3), torch.zeros(3, 4))),
                       ("write", lambda: r.write("b", torch.arange(3), torch.zeros(3, 4))),
                       ("flush", r.flush), ("checkpoint", lambda: r.checkpoint(sys.argv[1] + ".ck"))):
        try:
            call()
        except hm.ReadOnlyStoreError:
            refused.append(name)
    print(json.dumps({"ready": True, "refused": refused}), flush=True)
    for line in sys.stdin:
        rec = r.records("b", torch.arange(300))
        print(json.dumps({"seq": r.flush_seq, "rec": rec.numpy().tobytes().hex()}), flush=True)
    r.close()
""")


def make(path, **kw):
    kw.setdefault("device_rows", 400)
    kw.setdefault("host_rows", 400)
    return hm.HierarchicalStore(TABLES, hm.StoreConfig(path=path, optimizer=hm.Adagrad(lr=0.1), **kw))


def train(s, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 300, (30,), generator=g)
        s.lookup("b", ids)
        s.update("b", ids, torch.randn(30, 4, generator=g))


def records(s):
    """Table b's records as the training store holds them (its export, after a flush)."""
    from hiermem.store.rows import initial_records

    ids, rec = s.export("b")
    out = initial_records(TABLES[0], 0, 0, s.optimizer, torch.arange(300))
    out[ids] = rec
    return out


def ask(proc):
    proc.stdin.write("read\n")
    proc.stdin.flush()
    got = json.loads(proc.stdout.readline())
    return got["seq"], torch.from_numpy(np.frombuffer(bytes.fromhex(got["rec"]), dtype=np.float32).reshape(300, -1).copy())


def test_readers_in_other_processes_see_the_last_flush_while_training_goes_on(tmp_path):
    s = make(tmp_path / "s")  # tiers hold every row: nothing is written down between flushes
    proc = None
    try:
        train(s, 10, seed=0)
        s.flush()
        flushed, seq = records(s), s.stats()["_store"]["flush_seq"]
        proc = subprocess.Popen([sys.executable, "-c", _READER, str(tmp_path / "s")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        hello = json.loads(proc.stdout.readline())
        assert hello["refused"] == ["update", "write", "flush", "checkpoint"]
        assert not (tmp_path / "s.ck").exists()
        got_seq, got = ask(proc)
        assert got_seq == seq and torch.equal(got, flushed)
        train(s, 10, seed=1)  # trained on, not flushed: the reader still sees the flush
        got_seq, got = ask(proc)
        assert got_seq == seq and torch.equal(got, flushed)
        s.flush()  # the writer flushes with a reader open, and the reader sees it
        got_seq, got = ask(proc)
        assert got_seq == seq + 1 and torch.equal(got, records(s))
        assert not torch.equal(got, flushed)
        with pytest.raises(hm.HierMemError):  # the trainer's restore cannot pull the store from under it
            s.checkpoint(tmp_path / "ck")
            s.close()
            hm.HierarchicalStore.restore(tmp_path / "ck", tmp_path / "s")
    finally:
        if proc is not None:
            proc.stdin.close()
            assert proc.wait(timeout=120) == 0
        s.close()


def test_one_process_rules(tmp_path):
    s = make(tmp_path / "s")
    train(s, 3, seed=0)
    with pytest.raises(hm.HierMemError) as ei:  # LMDB: one environment handle per process
        hm.HierarchicalStore.open(tmp_path / "s", readonly=True)
    assert "open for writing in this process" in str(ei.value)
    s.close()
    with hm.HierarchicalStore.open(tmp_path / "s", readonly=True) as r:
        with pytest.raises(hm.HierMemError):
            hm.HierarchicalStore.open(tmp_path / "s")
        with pytest.raises(hm.HierMemError):
            hm.HierarchicalStore.restore(tmp_path / "s", tmp_path / "s")
        with pytest.raises(hm.InvalidIdError):
            r.lookup("b", torch.tensor([300]))
        with pytest.raises(hm.UnknownTableError):
            r.lookup("nope", torch.tensor([1]))
        assert r.lookup("b", torch.arange(5)).shape == (5, 4)
    with pytest.raises(hm.StoreClosedError):
        r.lookup("b", torch.arange(5))
    with pytest.raises(hm.StoreFormatError):
        hm.HierarchicalStore.open(tmp_path / "nothing", readonly=True)
    hm.HierarchicalStore.open(tmp_path / "s").close()  # released


def test_read_only_values_equal_the_stores_including_unwritten_rows(tmp_path):
    with make(tmp_path / "s") as s:
        train(s, 5, seed=0)
        ids = torch.tensor([0, 5, 5, 299, 17])
        hashed = torch.tensor([2**62, 3, 2**62])
        want_b, want_h = s.lookup("b", ids), s.lookup("h", hashed)  # h: never written, initial values
    with hm.HierarchicalStore.open(tmp_path / "s", readonly=True) as r:
        assert torch.equal(r.lookup("b", ids), want_b)
        assert torch.equal(r.lookup("h", hashed), want_h)
        e_ids, e_rec = r.export("b")
        assert torch.equal(r.lookup("b", e_ids), e_rec[:, :4])


def test_cli_export_while_a_process_trains(tmp_path):
    s = make(tmp_path / "s")
    try:
        train(s, 10, seed=0)
        s.flush()
        want_ids, want_rec = s.export("b")
        train(s, 5, seed=1)  # not flushed: not in the export
        out = tmp_path / "b.npy"
        r = subprocess.run([sys.executable, "-m", "hiermem", "export", str(tmp_path / "s"), "--table", "b",
                            "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        a = np.load(out, allow_pickle=False)
        assert a.dtype.names == ("id", "weight") and a["weight"].shape == (want_ids.numel(), 4)
        assert np.array_equal(a["id"], want_ids.numpy())
        assert np.array_equal(a["weight"], want_rec[:, :4].numpy())
        assert os.stat(out).st_mode & 0o777 == 0o600
        bad = subprocess.run([sys.executable, "-m", "hiermem", "export", str(tmp_path / "s"), "--table", "zz",
                              "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
        assert bad.returncode == 2 and "unknown table" in bad.stderr
    finally:
        s.close()


def test_load_test_quick_no_torn_or_stale_rows():
    """The short version of scripts/bench_readers.py: a writer trains and flushes while two
    read-only processes check every row they read against what the writer held."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_readers.py"), "--quick", "--seconds", "2"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["ok"]
    ph = {p["phase"]: p for p in res["phases"]}
    assert ph["readers"]["observations"] > 0 and ph["readers"]["torn"] == ph["readers"]["stale"] == 0
    assert ph["readers"]["writer_steps"] > 0 and all(x > 0 for x in ph["readers"]["reader_lookups_per_s"])
    assert ph["alone"]["writer_mismatches"] == ph["readers"]["writer_mismatches"] == 0


def test_load_test_checker_reports_torn_and_stale_rows(tmp_path):
    """The load test's checker itself: a record the writer never held is torn, one older
    than the reported flush is stale, one newer is counted as later."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hm_bench_readers", ROOT / "scripts" / "bench_readers.py")
    br = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(br)
    k = br.key_of(0, np.array([1, 2]))
    u64 = lambda *x: np.array(x, dtype=np.uint64)  # noqa: E731
    np.savez(tmp_path / "w.npz", keys=k[[0, 0, 1]], hashes=u64(10, 11, 20), steps=np.array([1, 2, 1]),
             init_keys=k, init_hashes=u64(100, 200), flush_seqs=np.array([1, 2]), flush_steps=np.array([0, 1]))
    np.savez(tmp_path / "r.npz", keys=k[[0, 0, 1, 0, 1]], hashes=u64(10, 100, 999, 11, 200),
             seqs=np.array([2, 2, 1, 1, 1]))
    got = br.check(tmp_path / "w.npz", [tmp_path / "r.npz"])
    assert (got["torn"], got["stale"], got["later"], got["observations"]) == (1, 1, 1, 5)


_GROWTH_READER = textwrap.dedent("""
    import sys, torch, hiermem as hm
    r = hm.HierarchicalStore.open(sys.argv[1], readonly=True)
    print(r.records("h", torch.arange(10)).shape[0], flush=True)  # a snapshot of the small map
    sys.stdin.readline()
    rec = r.records("h", torch.arange(0, 60000, 7))  # rows written after the map grew
    print(r.flush_seq, float(rec[:, :3].double().sum()), flush=True)
    r.close()
""")


@pytest.mark.parametrize("writemap", [False, True])
def test_reader_follows_the_map_as_the_writer_grows_it(tmp_path, writemap):
    s = hm.HierarchicalStore(TABLES, hm.StoreConfig(path=tmp_path / "s", device_rows=64, host_rows=64,
                                                    map_size=1 << 20, writemap=writemap))
    proc = subprocess.Popen([sys.executable, "-c", _GROWTH_READER, str(tmp_path / "s")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "10"
        before = s.stats()["_store"]["lmdb_map_size"]
        g = torch.Generator().manual_seed(0)
        for i in range(0, 60000, 2000):  # 60,000 records straight to LMDB: the 1 MiB map grows
            s.import_records("h", torch.arange(i, i + 2000), torch.randn(2000, 3, generator=g))
        s.flush()
        assert s.stats()["_store"]["lmdb_map_size"] > before
        proc.stdin.write("go\n")
        proc.stdin.flush()
        seq, total = proc.stdout.readline().split()
        assert int(seq) == s.stats()["_store"]["flush_seq"]
        ids = torch.arange(0, 60000, 7)
        full = sum(float(s.lookup("h", ids[j:j + 100]).double().sum()) for j in range(0, ids.numel(), 100))
        assert abs(float(total) - full) < 1e-6 * max(1.0, abs(full))
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        s.close()
