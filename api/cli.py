"""The `elastify` command line: one Typer app, with each command group in api/commands/."""

from __future__ import annotations

import typer

from api.commands import client, cluster, local, server

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Elastify: build elastic LLM packages.")
app.add_typer(local.assets_app, name="assets")
app.command("elastify")(local.elastify_command)
cluster.mount(app)
server.mount(app)
client.mount(app)


def main() -> None:
    app()


if __name__ == "__main__":  # python -m api.cli, same as the `elastify` script
    main()
