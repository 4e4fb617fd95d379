"""Loading an engine for a command: the model path, the cache directory, progress messages on stderr (a first
run's kernel compile on one line updated in place); and the text a user gives (-p, -f, chat lines) made into
valid text the same way everywhere."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column

from hybrid.engine.engine import Engine
from hybrid.engine.launch import launch
from hybrid.engine.params import EngineParams
from hybrid.model.files import default_cache_dir, resolve_model
from hybrid.system.compile import CompileStatus

from hybrid.cli.common import cache_dir


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class CompileProgress:
    """The library's compile status (hybrid.system.compile.CompileStatus) on stderr: on a terminal one line updated
    in place (kernels done of all, those compiling, elapsed); elsewhere a plain line every PLAIN_EVERY_S seconds;
    then one line with the total either way."""

    PLAIN_EVERY_S = 5.0

    def __init__(self) -> None:
        self._console = Console(stderr=True)
        names = TextColumn("{task.fields[running]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"))
        self._bar = Progress(SpinnerColumn(), TextColumn("compiling kernels"), MofNCompleteColumn(),
                             TimeElapsedColumn(), BarColumn(bar_width=20), names, console=self._console,
                             transient=True, expand=True)
        self._task = None
        self._last_plain = 0.0

    def __enter__(self) -> CompileProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._bar.stop()

    def __call__(self, st: CompileStatus) -> None:
        running = ", ".join(st.running)
        finished = st.done == st.total and not st.running
        if self._console.is_terminal:
            if self._task is None:
                self._bar.start()
                self._task = self._bar.add_task("", total=st.total, running=running)
            self._bar.update(self._task, completed=st.done, total=st.total, running=escape(running))
            if finished:
                self._bar.stop()
                self._task = None
        elif not finished and st.elapsed_s - self._last_plain >= self.PLAIN_EVERY_S:
            self._last_plain = st.elapsed_s
            note(f"compiling kernels: {st.done}/{st.total} ({running}), {st.elapsed_s:.1f} s")
        if finished:
            note(f"compiled {st.total} kernels in {st.elapsed_s:.1f} s ({st.workers} at a time)")


def load_engine(model: str | None, params: EngineParams, warn_ctx: bool = True) -> tuple[Engine, float]:
    """The engine for `model` (None: the demo model) and its load time in ms (hybrid.engine.launch). A context
    above the model's training context is said in one warning line (warn_ctx=False: not said)."""
    path = resolve_model(model, cache_dir())
    said: list[str] = []

    def progress(msg: str) -> None:
        said.append(msg)
        note(msg)

    with CompileProgress() as on_compile:
        engine, load_ms = launch(path, params, cache_dir() or default_cache_dir(), progress, on_compile)
    n_ctx, n_train = engine.params.n_ctx, engine.config.n_ctx_train
    if warn_ctx and n_ctx > n_train > 0 and not any(m.startswith("warning: -c ") for m in said):
        note(f"warning: -c {n_ctx} is larger than the model's training context {n_train}")
    return engine, load_ms


def clean_text(text: str) -> str:
    """Text from the command line or a terminal with any undecodable bytes (Python keeps them as surrogates)
    replaced by U+FFFD, so it can be tokenized and printed."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def read_text_file(path: str) -> str:
    """A -f file as llama.cpp reads it (one trailing newline dropped). Bytes that are not UTF-8 are read as U+FFFD,
    with one warning line naming the first one's offset."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        note(f"warning: {path} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
             "such bytes are read as U+FFFD")
        text = raw.decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\n") else text
