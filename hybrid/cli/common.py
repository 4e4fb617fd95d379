"""Options and helpers shared by the commands: the model argument, opening a model, counts formatting."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from gguf_io import GGUFFile, open_gguf
from hybrid.model.files import resolve_model

ModelArg = Annotated[
    Optional[str],
    typer.Argument(help="A GGUF path, or a known model's name (`hybrid list`; pulled on first use). Default: the demo "
                        "model (Gemma 3 270M Q4_K_M); to chat (chat, run -cnv), SmolLM2-135M-Instruct.",
                   show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def cache_dir() -> Path | None:
    env = os.environ.get("HYBRID_CACHE_DIR")
    return Path(env) if env else None


def open_model(model: str | None) -> GGUFFile:
    return open_gguf(resolve_model(model, cache_dir()))


def fmt_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)
