"""Server-side commands: `serve` (the REST API alone, N worker processes) and the ones that write the job
store directly, `tokens create` and `tenants set-quota|show`."""

from __future__ import annotations

import typer
from rich.table import Table

from api.progress import console, fail

tokens_app = typer.Typer(no_args_is_help=True, help="API tokens (printed once, stored only as a hash).")
tenants_app = typer.Typer(no_args_is_help=True, help="Tenants and their quotas.")


def _sessions():
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.db import make_engine, migrate, session_factory
    from cluster.settings import Settings

    url = Settings.from_env().database_url
    migrate(url)
    return session_factory(make_engine(url))


def _check_tenant(tenant: str) -> None:
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    import re

    from cluster.spec import NAME_PATTERN

    if not re.match(NAME_PATTERN, tenant) or len(tenant) > 64:
        fail(f"tenant {tenant!r} must match {NAME_PATTERN} (at most 64 characters)")


@tokens_app.command("create")
def tokens_create(
    tenant: str = typer.Option(..., help="the tenant the token acts for (created if new)"),
    admin: bool = typer.Option(False, "--admin", help="the token sees every tenant"),
    name: str = typer.Option("", help="a label to recognise the token by"),
) -> None:
    """Issue a bearer token; it is printed once on stdout and only its sha256 is kept."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from api.auth import create_token

    _check_tenant(tenant)
    token = create_token(_sessions(), tenant, admin=admin, name=name)
    console.print(f"token for tenant {tenant}{' (admin)' if admin else ''}; store it now, it is not shown again")
    print(token)  # stdout, for scripts


@tokens_app.command("list")
def tokens_list(tenant: str | None = typer.Option(None, help="only this tenant's tokens")) -> None:
    """Every token's id, tenant, label, role and dates (never the token: only its hash is kept)."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from sqlalchemy import select

    from cluster.models import ApiToken

    table = Table(title="API tokens")
    for column in ("id", "tenant", "name", "admin", "created", "revoked"):
        table.add_column(column, justify="right")
    query = select(ApiToken).order_by(ApiToken.id)
    if tenant is not None:
        query = query.where(ApiToken.tenant_id == tenant)
    with _sessions()() as session:
        for row in session.scalars(query):
            table.add_row(str(row.id), row.tenant_id, row.name, "yes" if row.is_admin else "",
                          f"{row.created_at:%Y-%m-%d %H:%M}", f"{row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "")
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: int = typer.Argument(..., help="the id `tokens list` shows")) -> None:
    """Revoke a token: from now on it gets 401."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.models import ApiToken, utcnow

    with _sessions().begin() as session:
        row = session.get(ApiToken, token_id)
        if row is None:
            fail(f"no token with id {token_id}")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
    console.print(f"token {token_id} of tenant {row.tenant_id} revoked")


@tenants_app.command("set-quota")
def tenants_set_quota(
    tenant: str = typer.Argument(...),
    gpu_hours_per_month: float | None = typer.Option(None, min=0, help="GPU-hour budget per UTC month"),
    max_concurrent_builds: int | None = typer.Option(None, min=0, help="builds queued or running at once"),
    clear: bool = typer.Option(False, "--clear", help="remove both limits (then apply any given)"),
) -> None:
    """Set a tenant's quotas; submissions over them get 429 and nothing is queued."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from cluster.service import set_quota

    _check_tenant(tenant)
    if gpu_hours_per_month is None and max_concurrent_builds is None and not clear:
        fail("give --gpu-hours-per-month, --max-concurrent-builds or --clear")
    row = set_quota(_sessions(), tenant, gpu_hours_per_month=gpu_hours_per_month,
                    max_concurrent_builds=max_concurrent_builds, clear=clear)
    console.print(f"{tenant}: {_limit(row.gpu_hours_per_month, 'GPU-hours/month')}, "
                  f"{_limit(row.max_concurrent_builds, 'concurrent builds')}")


@tenants_app.command("show")
def tenants_show() -> None:
    """Every tenant with its quotas and this month's GPU-hours."""
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    from sqlalchemy import select

    from cluster.models import Tenant
    from cluster.service import gpu_seconds_this_month

    table = Table(title="tenants")
    for column in ("tenant", "GPU-h/month", "concurrent builds", "GPU-h this month"):
        table.add_column(column, justify="right")
    with _sessions()() as session:
        for row in session.scalars(select(Tenant).order_by(Tenant.id)):
            table.add_row(row.id, _limit(row.gpu_hours_per_month, ""), _limit(row.max_concurrent_builds, ""),
                          f"{gpu_seconds_this_month(session, row.id) / 3600:.3f}")
    console.print(table)


def _limit(value, unit: str) -> str:
    return "no limit" + (f" on {unit}" if unit else "") if value is None else f"{value:g} {unit}".strip()


def serve(
    host: str = typer.Option("127.0.0.1", help="where the REST API listens"),
    port: int = typer.Option(8000),
    workers: int = typer.Option(1, min=1, help="uvicorn worker processes"),
) -> None:
    """Serve the REST API without a scheduler (e.g. replicas behind a proxy, next to `elastify up`).

    Settings come from the environment (ELASTIFY_DATABASE_URL, ELASTIFY_STORE_URL, …), as for `up`.
    """
    # lazy: the CLI starts without the control plane; a command loads it when it runs
    import uvicorn

    from api.lifecycle import StopRequest
    from api.progress import configure_logging

    configure_logging()
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the handler it found
    # at start, which by default kills the process (status 143); with this one it returns, and `serve` exits 0.
    stop = StopRequest().install()
    _sessions()  # migrate once, before the workers start
    if stop.is_set():  # stopped while migrating
        return
    console.print(f"REST API on http://{host}:{port} with {workers} worker(s); SIGTERM or Ctrl-C stops")
    try:
        uvicorn.run("api.app:app_from_env", factory=True, host=host, port=port, workers=workers, access_log=False,
                    log_level="warning", timeout_graceful_shutdown=10)  # an open log stream never ends by itself
    except KeyboardInterrupt:  # a second Ctrl-C, raised again after the shutdown
        pass


def mount(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(tenants_app, name="tenants")
