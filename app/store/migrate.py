"""Running the schema migrations: Alembic's `migrations/` folder, shipped inside the package as
`oncegate.migrations`, so `oncegate migrate` works from anywhere."""

from __future__ import annotations

import functools
from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

# Found through the import system: the installed package's folder, or the checkout's migrations/.
LOCATION = resources.files(f"{__package__.split('.')[0]}.migrations")


def _config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(LOCATION))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision`. Idempotent. Runs its own event loop: call it before
    the server's loop starts, or from a thread. A PostgreSQL that cannot be reached raises
    `errors.StoreUnavailable`, as the store does."""
    from .postgres import connections

    config = _config(url)
    config.attributes["connect"] = connections.connect  # unreachable: StoreUnavailable
    command.upgrade(config, revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(_config(url), revision)


@functools.cache
def head() -> str:
    """The newest revision this package ships (read from the scripts once: readiness probes
    ask for it every few seconds)."""
    head = ScriptDirectory.from_config(_config("postgresql://unused")).get_current_head()
    assert head is not None
    return head
