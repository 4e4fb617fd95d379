"""`hybrid serve`: the OpenAI-compatible HTTP server (hybrid.server): load once, warm up, print the URL, serve
until Ctrl-C. The HTTP side starts first, so /health answers 503 while the model loads."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from hybrid.engine.params import EngineParams
from hybrid.model.files import resolve_model
from hybrid.server.paged_scheduler import PagedScheduler
from hybrid.server.reasoning import REASONING_FORMATS
from hybrid.server.state import ServerConfig, ServerState
from hybrid.system.sizes import format_size, parse_size

from hybrid.cli.common import cache_dir
from hybrid.cli.options import LOAD_FLAGS, ChatTemplateOpt, ModelArgument, ModelOpt, engine_flags
from hybrid.cli.session import load_engine, note
from hybrid.cli.spec_options import SpecOptions, make_speculator, spec_flags


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise typer.BadParameter(f"{value}: give 0 to 65535 (0 = any free port)")
    return value


def _reasoning(value: str) -> str:
    if value not in REASONING_FORMATS:
        raise typer.BadParameter(f"{value!r}: give one of {', '.join(REASONING_FORMATS)}")
    return value


def _size(value: str) -> str:
    try:
        parse_size(value)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a usage error
        raise typer.BadParameter(f"{value!r}: give a size such as 2GiB or 512MiB ({exc})") from None
    return value


def _api_key(key: str | None, key_file: str | None) -> str | None:
    if key is not None and key_file is not None:
        raise typer.BadParameter("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = Path(key_file).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise typer.BadParameter(f"--api-key-file {key_file}: {exc}") from None
        if not key:
            raise typer.BadParameter(f"--api-key-file {key_file} is empty")
    if key is not None and not key.strip():
        raise typer.BadParameter("--api-key is empty")
    return key


def _slots(n: int) -> str:
    return "one slot" if n == 1 else f"{n} slots (continuous batching)"


def _cache_words(state, cache_ram: int) -> str:
    """How the KV cache is laid out and where prompts are cached, for the start-up line."""
    kv = getattr(state.scheduler, "kv", None)  # a PagedScheduler's pool
    if kv is None:
        return f"KV cache {format_size(state.kv_bytes)}; prompt cache up to {format_size(cache_ram)} of RAM"
    return (f"paged KV cache {format_size(state.kv_bytes)}: {kv.pool.n_blocks} blocks of {kv.block_size}, shared by "
            "the slots and the prefix cache")


@engine_flags(*LOAD_FLAGS, ubatch=None)  # -ub auto: launch.resolve_ubatch
@spec_flags
def serve(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default; 0.0.0.0 for every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", callback=_port, help="Port to listen on (0 = any free port).")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Ask clients for this key (Authorization: Bearer KEY); /health and the page stay open.")] = None,
    api_key_file: Annotated[Optional[str], typer.Option("--api-key-file", help="Read the API key from a file.")] = None,
    alias: Annotated[Optional[str], typer.Option("-a", "--alias", help="The model's name in the API (default: the file's name).")] = None,
    cache_ram: Annotated[str, typer.Option("--cache-ram", callback=_size, help="Host RAM for prompt caches of conversations the slot switched away from (0 = only the slot's own KV cache).")] = "2GiB",
    reasoning_format: Annotated[str, typer.Option("--reasoning-format", callback=_reasoning, help="deepseek/auto: <think>…</think> at the start of a reply comes back as reasoning_content; none: left in the content.")] = "deepseek",
    chat_template: ChatTemplateOpt = None,
    n_parallel: Annotated[int, typer.Option("-np", "--parallel", min=1, help="Generation slots: above 1, requests run together in continuous batches (decode first, then prompt chunks within -b), the context -c split evenly among the slots. Speculative decoding needs -np 1.")] = 1,
    params: EngineParams = EngineParams(),
    spec: SpecOptions = SpecOptions(),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat and text completions, streaming), with a chat page.

    Point a client at it: OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="KEY or anything").

    Example: hybrid serve smollm2 --port 8080
    """
    key = _api_key(api_key, api_key_file)
    if spec.kind != "none" and n_parallel > 1:  # usage errors before anything loads
        raise typer.BadParameter("speculative decoding (--spec-type, -md) runs with one slot: give -np 1",
                                 param_hint="'-np'")
    path = resolve_model(model, cache_dir(), command="serve")
    config = ServerConfig(alias=alias or path.stem, api_key=key, cache_ram=parse_size(cache_ram),
                          reasoning_format=reasoning_format, chat_template=chat_template,
                          n_parallel=n_parallel)
    state = ServerState(config)
    from hybrid.server.running import HttpThread, work  # noqa: PLC0415 - uvicorn: only `serve` needs it

    http = HttpThread(state, host, port)
    http.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: stop loading or serving
    try:
        engine, _ = load_engine(str(path), params)
        state.speculator = make_speculator(spec, engine, params, load_engine)
        engine.warmup()
        state.attach(engine)
        if isinstance(state.scheduler, PagedScheduler) and (warmed := state.scheduler.warm_up()):
            note(f"decode graphs captured for 1-{warmed} sequences")
        print(f"hybrid serve: {config.alias} at {http.url}/v1 (chat page {http.url}/), {_slots(n_parallel)} of "
              f"{state.n_ctx} tokens ({_cache_words(state, config.cache_ram)}), "
              f"chat template {state.template.name}{', API key required' if key else ''}"
              f"{'; speculative decoding: ' + spec.kind if state.speculator else ''}; Ctrl-C stops",
              flush=True)
        work(state, stop)
    except KeyboardInterrupt:
        note("stopped")
    finally:
        http.stop()
