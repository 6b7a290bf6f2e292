"""Secure defaults: servers bind loopback unless told otherwise, store directories and files
are private to their owner, and no code path unpickles a file.

The source scans are checked against snippets that break each rule, so a scan that
stopped finding anything would fail here too.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import hiermem as hm
import hiermem.observe.metrics
from hiermem.cli import main as cli
from hiermem.nn.data import criteo_cat_ids

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "hiermem").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# -- servers -------------------------------------------------------------------------------
def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(f):
            continue
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


def test_serve_metrics_binds_loopback_by_default(tmp_path):
    server, _ = hm.serve_metrics(0, registry=CollectorRegistry())
    try:
        assert server.server_address[0] == "127.0.0.1"
        if os.path.exists("/proc/net/tcp"):
            assert _listening(server.server_port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 / ::
    finally:
        server.shutdown()


def test_every_cli_server_binds_loopback_by_default(tmp_path, monkeypatch):
    calls = []
    real = hiermem.observe.metrics.start_http_server

    def spy(port, addr="0.0.0.0", registry=None):  # prometheus_client's own default is 0.0.0.0
        calls.append(addr)
        return real(port, addr=addr, registry=CollectorRegistry())
    monkeypatch.setattr(hiermem.observe.metrics, "start_http_server", spy)
    path = tmp_path / "store"  # (the demo's --metrics-addr is checked through the parser below)
    hm.HierarchicalStore([hm.TableSpec("t", 10, 4)], hm.StoreConfig(path=path, device_rows=2, host_rows=4)).close()
    assert cli.main(["serve", str(path), "--port", "0", "--seconds", "0"]) == 0
    assert calls == ["127.0.0.1"]
    # and every address-like option of every subcommand defaults to loopback
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    seen = []
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.dest.endswith(("addr", "host", "bind", "address")):
                seen.append(a.dest)
                assert a.default in LOOPBACK, f"hiermem {name} {a.option_strings}: default {a.default!r}"
    assert {"addr", "metrics_addr"} <= set(seen)


_ADDR_PARAMS = {"addr", "address", "host", "bind", "bind_addr", "metrics_addr", "listen"}


def address_violations(tree: ast.AST) -> list[str]:
    """Parameters named like an address whose default is not loopback, and wildcard literals."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for a, d in pairs:
                if a.arg in _ADDR_PARAMS and not (isinstance(d, ast.Constant) and d.value in LOOPBACK):
                    bad.append(f"line {node.lineno}: {node.name}({a.arg}=...) does not default to loopback")
        if isinstance(node, ast.Constant) and node.value in ("0.0.0.0", "::"):
            bad.append(f"line {node.lineno}: wildcard address literal {node.value!r}")
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in _ADDR_PARAMS and isinstance(kw.value, ast.Constant) \
                        and isinstance(kw.value.value, str) and kw.value.value not in LOOPBACK:
                    bad.append(f"line {node.lineno}: {kw.arg}={kw.value.value!r}")
    return bad


def test_no_source_binds_a_wildcard_address():
    for f in SOURCES:
        assert address_violations(ast.parse(f.read_text())) == [], f
    # the scan sees what it must
    assert address_violations(ast.parse("def serve(port, addr='0.0.0.0'): pass"))
    assert address_violations(ast.parse("start_http_server(9400, addr='')"))
    assert address_violations(ast.parse("s.bind(('0.0.0.0', 80))"))
    assert not address_violations(ast.parse("def serve(port, addr='127.0.0.1'): pass"))


# -- unpickling ------------------------------------------------------------------------------
_PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib", "jsonpickle"}
_BANNED_CALLS = {"read_pickle", "loads_pickle", "Unpickler"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _kw_is(call: ast.Call, name: str, value) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def unpickling_violations(tree: ast.AST) -> list[str]:
    """Imports of pickle-like modules, ``torch.load`` without ``weights_only=True``,
    ``np.load`` without ``allow_pickle=False``, and any ``allow_pickle=True``."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLERS:
            bad.append(f"line {node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            fn = _name(node.func)
            last = fn.rsplit(".", 1)[-1]
            if fn == "torch.load" and not _kw_is(node, "weights_only", True):
                bad.append(f"line {node.lineno}: torch.load without weights_only=True")
            if fn in ("np.load", "numpy.load") and not _kw_is(node, "allow_pickle", False):
                bad.append(f"line {node.lineno}: {fn} without allow_pickle=False")
            if _kw_is(node, "allow_pickle", True) or _kw_is(node, "weights_only", False):
                bad.append(f"line {node.lineno}: {fn} allows pickles")
            if last in _BANNED_CALLS:
                bad.append(f"line {node.lineno}: {fn}")
    return bad


def test_no_code_path_can_unpickle():
    for f in SOURCES:
        assert unpickling_violations(ast.parse(f.read_text())) == [], f
    for snippet in ("import pickle", "from dill import loads", "torch.load(f)", "torch.load(f, weights_only=False)",
                    "np.load(f)", "numpy.load(f, allow_pickle=True)", "np.load(f, mmap_mode='r')",
                    "pd.read_pickle(f)", "import shelve"):
        assert unpickling_violations(ast.parse(snippet)), snippet
    assert not unpickling_violations(ast.parse("torch.load(f, weights_only=True); np.load(f, allow_pickle=False)"))


class _Payload:
    """Unpickling this creates a file: proof that a pickle ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_data_reader_refuses_a_pickled_npy(tmp_path, monkeypatch):
    d = tmp_path / "data" / "criteo-dac-head8k"
    d.mkdir(parents=True)
    marker = tmp_path / "pwned"
    np.save(d / "cat_ids.npy", np.array([_Payload(str(marker))], dtype=object), allow_pickle=True)
    monkeypatch.setenv("HIERMEM_DATA", str(tmp_path / "data"))
    with pytest.raises(ValueError, match="allow_pickle"):
        criteo_cat_ids()
    assert not marker.exists()


def test_torch_load_of_a_malicious_file_is_refused_the_way_hiermem_calls_it(tmp_path):
    """The one allowed form, ``torch.load(weights_only=True)``, runs no pickle payload."""
    f, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"x": _Payload(str(marker))}, f)
    with pytest.raises(Exception):
        torch.load(f, weights_only=True)
    assert not marker.exists()


# -- file modes -----------------------------------------------------------------------------------
def _modes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): stat.S_IMODE(p.stat().st_mode) for p in [path, *path.rglob("*")]}


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o002])
def test_every_file_a_store_creates_is_private(tmp_path, umask):
    """The store directory is 0700 and every file in it (LMDB's data.mdb and lock.mdb,
    hiermem.lock, anything added later) 0600 or stricter, whatever the umask."""
    old = os.umask(umask)
    try:
        path = tmp_path / "a" / "store"
        s = hm.HierarchicalStore([hm.TableSpec("t", 100, 4)], hm.StoreConfig(path=path, device_rows=2, host_rows=4))
        for i in range(0, 100, 6):
            s.write("t", torch.arange(i, min(i + 6, 100)), torch.ones(min(6, 100 - i), 4))
        s.flush()
        while_open = _modes(path)
        s.close()
        s = hm.HierarchicalStore.open(path)
        s.close()
        after = _modes(path)
    finally:
        os.umask(old)
    for modes in (while_open, after):
        assert modes.pop(".") == 0o700
        assert {"data.mdb", "lock.mdb", "hiermem.lock"} <= set(modes)
        for name, mode in modes.items():
            assert mode & 0o077 == 0, f"{name}: {oct(mode)}"
            assert mode & 0o111 == 0, f"{name} is executable: {oct(mode)}"


def test_reopening_makes_loosened_store_files_private_again(tmp_path):
    path = tmp_path / "store"
    hm.HierarchicalStore([hm.TableSpec("t", 10, 4)], hm.StoreConfig(path=path, device_rows=2, host_rows=4)).close()
    for f in ("data.mdb", "lock.mdb", "hiermem.lock"):
        os.chmod(path / f, 0o666)
    s = hm.HierarchicalStore.open(path)
    try:
        modes = _modes(path)
    finally:
        s.close()
    for f in ("data.mdb", "lock.mdb", "hiermem.lock"):
        assert modes[f] == 0o600, (f, oct(modes[f]))


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_checkpoints_and_restored_stores_are_private(tmp_path, umask):
    old = os.umask(umask)
    try:
        s = hm.HierarchicalStore([hm.TableSpec("t", 100, 4)], hm.StoreConfig(path=tmp_path / "s", device_rows=2,
                                                                             host_rows=4))
        s.write("t", torch.arange(6), torch.ones(6, 4))
        ck = s.checkpoint(tmp_path / "ckpts" / "c1")
        s.close()
        r = hm.HierarchicalStore.restore(ck, tmp_path / "restored")
        r.close()
    finally:
        os.umask(old)
    for d in (ck, tmp_path / "restored"):
        modes = _modes(d)
        assert modes.pop(".") == 0o700, d
        assert "data.mdb" in modes
        for name, mode in modes.items():
            assert mode & 0o077 == 0, f"{d}/{name}: {oct(mode)}"
    leftovers = [p.name for p in tmp_path.rglob(".*")]
    assert leftovers == [], leftovers  # no temporary copies left behind
