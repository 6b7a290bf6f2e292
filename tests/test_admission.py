"""The admission filter (``admission="tinylfu"``, hiermem.core.admission) in front of every
policy: its rule on a hand-built trace, the store and the simulator alike with it on,
exact values against the flat reference, and its parameter's checks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

import hiermem as hm
from hiermem.core.policies import POLICIES, PolicySpec, resolve_policy
from hiermem.observe.stats import IO
from hiermem.sim import SimConfig, load_trace, simulate, write_trace

from test_sim_exact import PLAIN, _train, _train_prefetch
from test_store_exact import StoreMachine

ALL = sorted(POLICIES)
HOT = np.arange(4, dtype=np.int64)  # four hot rows in a device tier of four
SCAN = np.arange(100, 110, dtype=np.int64)  # ten rows used once


def _policy_file(path: Path, name: str, admission: str = "tinylfu") -> Path:
    path.write_text(f'name = "{name}"\n[params]\nadmission = "{admission}"\n')
    return path


def _scan_trace(tmp_path) -> Path:
    """The hot rows five times round, a scan of one-hit wonders, the hot rows five times."""
    ids = np.concatenate([np.tile(HOT, 5), SCAN, np.tile(HOT, 5)])
    return write_trace(tmp_path / "scan", ["t"], ids, np.ones((ids.size, 1), dtype=np.int64), updates=False)


def _misses(trace, policy: str, admission: str) -> int:
    spec = PolicySpec(policy, {"admission": admission})
    return simulate(trace, SimConfig(device_rows=4, host_rows=0, policy=spec)).device_misses


def test_a_one_hit_wonder_does_not_displace_a_hot_row(tmp_path):
    """LRU: the scan evicts every hot row without the filter (4 warm-up + 10 scan + 4
    misses); with it, the first wonder takes one hot row's slot and every later one only
    the slot of the wonder before it, on probation (4 + 10 + 1)."""
    tr = _scan_trace(tmp_path)
    assert _misses(tr, "lru", "off") == 18
    assert _misses(tr, "lru", "tinylfu") == 15


@pytest.mark.parametrize("name", ALL)
def test_every_policy_keeps_its_hot_rows_through_a_scan_with_the_filter(tmp_path, name):
    """Whatever the policy, with the filter the scan costs at most one hot row (and never
    more misses than without it)."""
    tr = _scan_trace(tmp_path)
    on, off = _misses(tr, name, "tinylfu"), _misses(tr, name, "off")
    assert on <= 4 + 10 + 1
    assert on <= off


def test_the_rule_is_the_stores(tmp_path):
    """The same trace through a real store (host tier of one row): the store refuses the
    same rows, and the simulator reproduces its counters."""
    f = _policy_file(tmp_path / "p.toml", "lru")
    store = hm.HierarchicalStore([hm.TableSpec("t", 200, 2)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=4, host_rows=1, policy=str(f),
                                                trace_path=tmp_path / "rec"))
    assert store._dev.policy.filtering and not store._host.policy.filtering  # the device tier's only
    for i in np.concatenate([np.tile(HOT, 5), SCAN, np.tile(HOT, 5)]):
        store.lookup("t", torch.tensor([int(i)]))
    table = store.counters.table.clone()
    store.close()
    assert int(table[0, hm.Tier.DEVICE, hm.Stat.MISSES]) == 15
    res = simulate(tmp_path / "rec", SimConfig(device_rows=4, host_rows=1, policy=f, updates=False))  # lookups only
    assert torch.equal(res.counters.table, table)


@pytest.mark.parametrize("policy", PLAIN)
def test_sim_reproduces_store_counters_with_the_filter(tmp_path, policy):
    """Several tables, tiny tiers, LMDB write-backs: counters and bytes equal, with the
    filter on (the simulator hashes rows as the store does)."""
    f = _policy_file(tmp_path / "p.toml", policy)
    tables = [hm.TableSpec("users", 400, 4), hm.TableSpec("items", 250, 4), hm.TableSpec("tags", 30, 4)]
    table, io, width = _train(tmp_path, str(f), tables, steps=50, device_rows=24, host_rows=40, seed=0)
    res = simulate(load_trace(tmp_path / "trace"), SimConfig(device_rows=24, host_rows=40, policy=f,
                                                             row_bytes=width * 4))
    assert torch.equal(res.counters.table, table)
    for k in (IO.BYTES_HOST_TO_DEVICE, IO.BYTES_DEVICE_TO_HOST, IO.BYTES_DISK_TO_HOST, IO.BYTES_HOST_TO_DISK):
        assert int(res.counters.io[k]) == int(io[k]), k.name
    off = simulate(load_trace(tmp_path / "trace"), SimConfig(device_rows=24, host_rows=40, row_bytes=width * 4,
                                                             policy=PolicySpec(resolve_policy(f).name)))
    assert not torch.equal(off.counters.table, table)  # the filter changed what stayed


@pytest.mark.parametrize("policy,depth", [("lru", 2), ("s3fifo", 1), ("lfu_decay", 3)])
def test_sim_reproduces_store_with_prefetch_and_the_filter(tmp_path, policy, depth):
    f = _policy_file(tmp_path / "p.toml", policy)
    tables = [hm.TableSpec("users", 400, 4), hm.TableSpec("items", 250, 4)]
    table, io, width = _train_prefetch(tmp_path, str(f), tables, 50, 40, 60, depth, seed=depth)
    res = simulate(tmp_path / "trace", SimConfig(device_rows=40, host_rows=60, policy=f, prefetch_depth=depth,
                                                 row_bytes=width * 4))
    assert torch.equal(res.counters.table, table)
    for k in IO:
        if k not in (IO.FLUSHES, IO.FLUSHED_ROWS, IO.LATE_PREFETCHES):
            assert int(res.counters.io[k]) == int(io[k]), k.name


@pytest.mark.parametrize("name", ALL)
def test_every_policy_takes_the_parameter(name):
    p = PolicySpec(name, {"admission": "tinylfu"}).build(16)
    assert p.admission == "tinylfu" and not p.filtering  # a tier turns it on
    p.attach_admission()
    assert p.filtering and p.hashes
    assert not PolicySpec(name).build(16).filtering


@pytest.mark.parametrize("value,err", [("lfu", hm.InvalidArgumentError), ("", hm.InvalidArgumentError),
                                       (1, hm.InvalidTypeError), (True, hm.InvalidTypeError),
                                       (None, hm.InvalidTypeError)])
@pytest.mark.parametrize("name", ["lru", "lfu_decay", "s3fifo", "lookahead"])
def test_a_bad_admission_is_a_typed_error(name, value, err):
    with pytest.raises(err, match="admission"):
        PolicySpec(name, {"admission": value}).build(8)


def test_a_bad_admission_in_a_policy_file_is_refused(tmp_path):
    with pytest.raises(hm.PolicyFileError, match="admission"):
        resolve_policy(_policy_file(tmp_path / "p.toml", "wtinylfu", "sometimes"))
    spec = resolve_policy(_policy_file(tmp_path / "q.toml", "wtinylfu"))
    assert spec.params == {"admission": "tinylfu"}


def test_lookahead_over_a_queue_base_keeps_the_filter():
    p = PolicySpec("lookahead", {"base": "s3fifo", "window": 2, "admission": "tinylfu"}).build(16)
    assert p.admission == "tinylfu" and p.wants_lookahead


# -- exact values against the flat reference, with the filter on -------------------------
_FILES = Path(tempfile.mkdtemp(prefix="hm-admission-"))  # policy files the machines reopen


def _exact_machine(opt: hm.Optimizer, policy: str):
    f = _policy_file(_FILES / f"{policy}.toml", policy)
    cls = type(f"AdmissionMachine_{opt.name}_{policy}", (StoreMachine,), {"optimizer": opt, "policy": str(f)})
    cls.TestCase.settings = settings(max_examples=12, stateful_step_count=30, deadline=None,
                                     suppress_health_check=list(HealthCheck))
    return cls


for _opt, _pol in ((hm.SGD(lr=0.3), "lfu"), (hm.Adagrad(lr=0.2), "lfu"), (hm.SGD(lr=0.3), "s3fifo"),
                   (hm.Adagrad(lr=0.2), "lru")):
    _m = _exact_machine(_opt, _pol)
    globals()[f"Test{_m.__name__}"] = _m.TestCase
