import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

# PrefetchPipeline's default ("auto") runs prefetch inline where no core is free, as on a
# 2-core CI machine; the suite keeps exercising the background threads (the GPU path's
# mode) unless a test asks for inline or auto itself (tests/test_modules.py).
os.environ.setdefault("HIERMEM_BACKGROUND", "threads")


#: Long tests, left out by `pytest -m "not slow"` (the full suite and CI still run them):
#: file -> test names (None: the whole file).  Tests may also carry @pytest.mark.slow.
SLOW = {
    "test_torture.py": {"test_kills_lose_and_tear_nothing"},  # kills a trainer, once per mode
    "test_concurrency.py": None,  # soaks: threads scraping, flushing, checkpointing
    "test_fuzz.py": None,  # hypothesis state machines and trace corruptions
    "test_sharding_exec.py": None,  # gloo process groups of 2 and 4
    "test_sharding_bench.py": None,  # runs the sharding benchmark scripts
    "test_core_parity.py": None,  # every kernel again with NUMBA_DISABLE_JIT=1
    "test_tune.py": {"test_readme_tuning_commands_run"},  # imports the shared traces and tunes
    "test_sim.py": {"test_movielens_lru_sim_equals_cachetools_and_libcachesim"},
}


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        names = SLOW.get(item.path.name, ())
        if names is None or item.originalname in names:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from hypothesis import Phase, settings  # noqa: E402

# HYPOTHESIS_PROFILE=noshrink reports the first failing example at once (mutation checks)
settings.register_profile("noshrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "default"))


@contextmanager
def mounted_tmpfs(where: Path, size: str):
    """A tmpfs of ``size`` (mount(8) syntax) mounted at the new directory ``where``."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (container without CAP_SYS_ADMIN?): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs: a disk that fills."""
    with mounted_tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt
