"""The control plane's kernels compiled and interpreted (``NUMBA_DISABLE_JIT=1``) make the
same plans: victims, slots, keys, counters, for every registered policy, with pins,
unaccounted placements, lookahead marks and the compiled replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hiermem.core.policies import POLICIES

DRIVER = Path(__file__).with_name("parity_driver.py")


def _run(policy: str, seed: int, jit: bool) -> dict:
    env = dict(os.environ, NUMBA_DISABLE_JIT="0" if jit else "1")
    out = subprocess.run([sys.executable, str(DRIVER), policy, str(seed)], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_compiled_equals_interpreted(policy, seed):
    compiled, interpreted = _run(policy, seed, True), _run(policy, seed, False)
    assert compiled == interpreted
    assert any(s == 0 for s in compiled["statuses"])
    assert sum(sum(sum(t) for t in tier) for tier in compiled["counters"]) > 0


def test_warm_child_compiles_this_checkout(tmp_path):
    """The first import compiles half the kernels in a child process: the child must
    import this checkout's hiermem (not another one on the path) without warming up
    again itself, and exit cleanly (here it loads the cached kernels)."""
    import hiermem
    from hiermem.store import warm

    code = "import hiermem, sys; print(hiermem.__file__); sys.exit(int(hiermem.store.warm.ensure_compiled(True) != 0))"
    out = subprocess.run([sys.executable, "-c", code], env=warm._child_env(), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr  # ensure_compiled is a no-op in the child, even forced
    assert Path(out.stdout.strip()) == Path(hiermem.__file__)
    child = warm._start_child()
    if child is None:
        pytest.skip("one core: the kernels compile in this process only")
    assert child.wait(timeout=600) == 0
