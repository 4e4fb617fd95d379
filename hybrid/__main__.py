from hybrid.cli.main import run

run()
