"""NCCL: sharded training with CUDA tensors over NCCL equals the unsharded store.

``scripts/nccl_check.py`` (world size 1, the one ``scripts/gpu_check.sh`` runs) and its
two-GPU variant; without CUDA the script says "no CUDA" and succeeds, and the GPU tests
skip.  The collectives' CPU path (gloo) is covered by tests/test_sharding_exec.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "nccl_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_nccl_check_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the GPU tests below run instead")
    r = _run()
    assert r.returncode == 0 and r.stdout.strip() == "no CUDA", r.stdout + r.stderr


def test_world_size_one_runs_every_applicable_sharding_over_gloo():
    """The world-size-1 check gpu_check.sh runs, on CPU ranks: column-wise has no shape on
    one rank and is reported as not applicable, the other four train exactly."""
    r = _run("--backend", "gloo", "--world", "1", "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CW    not applicable at world size 1" in r.stdout
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["backend"] == "gloo" and last["world_size"] == 1 and last["ok"] and last["worst_err"] <= 1e-5


@pytest.mark.gpu
def test_nccl_world_size_one():
    r = _run("--world", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["backend"] == "nccl" and last["comm_device"].startswith("cuda") and last["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_gpus():
    r = _run("--world", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["backend"] == "nccl" and last["world_size"] == 2 and last["ok"]
