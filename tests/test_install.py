"""scripts/install.sh picks the right torch build (dry run: nothing is downloaded), and the
package declares what ``import hiermem`` needs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install.sh"


def _fake_bin(tmp_path: Path, gpu: bool | None, torch: bool) -> dict:
    """PATH with a fake ``nvidia-smi`` (listing a GPU, failing, or absent) and a python
    that cannot import torch unless ``torch``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    if gpu is not None:
        smi = bin_ / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu else
                                         "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"))
        smi.chmod(0o755)
    py = bin_ / "python-under-test"
    no_torch = "" if torch else 'case "$*" in *"import torch"*) exit 1;; esac\n'
    py.write_text(f"#!/bin/sh\n{no_torch}exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    path = str(bin_) + os.pathsep + "/usr/bin:/bin"
    return {**os.environ, "PATH": path, "PYTHON": str(py), "HIERMEM_INSTALL_DRY_RUN": "1"}


def _run(env: dict, *extras: str) -> str:
    r = subprocess.run(["bash", str(SCRIPT), *extras], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_nvidia_gpu_gets_the_cuda_build(tmp_path):
    out = _run(_fake_bin(tmp_path, gpu=True, torch=False))
    assert "an NVIDIA GPU is present (GPU 0: NVIDIA H100" in out
    pip = [ln for ln in out.splitlines() if ln.startswith("would run:")]
    assert "install torch==2.13.0" in pip[0] and "+cpu" not in pip[0] and "whl/cpu" not in pip[0]


@pytest.mark.parametrize("gpu", [None, False], ids=["no-nvidia-smi", "nvidia-smi-fails"])
def test_no_gpu_gets_the_cpu_build_from_pytorchs_cpu_index(tmp_path, gpu):
    out = _run(_fake_bin(tmp_path, gpu=gpu, torch=False), "test")
    assert "no NVIDIA GPU: installing the CPU build torch==2.13.0+cpu" in out
    pip = [ln for ln in out.splitlines() if ln.startswith("would run:")]
    assert "torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu" in pip[0]
    assert pip[1].endswith("install -e .[test]")


def test_an_installed_torch_is_kept(tmp_path):
    out = _run(_fake_bin(tmp_path, gpu=True, torch=True))
    assert "torch: keeping the installed" in out
    assert not any("torch==" in ln for ln in out.splitlines() if ln.startswith("would run:"))


def _third_party_imports(root: Path) -> set[str]:
    """Top-level modules imported at module level (not inside functions or try) by the package."""
    found = set()
    for f in root.rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in sys.stdlib_module_names and n not in ("hiermem", "__future__")}


def test_every_module_level_import_is_a_declared_dependency():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {d.split(">")[0].split("=")[0].split("<")[0].strip().replace("-", "_") for d in deps}
    assert _third_party_imports(ROOT / "hiermem") <= declared, declared
    assert "numba" in declared  # `import hiermem` compiles the control plane with it


def test_the_plain_test_extra_has_no_heavy_peers():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(d.startswith(("libcachesim", "fbgemm", "torchrec")) for d in extras["test"])
    assert "test peers" in (ROOT / ".ci" / "run").read_text()  # CI still runs the cross-checks
