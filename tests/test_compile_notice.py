"""The one-line notice before a kernel that the import's warm-up leaves to its first use
(the simulator's replay loop) compiles: printed when no cached machine code exists,
once per process, and never for a kernel already compiled or loaded."""

import importlib.util
import sys

import pytest

from hiermem.core import jit


def _module(tmp_path, name):
    src = tmp_path / f"{name}.py"
    src.write_text("import numba\n\n@numba.njit(cache=True)\ndef f(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location(name, src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(jit.DISABLED, reason="no compilation with NUMBA_DISABLE_JIT")
def test_notice_only_before_a_first_compile(tmp_path, capsys):
    mod = _module(tmp_path, "hiermem_notice_a")
    jit.announce_compile(mod.f, "the test kernel")
    assert capsys.readouterr().err == "hiermem: compiling the test kernel once (cached for later runs) ...\n"
    jit.announce_compile(mod.f, "the test kernel")  # once per process
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(jit.DISABLED, reason="no compilation with NUMBA_DISABLE_JIT")
def test_no_notice_for_a_cached_kernel(tmp_path, capsys):
    mod = _module(tmp_path, "hiermem_notice_c")
    assert mod.f(2) == 3  # compiled now, cached on disk
    fresh = _module(tmp_path, "hiermem_notice_c")  # a new dispatcher over the same source: loads the cache
    jit.announce_compile(fresh.f, "the test kernel")
    assert capsys.readouterr().err == ""


def test_not_a_dispatcher_says_nothing(capsys):
    jit.announce_compile(lambda x: x, "a plain function")
    assert capsys.readouterr().err == ""
