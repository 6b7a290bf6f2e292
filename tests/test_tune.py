"""The tuner: ranked search, curves PNG, and a winner policy file that round-trips into a
real store (and the simulator reproduces that store on the trace it records)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.cli.main import main as cli_main
from hiermem.nn.data import ZipfIds
from hiermem.errors import MissingDependencyError
from hiermem.sim import SimConfig, load_trace, simulate, write_trace
from hiermem.sim.tune import TuneConfig, candidates, tune


@pytest.fixture
def zipf_trace(tmp_path):
    ids = ZipfIds(3000, 1.0, 7)(6_000)
    return write_trace(tmp_path / "zipf", ["t"], ids, np.full((60, 1), 100))


def test_tune_cli_ranks_plots_and_writes_a_loadable_policy(tmp_path, zipf_trace, capsys):
    out = tmp_path / "policies"
    assert cli_main(["tune", "--trace", str(zipf_trace), "--device-rows", "150", "--host-rows", "300",
                     "--max-prefetch-depth", "1", "--curve-points", "4", "--out-dir", str(out),
                     "--name", "zipf", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "winner:" in text and "rank" in text
    png = out / "zipf.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    f = out / "zipf.toml"
    spec = hm.resolve_policy(f)
    doc = __import__("tomllib").loads(f.read_text())
    assert spec.name == doc["name"] and spec.params == doc.get("params", {})
    # the file drives a real store; the simulator reproduces it on the trace it records
    D, H, k = doc["device_rows"], doc["host_rows"], doc["prefetch_depth"]
    assert (D, H) == (150, 300) and k in (0, 1)
    store = hm.HierarchicalStore([hm.TableSpec("t", 3000, 4)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=D, host_rows=H, policy=str(f),
                                                trace_path=tmp_path / "rec"))
    for batch in load_trace(zipf_trace).batches():
        ids = torch.from_numpy(batch[0])
        store.lookup("t", ids)
        store.update("t", ids, torch.ones(ids.numel(), 4))
    table = store.counters.table.clone()
    store.close()
    # (the store has no prefetch yet: it runs plain lookups, i.e. depth 0)
    res = simulate(tmp_path / "rec", SimConfig(device_rows=D, host_rows=H, policy=f, prefetch_depth=0))
    assert torch.equal(res.counters.table, table)


def test_tune_api_ranking_and_budget_splits(zipf_trace):
    cfg = TuneConfig(device_rows=100, host_rows=100, memory_budget_rows=300, max_prefetch_depth=0, curve_points=3)
    cands = candidates(cfg, 6_000)
    assert {(c.device_rows, c.host_rows) for c in cands} == {(100, 200), (75, 225), (50, 250)}
    r = tune(zipf_trace, cfg, progress=False, write=False)
    steps = [s.step_seconds for s in r.ranked]
    assert steps == sorted(steps) and len(r.ranked) == len(cands)
    assert {"lru (batch, k=0)", "lfu (batch, k=0)", "belady (per access)", "lru-mrc (per access)"} <= set(r.curves)
    caps, bel = r.curves["belady (per access)"]
    for name, (c2, ratios) in r.curves.items():  # batches of 100 fit every device size >= 100
        if "batch" in name:
            assert all(b <= m for b, m, c in zip(bel, ratios, caps) if c >= 100), name
    with pytest.raises(hm.InvalidArgumentError):
        TuneConfig(device_rows=0, host_rows=1)


def test_tune_without_matplotlib_is_a_clear_error(zipf_trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"hiermem\[tune\]"):
        tune(zipf_trace, TuneConfig(device_rows=10, host_rows=10), out_dir=tmp_path / "p", progress=False)
    assert cli_main(["tune", "--trace", str(zipf_trace), "--device-rows", "10", "--host-rows", "10",
                     "--out-dir", str(tmp_path / "p"), "--quiet"]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_readme_tuning_commands_run(tmp_path):
    """The user guide's offline-tuning shell block, as written (``hiermem`` = this checkout's CLI)."""
    import re
    import shlex
    from pathlib import Path

    from hiermem.nn.data import shared_data_dir

    if shared_data_dir() is None:
        pytest.skip("shared data absent")
    readme = (Path(__file__).resolve().parent.parent / "docs" / "guide.md").read_text()
    block = re.search(r"## Offline policy tuning.*?```bash\n(.*?)```", readme, re.S).group(1)
    monkey = pytest.MonkeyPatch()
    monkey.chdir(tmp_path)
    try:
        for line in block.strip().splitlines():
            argv = shlex.split(line.split("#")[0])
            assert argv[0] == "hiermem"
            assert cli_main(argv[1:]) == 0, line
    finally:
        monkey.undo()
    assert hm.resolve_policy(tmp_path / "runs" / "policies" / "tuned.toml").name in hm.POLICIES
    assert (tmp_path / "runs" / "policies" / "tuned.png").is_file()


def test_the_search_covers_every_registered_policy():
    """Every policy of the registry is a candidate (lookahead only with a pipeline: its
    future ids come from it), with each class's parameter grid."""
    from hiermem.core.policies import POLICIES

    cands = candidates(TuneConfig(device_rows=100, host_rows=100, max_prefetch_depth=1), 10_000)
    assert {c.policy for c in cands} == set(POLICIES)
    assert all(c.prefetch_depth >= 1 for c in cands if c.policy == "lookahead")
    assert {dict(c.params).get("small") for c in cands if c.policy == "s3fifo"} == {0.05, 0.10, 0.20}
    assert {dict(c.params).get("base", "lru") for c in cands if c.policy == "lookahead"} == {"lru", "lfu_decay"}
    # every family with and without the admission filter
    assert {c.policy for c in cands if dict(c.params).get("admission") == "tinylfu"} == set(POLICIES)
    assert all("=" in c.label or c.params == () for c in cands)
