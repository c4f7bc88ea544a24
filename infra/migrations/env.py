"""Alembic environment: the URL comes from the config (cluster.db.alembic_config) or ELASTIFY_DATABASE_URL."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine

from cluster.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or os.environ.get("ELASTIFY_DATABASE_URL", "sqlite:///elastify.db")


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection") or create_engine(url)
    if hasattr(connectable, "connect"):
        with connectable.connect() as connection:
            _run(connection)
    else:
        _run(connectable)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
