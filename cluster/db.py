"""Engines, sessions and schema migration for the job store (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
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


# SQLSTATE classes of a lost server: 08 connection exception; 57P01-57P03 admin or crash shutdown, cannot
# connect now (a server stopping or starting). Other errors (a constraint, a lock timeout, a bad statement) are not.
CONNECTION_SQLSTATES = ("08", "57P")
SQLITE_UNREACHABLE = ("unable to open database file", "disk i/o error")


def is_connection_error(err: BaseException) -> bool:
    """Whether `err` says the database could not be reached (worth waiting out and reconnecting), not that a
    statement failed: a connection SQLAlchemy invalidated, a driver error with a connection SQLSTATE or with
    none (the client could not talk to the server: refused, reset, timed out), SQLite's file unreachable.
    SQLite's "database is locked" is not one: it is a busy writer, not an outage."""
    if not isinstance(err, DBAPIError):
        return False
    if err.connection_invalidated:
        return True
    if not isinstance(err, OperationalError | InterfaceError):
        return False
    if isinstance(err.orig, sqlite3.Error):
        return any(message in str(err.orig).lower() for message in SQLITE_UNREACHABLE)
    state = getattr(err.orig, "sqlstate", None) or getattr(err.orig, "pgcode", None)
    return not state or str(state).startswith(CONNECTION_SQLSTATES)


class DatabaseOutages:
    """This process's count of database round trips that failed for want of a connection and were retried,
    and of reconnections after them (cluster.scheduler.Scheduler.run); /metrics exports both as
    elastify_database_errors_total and elastify_database_reconnects_total."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors = self.reconnects = 0

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def reconnected(self) -> None:
        with self._lock:
            self.reconnects += 1


DATABASE_OUTAGES = DatabaseOutages()


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
