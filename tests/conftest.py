import sys
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
