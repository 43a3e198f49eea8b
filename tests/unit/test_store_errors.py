"""Which errors of a batched statement may be one row's doing (`errors.isolable`: each operation
of the batch is then sent again alone) and which are the whole server's (the batch fails alike)."""

from __future__ import annotations

import asyncpg
import pytest

from oncegate.store import errors


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.UniqueViolationError,
        asyncpg.exceptions.CheckViolationError,
        asyncpg.exceptions.DeadlockDetectedError,
    ],
)
def test_a_rows_error_is_sent_again_operation_by_operation(error: type[Exception]) -> None:
    assert errors.isolable(error("refused"))


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.ConnectionDoesNotExistError,  # class 08
        asyncpg.exceptions.TooManyConnectionsError,  # class 53
        asyncpg.exceptions.AdminShutdownError,  # class 57
        # A standby, or a primary a failover demoted: every write is refused, whatever its rows
        # (Citus's worker path counted it a row's and resent a batch one operation at a time).
        asyncpg.exceptions.ReadOnlySQLTransactionError,
    ],
)
def test_a_whole_servers_refusal_is_not_sent_again_alone(error: type[Exception]) -> None:
    assert not errors.isolable(error("refused"))
