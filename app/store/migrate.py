"""Running the schema migrations: Alembic's `migrations/` folder, shipped inside the package as
`oncegate.migrations`, so `oncegate migrate` works from anywhere.

Alembic (and SQLAlchemy under it) is imported by the functions that run a migration, never by
`head`: a gateway needs only the newest revision, to compare with the database's at its start
and on every readiness probe, and importing Alembic was a quarter of a start's CPU
(bench/gateway_start.py). `head` reads it from the scripts' own `revision` and `down_revision`
lines instead; a test holds it equal to Alembic's answer.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterable
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING

from ..model import errors

if TYPE_CHECKING:
    from alembic.config import Config

# Found through the import system: the installed package's folder, or the checkout's migrations/.
LOCATION = resources.files(f"{__package__.split('.')[0]}.migrations")

# A script's identity as Alembic's template writes it: `revision = "0012"` and
# `down_revision = "0011"` (None for the first), each on a line of its own.
_REVISION = re.compile(r'^revision\s*(?::\s*str\s*)?=\s*["\']([^"\']+)["\']\s*$', re.MULTILINE)
_DOWN_REVISION = re.compile(
    r'^down_revision\s*(?::[^=]*)?=\s*(?:None|["\']([^"\']+)["\'])\s*$', re.MULTILINE
)


def _config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(LOCATION))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision`. Idempotent. Runs its own event loop: call it before
    the server's loop starts, or from a thread. A PostgreSQL that cannot be reached raises
    `errors.StoreUnavailable`, as the store does; a Citus database the key table cannot be
    distributed on (`citus.undistributable`) `errors.ConfigError`, before any migration runs."""
    from alembic import command

    from .postgres import connections

    refusal = asyncio.run(_refusal(url))
    if refusal is not None:
        raise errors.ConfigError(refusal)
    config = _config(url)
    config.attributes["connect"] = connections.connect  # unreachable: StoreUnavailable
    command.upgrade(config, revision)


async def _refusal(url: str) -> str | None:
    from . import citus
    from .postgres import connections

    connection = await connections.connect(url)
    try:
        return await citus.undistributable(connection)
    finally:
        await connection.close()


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(_config(url), revision)


@functools.cache
def head() -> str:
    """The newest revision this package ships: the one no other script names as its
    `down_revision` (read from the scripts once: readiness probes ask for it every few
    seconds). Migrations are one line of revisions; a script this cannot read, a branch or a
    merge is refused here, loudly, rather than guessed at."""
    return head_of((LOCATION / "versions").iterdir())


def head_of(scripts: Iterable[Traversable]) -> str:
    """The head of the revisions in `scripts` (files other than `*.py` are skipped)."""
    revisions: dict[str, str | None] = {}
    for script in scripts:
        if not script.name.endswith(".py") or script.name.startswith("_"):
            continue
        text = script.read_text(encoding="utf-8")
        revision, down = _REVISION.findall(text), _DOWN_REVISION.search(text)
        if len(revision) != 1 or down is None:
            raise RuntimeError(
                f'migration {script.name}: no single `revision = "..."` and '
                '`down_revision = "..."` (or None) line'
            )
        revisions[revision[0]] = down.group(1)
    named = set(revisions.values())
    heads = sorted(revision for revision in revisions if revision not in named)
    if len(heads) != 1 or len(named - {None}) != len(revisions) - 1:
        raise RuntimeError(
            f"the migrations are not one line of revisions (heads {heads}): "
            "oncegate's are, one after the other"
        )
    return heads[0]
