"""The `medley` command line: the app, its global options and the exit rules every command shares."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from medley.cli import (
    check_cmd,
    demo,
    doctor_cmd,
    hf_cmd,
    launch_cmd,
    plan_cmd,
    profile_cmd,
    simulate_cmd,
    spec_cmds,
    train_cmd,
)
from medley.cli.error_exit import guarded
from medley.errors import DEBUG_ENV

HELP = (
    "medley plans, simulates and runs hybrid-parallel (pipeline x data x ZeRO) LLM training on "
    "clusters of mixed accelerators.\n\n"
    "In the order of use: look at the device catalog (devices), describe your cluster (cluster show), "
    "see what a model costs on it (model show), search the best plans (plan), re-simulate a plan file "
    "(show) or one described by flags (simulate), build its ranks at full scale on this CPU (check), "
    "train it for real (train; export a checkpoint as a Hugging Face model with export) or write the "
    "per-node commands that train it on the cluster (launch; doctor checks a node against the plan), "
    "measure this machine (profile) and check how right the simulator is (fidelity). `medley demo` runs "
    "the whole story."
)
# The commands in the order a user meets them (`medley --help` lists them so).
ORDER = ("devices", "cluster", "model", "plan", "show", "simulate", "check", "train", "export", "doctor",
         "launch", "profile", "fidelity", "demo", "version")


class MedleyGroup(TyperGroup):
    """The top-level group: commands listed in the order of use, every command run under
    :func:`medley.cli.error_exit.guarded` (one line and an exit status instead of a traceback)."""

    def list_commands(self, ctx: Any) -> list[str]:  # noqa: ANN401 - typer's click context
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))

    def format_commands(self, ctx: Any, formatter: Any) -> None:  # noqa: ANN401 - click's
        """Each command with its first paragraph whole, wrapped (click cuts it to one line)."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, " ".join((command.help or "").strip().split("\n\n")[0].split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None,  # noqa: ANN401
                     **extra: Any) -> Any:  # noqa: ANN401 - typer's click context
        return guarded(lambda: super(MedleyGroup, self).make_context(info_name, args, parent, **extra))

    def invoke(self, ctx: Any) -> Any:  # noqa: ANN401 - typer's click context and any result
        return guarded(lambda: super(MedleyGroup, self).invoke(ctx))


app = typer.Typer(cls=MedleyGroup, no_args_is_help=True, add_completion=False, help=HELP,
                  pretty_exceptions_show_locals=False, rich_markup_mode=None)


@app.callback()
def options(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks and the ranks' stack dumps "
                                                        "(same as MEDLEY_DEBUG=1)")] = False,
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"  # launched ranks inherit it


spec_cmds.register(app)
plan_cmd.register(app)
simulate_cmd.register(app)
check_cmd.register(app)
train_cmd.register(app)
hf_cmd.register(app)
launch_cmd.register(app)
doctor_cmd.register(app)
profile_cmd.register(app)
demo.register(app)


@app.command()
def version() -> None:
    """Print medley's version."""
    from medley import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
