"""The `elastify` command line: one Typer app, with each command group in api/commands/."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from api.commands import client, cluster, local, server

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Elastify: build elastic LLM packages.")
app.add_typer(local.assets_app, name="assets")
app.command("elastify")(local.elastify_command)
cluster.mount(app)
server.mount(app)
client.mount(app)


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"elastify {version('elastify')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("elastify (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="print the version and exit")] = False,
) -> None:
    """Elastify: build elastic LLM packages."""


def main() -> None:
    app()


if __name__ == "__main__":  # python -m api.cli, same as the `elastify` script
    main()
