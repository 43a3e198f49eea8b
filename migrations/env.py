"""Alembic environment: async, on asyncpg.

The database URL (a plain `postgresql://` URL) arrives as `config.attributes["url"]` from
`oncegate migrate`; under Alembic's own command line (`alembic upgrade head` beside
`alembic.ini`) it is the ini file's `sqlalchemy.url`, else `ONCEGATE_DATABASE_URL`. The SQL of
each revision is hand-written, so there is no metadata to autogenerate from.

SQLAlchemy is handed connections asyncpg makes from the URL as given (`async_creator`), not the
URL itself: SQLAlchemy's parser refuses libpq's multi-host URLs (`db1:5432,db2:5432`,
`?target_session_attrs=read-write`), which asyncpg reads as the gateway does, so `migrate` reaches
the primary whichever host it is, exactly as `serve` will.
"""

from __future__ import annotations

import asyncio
import os

import asyncpg
from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine


def _url() -> str:
    url = (
        context.config.attributes.get("url")
        or context.config.get_main_option("sqlalchemy.url")
        or os.environ.get("ONCEGATE_DATABASE_URL")
    )
    if not url:
        raise SystemExit("no database to migrate: set ONCEGATE_DATABASE_URL (a postgresql:// URL)")
    scheme, separator, rest = url.partition("://")
    if not separator or scheme not in ("postgresql", "postgres", "postgresql+asyncpg"):
        raise SystemExit(f"not a postgresql:// URL: {scheme}://")
    return "postgresql://" + rest  # as asyncpg reads it


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    # Opened before SQLAlchemy sees it, by the store's `connect` under `oncegate migrate`
    # (`oncegate.store.migrate`): a PostgreSQL that cannot be reached is one sentence
    # (`StoreUnavailable`, exit 3), not a traceback from inside SQLAlchemy's pool. The engine
    # connects once and is handed this connection.
    connect = context.config.attributes.get("connect", asyncpg.connect)
    opened = [await connect(url)]

    async def handed() -> asyncpg.Connection:
        return opened.pop()

    engine = create_async_engine(
        "postgresql+asyncpg://",  # SQLAlchemy's dialect for asyncpg; the URL went to asyncpg
        async_creator=handed,
        poolclass=pool.NullPool,
    )
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    # SQL printed, not run: only the dialect matters (SQLAlchemy could not parse a host list).
    context.configure(dialect_name="postgresql", literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async(_url()))
