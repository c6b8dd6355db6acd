from autopolicy.cli import run

run()
