"""The control plane's kernels compiled and interpreted (``NUMBA_DISABLE_JIT=1``) make the
same plans: victims, slots, keys, counters, for every registered policy, with pins,
unaccounted placements, lookahead marks and the compiled replay, with and without the
admission filter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hiermem.core.policies import POLICIES

DRIVER = Path(__file__).with_name("parity_driver.py")


def _run(policy: str, seed: int, jit: bool, admission: str) -> dict:
    env = dict(os.environ, NUMBA_DISABLE_JIT="0" if jit else "1")
    out = subprocess.run([sys.executable, str(DRIVER), policy, str(seed), admission], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# every policy at two seeds without the admission filter, and at one with it
CASES = [(p, s, "off") for p in sorted(POLICIES) for s in (0, 1)] + [(p, 0, "tinylfu") for p in sorted(POLICIES)]


@pytest.mark.parametrize("policy,seed,admission", CASES)
def test_compiled_equals_interpreted(policy, seed, admission):
    compiled, interpreted = _run(policy, seed, True, admission), _run(policy, seed, False, admission)
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
