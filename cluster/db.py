"""Engines, sessions and schema migration for the job store (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).resolve().parents[1] / "infra" / "migrations"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def _ensure_sqlite_dir(url: str) -> None:
    path = url.split("///", 1)[-1]
    if is_sqlite(url) and path and path != ":memory:":
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(url: str) -> Engine:
    if is_sqlite(url):
        _ensure_sqlite_dir(url)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(connection, _record):  # WAL: readers never block the one writer
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin(connection):  # pysqlite begins lazily (deferred) by itself unless asked for the lock first
            if connection.get_execution_options().get(_WRITE_LOCK):
                connection.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


_WRITE_LOCK = "elastify_begin_immediate"


def lock_for_write(session: Session) -> None:
    """On SQLite, make the session's transaction hold the database's write lock from its start (BEGIN
    IMMEDIATE), so a check it reads stays true until it commits what it decided. SQLite ignores
    SELECT … FOR UPDATE, and pysqlite's own BEGIN is deferred to the first INSERT, after the check.
    Call it before the transaction's first statement (RuntimeError otherwise); calling it again in the
    same transaction does nothing. On PostgreSQL it does nothing: callers lock their rows FOR UPDATE."""
    if session.get_bind().dialect.name != "sqlite":
        return
    transaction = session.get_transaction()
    if transaction is not None and session.info.get(_WRITE_LOCK) is transaction:
        return
    connection = session.connection(execution_options={_WRITE_LOCK: True})  # begins: the "begin" event
    if not connection.get_execution_options().get(_WRITE_LOCK):
        raise RuntimeError("lock_for_write was called after the transaction's first statement")
    session.info[_WRITE_LOCK] = session.get_transaction()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str) -> None:
    """Bring the database to the newest schema (idempotent)."""
    import logging

    from alembic import command

    _ensure_sqlite_dir(url)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its INFO lines are noise on every start
    command.upgrade(alembic_config(url), "head")
