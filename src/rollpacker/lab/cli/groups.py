"""The lab's command groups: ``lab_app`` (``rollpacker lab``) and its ``bench`` subgroup."""

from __future__ import annotations

import typer

lab_app = typer.Typer(
    help="The lab: benchmarks, the what-if simulator, profiling, soak and chaos (apart from the product).",
    no_args_is_help=True,
)
bench_app = typer.Typer(help="Benchmarks that print figures and write JSON.", no_args_is_help=True)
lab_app.add_typer(bench_app, name="bench")
