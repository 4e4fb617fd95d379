"""The command line: typer commands and rich rendering only (the library never prints)."""
