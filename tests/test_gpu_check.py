"""scripts/gpu_check.sh: on a machine without CUDA it says so and exits 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the whole check (minutes)")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA" in r.stdout
    assert "bench_store" not in r.stdout  # nothing else ran


def test_gpu_check_refuses_an_interpreter_without_torch():
    """A probe that cannot even import torch is an error (exit 2), never "no CUDA"."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": "/nonexistent/python"}, timeout=60)
    assert r.returncode == 2 and "cannot import torch" in r.stderr and "no CUDA" not in r.stdout
