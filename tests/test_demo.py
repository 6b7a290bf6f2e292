"""``hiermem demo`` as a user meets it: runs kept, resume with the run's settings, signals,
checkpoint pruning and atomic re-saves, private files, held-out metrics, lifetime stats."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hiermem.cli.main import main
from hiermem.cli.demo_data import auc, log_loss, real_data_dir

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--synthetic", "--batch", "32", "--device-rows", "1024", "--host-rows", "2048", "--no-progress", "--no-png"]


def _demo(path, *extra) -> list[str]:
    return ["demo", *SMALL, "--path", str(path), *extra]


def _summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_a_second_run_keeps_the_first_runs_checkpoint(tmp_path, capsys):
    run = tmp_path / "demo"
    assert main(_demo(run, "--steps", "3")) == 0
    first = _summary(capsys.readouterr().out)["checkpoint"]
    assert main(_demo(run, "--steps", "2")) == 0
    out = capsys.readouterr().out
    assert Path(first).is_dir() and (run / "ckpt" / "LATEST").read_text().strip() == Path(first).name
    assert f"{run} holds an earlier run (kept" in out and f"this run writes {run}-2" in out
    assert _summary(out)["checkpoint"].startswith(str(run) + "-2")
    # --fresh is the only way to replace it
    assert main(_demo(run, "--steps", "2", "--fresh")) == 0
    assert "--fresh: removed the earlier run" in capsys.readouterr().out
    assert not Path(first).exists() and (run / "ckpt" / "step-0000002").is_dir()


@pytest.mark.slow
def test_resume_restores_the_runs_settings_and_refuses_a_conflicting_flag(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(_demo(run, "--steps", "4", "--dim", "8")) == 0
    capsys.readouterr()
    # no data or dim flag: the run's synthetic data and dim 8 come back
    assert main(["demo", "--resume", "--path", str(run), "--steps", "6", "--no-progress", "--no-png"]) == 0
    out = capsys.readouterr().out
    s = _summary(out)
    assert s["data"] == "synthetic" and s["start_step"] == 4 and s["steps"] == 2 and s["batch"] == 32
    assert "tables of dim 8" in out.splitlines()[0]
    # a conflicting flag is refused, naming the flag and both values; nothing changes
    before = sorted(p.name for p in (run / "ckpt").iterdir())
    assert main(["demo", "--resume", "--path", str(run), "--steps", "8", "--dim", "16"]) == 2
    err = capsys.readouterr().err
    assert "--dim 16" in err and "dim = 8" in err and "Traceback" not in err
    assert main(["demo", "--resume", "--path", str(run), "--steps", "8", "--device-rows", "512"]) == 2
    assert "--device-rows 512" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == before
    # nothing left to train: say what to do, train nothing, print no empty hit rates
    assert main(["demo", "--resume", "--path", str(run), "--no-progress", "--no-png", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "nothing left to train" in out and "--steps N above 6" in out and "hit rates" not in out


@pytest.mark.slow
def test_checkpoints_are_pruned_to_the_last_n(tmp_path, capsys):
    run = tmp_path / "p"
    assert main(_demo(run, "--steps", "7", "--checkpoint-every", "2")) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (run / "ckpt").glob("step-*")) == ["step-0000006", "step-0000007"]
    assert "keeping the last 2 (--keep-checkpoints)" in out
    assert main(["demo", "--resume", "--path", str(run), "--steps", "12", "--checkpoint-every", "2",
                 "--keep-checkpoints", "3", "--no-progress", "--no-png"]) == 0
    assert sorted(p.name for p in (run / "ckpt").glob("step-*")) == ["step-0000008", "step-0000010",
                                                                     "step-0000012"]


def test_checkpoint_files_are_private_under_a_loose_umask(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(_demo(tmp_path / "m", "--steps", "3", "--checkpoint-every", "2")) == 0
    finally:
        os.umask(old)
    run = tmp_path / "m"
    for p in [run, *run.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_resaving_a_step_never_leaves_a_moment_without_it(tmp_path, capsys, monkeypatch):
    run = tmp_path / "s"
    assert main(_demo(run, "--steps", "4", "--checkpoint-every", "2", "--depth", "0")) == 0
    ck = run / "ckpt"
    final = ck / "step-0000004"
    # a crash between the rename of step-4 and the update of LATEST: resume re-saves step-4
    (ck / "LATEST").write_text("step-0000002\n")
    gaps = []
    real_rmtree, real_rename = shutil.rmtree, os.rename

    def watch(fn):
        def wrapped(*a, **kw):
            r = fn(*a, **kw)
            if not (final / "dense.pt").is_file() or not (final / "emb").is_dir():
                gaps.append((fn.__name__, a[:2]))
            return r
        return wrapped

    monkeypatch.setattr(shutil, "rmtree", watch(real_rmtree))
    monkeypatch.setattr(os, "rename", watch(real_rename))
    assert main(["demo", "--resume", "--path", str(run), "--steps", "4", "--no-progress", "--no-png"]) == 0
    monkeypatch.undo()
    assert gaps == []
    assert (ck / "LATEST").read_text().strip() == "step-0000004" and (final / "dense.pt").is_file()


def _wait_for(proc, text: str, timeout: float = 240):
    """Read ``proc``'s stderr lines until one contains ``text``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return seen
    proc.kill()
    raise AssertionError(f"never saw {text!r}: {''.join(seen)}")


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_and_exits_with_one_line(tmp_path, sig, code):
    run = tmp_path / "sig"
    p = subprocess.Popen([sys.executable, "-m", "hiermem", *_demo(run, "--steps", "100000", "--log-every", "2",
                                                                      "--checkpoint-every", "100000")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    seen = _wait_for(p, "step 2/")
    p.send_signal(sig)
    out, err = p.communicate(timeout=240)
    err = "".join(seen) + err
    assert p.returncode == code, err
    assert "Traceback" not in err
    last = [ln for ln in err.splitlines() if ln.startswith("hiermem: ")]
    assert len(last) == 1 and last[0].startswith("hiermem: interrupted: stopped at step"), err
    step = int((run / "ckpt" / "LATEST").read_text().strip().split("-")[1])
    assert step >= 2 and (run / "ckpt" / f"step-{step:07d}" / "dense.pt").is_file()
    assert f"step-{step:07d}" in last[0] and "--resume" in last[0]


def test_port_in_use_is_one_line(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(_demo(tmp_path / "x", "--steps", "1", "--metrics-port", str(port))) == 2
        err = capsys.readouterr().err
        assert f"127.0.0.1:{port} is already in use: pick another --metrics-port" in err
        assert not (tmp_path / "x").exists()
        assert main(_demo(tmp_path / "st", "--steps", "1")) == 0
        capsys.readouterr()
        r = subprocess.run([sys.executable, "-m", "hiermem", "serve", str(tmp_path / "st" / "store"),
                            "--port", str(port), "--seconds", "1"], capture_output=True, text=True, env=_env())
    assert r.returncode == 2 and "already in use: pick another --port" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ctrl_c_anywhere_in_the_cli_is_one_line_and_130(monkeypatch, capsys):
    import hiermem.sim.tune as tune

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "tune", interrupted)
    assert main(["tune", "--trace", "t", "--device-rows", "4", "--host-rows", "4"]) == 130
    assert capsys.readouterr().err.strip() == "hiermem: interrupted"


@pytest.mark.slow
def test_stats_after_a_demo_shows_lifetime_counters(tmp_path, capsys):
    run = tmp_path / "st"
    assert main(_demo(run, "--steps", "3")) == 0
    s = _summary(capsys.readouterr().out)
    assert main(["stats", str(run / "store")]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 12 and "--json" in out
    device = next(ln for ln in out.splitlines() if ln.strip().startswith("device"))
    assert int(device.split("lookups")[1].split()[0].replace(",", "")) > 0
    assert main(["stats", str(run / "store"), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    hits = sum(st[f"C{j}"]["device"]["hits"] for j in range(1, 27))
    assert hits == s["device_hits"] > 0 and st["_store"]["flushes"] >= 1
    # the checkpoint carries them (as of the checkpoint: the test split's lookups came after)
    shutil.copytree(run / "ckpt" / "step-0000003" / "emb", tmp_path / "ck")
    assert main(["stats", str(tmp_path / "ck"), "--json"]) == 0
    ck = json.loads(capsys.readouterr().out)["stats"]
    at_ck = sum(ck[f"C{j}"]["device"]["hits"] for j in range(1, 27))
    assert 0 < at_ck < hits
    # and a resumed run adds to them
    assert main(["demo", "--resume", "--path", str(run), "--steps", "5", "--no-progress", "--no-png"]) == 0
    s2 = _summary(capsys.readouterr().out)
    assert main(["stats", str(run / "store"), "--json"]) == 0
    st2 = json.loads(capsys.readouterr().out)["stats"]
    assert sum(st2[f"C{j}"]["device"]["hits"] for j in range(1, 27)) == at_ck + s2["device_hits"]


def test_bad_flags_name_the_flag_and_create_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(_demo(tmp_path / "a", "--device-rows", "0"))
    assert e.value.code == 2 and "--device-rows: must be > 0" in capsys.readouterr().err
    assert main(_demo(tmp_path / "b", "--policy", "lruu")) == 2
    assert "lruu" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert main(_demo(tmp_path / "c", "--epochs", "2")) == 2
    assert "--epochs needs the real Criteo splits" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_version_help_defaults_and_log_lines(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    import hiermem

    assert capsys.readouterr().out.strip() == f"hiermem {hiermem.__version__}"
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    h = capsys.readouterr().out
    assert "(default 256)" in h and "(default: 2)" in h and "(default: runs/demo)" in h
    assert main(_demo(tmp_path / "l", "--steps", "4", "--log-every", "2")) == 0
    cap = capsys.readouterr()
    assert "step 2/4 loss" in cap.err and "step 4/4 loss" in cap.err
    first = cap.out.splitlines()[0]
    assert len(first) < 300 and "HierarchicalStore(" not in first


def test_demo_png_beside_the_checkpoint(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "png"
    assert main(["demo", *SMALL[:-1], "--path", str(run), "--steps", "3"]) == 0
    s = _summary(capsys.readouterr().out)
    assert s["png"] == str(run / "demo.png") and (run / "demo.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.skipif(real_data_dir() is None, reason="the shared Criteo data is absent")
def test_real_data_trains_by_epochs_with_held_out_metrics_and_all_tiers(tmp_path, capsys):
    run = tmp_path / "real"
    assert main(["demo", "--path", str(run), "--batch", "512", "--epochs", "2", "--device-rows", "2048",
                 "--host-rows", "4096", "--no-progress", "--no-png"]) == 0
    cap = capsys.readouterr()
    s = _summary(cap.out)
    assert s["data"] == "criteo-dac-head8k" and s["epochs"] == 2.0 and s["end_step"] == 2 * 15
    assert [int(e[0]) for e in s["dev"]] == [15, 30]  # dev after each epoch
    for e in s["dev"]:
        assert 0.3 < e[1] < 1.5 and 0.5 < e[2] <= 1.0
    assert s["test"]["rows"] == 391 and 0.5 < s["test"]["auc"] <= 1.0
    assert s["device_hit_rate"] > 0 and s["host_hit_rate"] > 0 and s["disk_hit_rate"] > 0
    assert "all three tiers serve lookups" in cap.out and "epoch 2: dev log loss" in cap.err


def test_log_loss_and_auc_match_their_definitions():
    import numpy as np

    y = np.array([0, 0, 1, 1, 1, 0], dtype=np.float32)
    p = np.array([0.1, 0.4, 0.35, 0.8, 0.4, 0.4])
    # pairs (pos, neg): 3 x 3 = 9; pos 0.35 beats 0.1 only; 0.8 beats all; 0.4 beats 0.1, ties two 0.4s
    assert auc(y, p) == pytest.approx((1 + 3 + 1 + 0.5 * 2) / 9)
    assert log_loss(y, p) == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    assert np.isnan(auc(np.ones(3), p[:3]))
