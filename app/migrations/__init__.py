"""Schema migrations, shipped inside the package so `oncegate migrate` works from anywhere."""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

LOCATION = Path(__file__).parent


def _config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(LOCATION))
    config.attributes["url"] = sqlalchemy_url(url)
    return config


def sqlalchemy_url(url: str) -> str:
    """`postgresql://...` as SQLAlchemy's asyncpg dialect wants it."""
    scheme, rest = url.split("://", 1)
    if scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a postgresql:// URL: {scheme}://")
    return "postgresql+asyncpg://" + rest


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision`. Idempotent. Runs its own event loop: call it before
    the server's loop starts, or from a thread."""
    command.upgrade(_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(_config(url), revision)


@functools.cache
def head() -> str:
    """The newest revision this package ships (read from the scripts once: readiness probes
    ask for it every few seconds)."""
    head = ScriptDirectory.from_config(_config("postgresql://unused")).get_current_head()
    assert head is not None
    return head
