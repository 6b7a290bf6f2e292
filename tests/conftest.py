import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py


def pytest_collection_modifyitems(config, items):
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
