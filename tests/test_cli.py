"""The ``hiermem`` subcommands other than demo: outputs for people, one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import hiermem as hm
from hiermem.cli.main import main

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.fixture
def trace(tmp_path, capsys):
    ids = np.random.default_rng(0).zipf(1.2, 4000).astype(np.int64) % 500
    np.save(tmp_path / "ids.npy", ids)
    assert main(["trace", "import", "npy", str(tmp_path / "ids.npy"), str(tmp_path / "tr"), "--table", "t",
                 "--batch-size", "50"]) == 0
    capsys.readouterr()
    return tmp_path / "tr"


def test_sim_without_json_shows_every_tier_and_the_step_estimate(trace, capsys):
    assert main(["sim", str(trace), "--policy", "lru", "--device-rows", "20", "--host-rows", "60"]) == 0
    out = capsys.readouterr().out
    for tier in ("device", "host", "disk"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(tier))
        assert "hits" in line and "misses" in line and "hit rate" in line
    assert "estimated step time" in out and " ms" in out


def test_sim_takes_an_admission_filter(trace, capsys):
    import json

    hits = {}
    for adm in ("off", "tinylfu"):
        assert main(["sim", str(trace), "--policy", "lru", "--device-rows", "100", "--host-rows", "60", "--admission",
                     adm, "--json"]) == 0
        hits[adm] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["device"]["hits"]
    assert hits["tinylfu"] > hits["off"]  # Zipf ids: the filter keeps the hot rows
    with pytest.raises(SystemExit):
        main(["sim", str(trace), "--policy", "lru", "--device-rows", "20", "--admission", "maybe"])


def test_trace_import_refuses_a_non_npy_file_and_a_non_empty_directory(tmp_path, capsys):
    assert main(["trace", "import", "npy", str(ROOT / "README.md"), str(tmp_path / "a"), "--table", "t",
                 "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "not a .npy file" in err and "pickled" not in err and not (tmp_path / "a").exists()
    np.save(tmp_path / "ids.npy", np.arange(10))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert main(["trace", "import", "npy", str(tmp_path / "ids.npy"), str(tmp_path / "full"), "--table", "t",
                 "--batch-size", "4"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]


def test_tune_table_drops_the_step_column_when_estimates_do_not_differ():
    from hiermem.sim.tune import Candidate, Scored, TuneResult

    def scored(policy, misses, secs):
        return Scored(Candidate(policy, (), 10, 20, 0), misses, 1 - misses / 100, secs, 0)

    same = TuneResult([scored("lru", 10, 1e-3), scored("lfu", 20, 1e-3)], {}, 100).table()
    assert "step ms" not in same.splitlines()[0] and "cannot tell these candidates apart" in same
    apart = TuneResult([scored("lru", 10, 1e-3), scored("lfu", 20, 2e-3)], {}, 100).table()
    assert "step ms" in apart.splitlines()[0] and "2.000" in apart


def test_tune_progress_labels_are_not_cut(capsys):
    from hiermem.sim.tune import Candidate, _progress

    label = Candidate("lfu_decay", (("half_life", 123456.0), ("admit", 2)), 4096, 12288, 2).label
    _progress(1, 3, label, True)
    assert label in capsys.readouterr().err and label.endswith("k=2")


def test_stats_and_serve_on_a_store_in_training_say_where_live_metrics_are(tmp_path, capsys):
    store = hm.HierarchicalStore([hm.TableSpec("t", 100, 4)],
                                 hm.StoreConfig(path=tmp_path / "s", device="cpu", device_rows=8, host_rows=8))
    try:
        assert main(["stats", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err
        assert "live metrics come from that process" in err and "--metrics-port" in err
    finally:
        store.close()


def test_help_shows_defaults(capsys):
    for cmd in (["serve", "--help"], ["sim", "--help"], ["tune", "--help"]):
        with pytest.raises(SystemExit):
            main(cmd)
        assert "default" in capsys.readouterr().out


def test_serve_shows_the_counters_saved_with_the_store(tmp_path):
    import torch

    cfg = hm.StoreConfig(path=tmp_path / "s", device="cpu", device_rows=8, host_rows=8)
    with hm.HierarchicalStore([hm.TableSpec("t", 100, 4)], cfg) as store:
        store.lookup("t", torch.arange(10))
        store.lookup("t", torch.arange(10, 20))
        store.lookup("t", torch.arange(20, 30))
    with hm.HierarchicalStore.open(tmp_path / "s") as store:
        assert store.stats()["t"]["device"]["lookups"] == 0  # this session's
        assert store.stats(cumulative=True)["t"]["device"]["lookups"] == 30
        store.count_from_creation()  # what `hiermem serve` does before serving /metrics
        assert store.stats()["t"]["device"]["lookups"] == 30
        store.lookup("t", torch.arange(5))
        assert store.stats(cumulative=True)["t"]["device"]["lookups"] == 35
    with hm.HierarchicalStore.open(tmp_path / "s") as store:  # and nothing is counted twice
        assert store.stats(cumulative=True)["t"]["device"]["lookups"] == 35
