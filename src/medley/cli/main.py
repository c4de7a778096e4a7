"""The `medley` command. Each group of commands lives in its own module and registers here."""

from __future__ import annotations

import typer

from medley.cli import demo, plan_cmd, profile_cmd, simulate_cmd, spec_cmds, train_cmd

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
spec_cmds.register(app)
simulate_cmd.register(app)
demo.register(app)
train_cmd.register(app)
plan_cmd.register(app)
profile_cmd.register(app)


@app.command()
def version() -> None:
    """Print medley's version."""
    from medley import __version__

    typer.echo(__version__)

if __name__ == "__main__":
    app()
