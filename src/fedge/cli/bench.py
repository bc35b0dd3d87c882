"""``fedge bench``: benchmarks that print JSON (see bench/ and BENCHMARKS.md)."""

import typer

app = typer.Typer(help="Benchmarks (JSON output, machine named, peer side by side).")
