"""The package's layers, read from its own imports: every import points down (or within its
own layer), no module imports one that imports it back, and the top level holds only the
package's entry points and its value types."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hiermem"

#: lowest first; a module may import its own layer or any layer before it
LAYERS = [
    "errors",     # HierMemError and its subclasses
    "core",       # the control plane: compiled decisions over arrays (index, policies, victims, plans)
    "dataplane",  # the data plane: pooling, fused optimizers, CUDA staging (and the optimizers' math)
    "types",      # the value types: tables, tiers, a store's config (naming policies and optimizers)
    "observe",    # counters, Prometheus metrics, the trace format
    "tiers",      # the device/host slot tiers and the LMDB disk tier
    "store",      # HierarchicalStore: residency, batches, checkpoints, read-only handles
    "nn",         # torch modules, the prefetch pipeline, features, TorchRec interop, the DLRM
    "sim",        # the simulator, bounds and the tuner
    "sharding",   # the planner and the distributed execution
    "cli",        # the hiermem command and its demo
    "__main__",
    "__init__",   # the public API
]


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every hiermem module ``path`` imports, at module level or inside a function."""
    mod, is_pkg = _module(path), path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import module` imports the module
                sub = f"{target}.{a.name}"
                out.add(sub if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (PKG.parent / Path(*sub.split("."))).is_dir() else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "hiermem" or m.startswith("hiermem.")}


def _layer(mod: str) -> int:
    parts = mod.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS.index(name)


GRAPH = {_module(p): _imports(p) for p in sorted(PKG.rglob("*.py"))}


def test_top_level_holds_only_entry_points_errors_and_types():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "__main__.py", "errors.py", "types.py"]
    assert {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == \
        set(LAYERS) - {"errors", "types", "__main__", "__init__"}


@pytest.mark.parametrize("mod", sorted(GRAPH))
def test_every_import_points_down(mod):
    up = sorted(t for t in GRAPH[mod] if _layer(t) > _layer(mod))
    assert not up, f"{mod} imports from a higher layer: {up}"


def test_no_module_imports_one_that_imports_it_back():
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if t in GRAPH and t != m and not m.startswith(t + "."):  # a package's own modules
                visit(t)
        stack.pop()

    for m in sorted(GRAPH):
        if not m.endswith("__init__"):
            visit(m)
    assert not cycles, cycles[:5]


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule can fail: an import from ``core`` up to ``store`` is an upward arrow."""
    assert _layer("hiermem.core.plan") < _layer("hiermem.store.hierarchical")
    assert "hiermem.store.hierarchical" in GRAPH["hiermem.nn.modules"] or \
        any(t.startswith("hiermem.store") for t in GRAPH["hiermem.nn.modules"])
