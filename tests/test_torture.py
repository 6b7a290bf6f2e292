"""Crash torture, short version of ``scripts/torture.py``: one SIGKILL of a training
process per kill mode (a random moment; inside flush at four points; inside an eviction
write-back; inside a checkpoint at three points; inside a prefetch on the pipeline's
thread, timed and in its write-back), a reopen after each with every row
checked against the harness's reference log, and every checkpoint restored and compared
with its snapshot; plus a check that the checker itself reports lost and torn rows."""

from __future__ import annotations

import importlib.util
import random
import signal
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest

from hiermem.tiers.disk import key_list

@pytest.fixture(autouse=True)
def _torch_plane(monkeypatch):
    """These tests compare bit for bit with tests/reference.py's torch-op FlatStore: run the
    torch data plane (the compiled one equals it to ~1 ulp, tests/test_dataplane.py)."""
    monkeypatch.setenv("HIERMEM_DATA_PLANE", "torch")


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def torture():
    spec = importlib.util.spec_from_file_location("hm_torture", ROOT / "scripts" / "torture.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hm_torture"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("write_behind,io_process,combine", [(False, True, 0), (False, True, 24), (True, True, None),
                                                            (True, False, None)],
                         ids=["sync-writebacks", "combined-writebacks", "write-behind", "write-behind-in-thread"])
def test_kills_lose_and_tear_nothing(torture, tmp_path, write_behind, io_process, combine):
    """``combine``: each write-back commits in its step (0), or they are held until 24
    records are, then committed together (a kill loses those held)."""
    n = len(torture.MODES)  # one kill per mode: random, flush (4 ways), write-back, checkpoint (3), prefetch (2)
    rounds = torture.torture(n, tmp_path, seed=7, verbose=False, write_behind=write_behind, io_process=io_process,
                             write_combine=combine)
    s = torture.summary(rounds)
    assert s["kills"] == n >= 5 and all(r.rc == -signal.SIGKILL for r in rounds)
    assert s["open_errors"] == 0, [r.open_error for r in rounds]
    assert s["lost"] == 0 and s["torn"] == 0, [p for r in rounds for p in r.check.problems]
    assert s["problems"] == 0 and s["checkpoints_bad"] == 0, [p for r in rounds for p in r.check.problems]
    assert set(s["modes"]) == set(torture.MODES)
    # the injected kills really died where they were meant to (announced, never finished)
    assert all(r.in_flush for r in rounds if r.mode in ("flush-txn", "flush-sync", "after-flush"))
    assert all(r.in_checkpoint for r in rounds if r.mode in ("checkpoint-copy", "checkpoint-rename"))
    if not write_behind:  # queued, a prefetch's write-back commits on the writer thread, maybe after it
        assert all(r.in_prefetch for r in rounds if r.mode == "prefetch-writeback")
    assert s["missed_kill_points"] == 0
    # every row of the universe was checked after each kill, some reopened rows held values
    # newer than their last flush (eviction write-backs), and checkpoints were restored
    assert s["rows_checked"] == n * (300 + 120)
    assert s["rows_later"] > 0
    assert s["checkpoints_restored"] > 0


def _put(path, ti, ident, rec):
    env = lmdb.open(str(path), max_dbs=16, map_size=1 << 28)
    try:
        db = env.open_db(b"t%d" % ti, create=False, integerkey=True)
        key = key_list(np.array([ident], dtype=np.uint64))[0]
        with env.begin(write=True, db=db) as txn:
            txn.put(key, np.ascontiguousarray(rec, dtype="<f4").tobytes())
    finally:
        env.close()


def test_checker_reports_lost_and_torn_rows(torture, tmp_path):
    """Tamper with LMDB after a kill: a row set back to a value older than its last
    flush is lost; a row with weights of one value and optimizer state of another is torn."""
    T = torture
    T.make_store(tmp_path / "store").close()
    base = T.Reference.initial()
    rng = random.Random(3)
    for _ in range(10):  # until a round has a row written before its last flush and again after it
        r, nxt = T.one_round(tmp_path, 0, "after-flush", rng, base, "lru")
        assert r.check.lost == r.check.torn == 0
        log = T.read_log(tmp_path / "log0.bin", max(T.widths(base.opt)))
        rows, flush = log[log["kind"] == T.ROW], int(log["seq"][log["kind"] == T.FLUSH].max())
        e0 = rows[(rows["table"] == 0) & (rows["seq"] < flush)]
        if e0.size:
            break
        base = nxt
    else:
        pytest.fail("no round logged a row before its last flush")
    w = T.widths(base.opt)[0]
    victim = e0[-1]  # its last-flushed value; the value before that is older
    older = e0[(e0["pos"] == victim["pos"]) & (e0["seq"] < victim["seq"])]
    old_rec = older[-1]["rec"][:w] if older.size else base.recs[0][int(victim["pos"])].numpy()
    _put(tmp_path / "store", 0, int(victim["pos"]), old_rec)
    torn_pos = (int(victim["pos"]) + 1) % 300
    torn_rec = nxt.recs[0][torn_pos].numpy().copy()
    torn_rec[8:] += 1.0  # the same weights, another accumulator
    _put(tmp_path / "store", 0, torn_pos, torn_rec)
    check, _ = T.verify(tmp_path / "store", log, base)
    assert check.lost == 1 and check.torn == 1, check.problems
    assert f"lost: bounded id {int(victim['pos'])}" in check.problems
    assert f"torn: bounded id {torn_pos}" in check.problems


def test_readme_reliability_table_names_real_tests():
    """Every test the Reliability table (docs/reliability.md) cites exists (``file::name``, or
    ``::name`` for the file named before it; ``*`` as a prefix wildcard)."""
    import fnmatch
    import re

    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text[text.index("## Reliability"):]
    cited, current = [], None
    for ref in re.findall(r"`((?:tests/\w+\.py)?::[\w*]+|tests/\w+\.py)`", table):
        if ref.startswith("tests/"):
            current, _, name = ref.partition("::")
        else:
            name = ref[2:]
        assert (ROOT / current).is_file(), current
        if name:
            cited.append((current, name))
    for line in table.splitlines():  # bare names in parentheses after a file, e.g. (`test_x`, ...)
        m = re.search(r"`(tests/\w+\.py)` \(([^)]*)\)", line)
        if m:
            cited += [(m.group(1), n) for n in re.findall(r"`(test_[\w*]+)`", m.group(2))]
    assert len(cited) >= 20
    for path, name in cited:
        defs = re.findall(r"^def (test_\w+)", (ROOT / path).read_text(), re.M)
        assert fnmatch.filter(defs, name), f"{path}::{name} does not exist"
    assert (ROOT / "scripts" / "torture.py").is_file()
