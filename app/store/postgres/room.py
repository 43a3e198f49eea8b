"""What the store's rooms on the operator's pool share (`Upkeep`, `OperatorQueries`,
`Rekeying`): the pool, the options, the outage their failures are reported to (`errors.translated`
reads it), the dialect and its statements. They run on the operator's pool, never on a
connection a request waits for, one autocommitted statement at a time.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from ...settings import StoreOptions
from ..errors import Outage
from .dialect import Dialect
from .rows import fetchrow


class OperatorRoom:
    def __init__(
        self, pool: asyncpg.Pool, options: StoreOptions, outage: Outage, dialect: Dialect
    ) -> None:
        self._pool = pool
        self._options = options
        self.outage = outage
        self._dialect = dialect
        self._statements = dialect.statements

    async def _fetchrow(self, name: str, **parameters: object) -> Any:
        """Named statement `name`, autocommitted: its first row (or None)."""
        return await fetchrow(self._pool, self._statements, name, **parameters)
