"""Driver errors end here: `translated` turns them into `errors.StoreUnavailable`.

Every method of a store that talks to PostgreSQL wears it (a test checks that each public
method does), so nothing above `store/` ever sees an asyncpg exception, and each operation's
time is measured under its name (`oncegate_store_operation_duration_seconds{operation}`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import asyncpg

from .. import errors, metrics

log = logging.getLogger("oncegate.store")

# What a lost or refused database looks like from asyncpg. InternalClientError is not an
# InterfaceError: a connection whose protocol was left mid-operation by a PostgreSQL shutdown
# raises it (seen under load in tests/faults/test_store_outage.py).
DRIVER_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)

Parameters = ParamSpec("Parameters")
Result = TypeVar("Result")


def translated(
    operation: str, failure: str = ""
) -> Callable[
    [Callable[Parameters, Coroutine[Any, Any, Result]]],
    Callable[Parameters, Coroutine[Any, Any, Result]],
]:
    """Measure the operation and turn a driver error into `StoreUnavailable` (whose detail is
    `failure` and the error, when given: the caller's words for what could not be done)."""

    def decorate(
        method: Callable[Parameters, Coroutine[Any, Any, Result]],
    ) -> Callable[Parameters, Coroutine[Any, Any, Result]]:
        timer = metrics.STORE_OPERATION_DURATION.labels(operation)

        @functools.wraps(method)
        async def run(*args: Parameters.args, **kwargs: Parameters.kwargs) -> Result:
            started = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            except DRIVER_ERRORS as exc:
                raise unavailable(operation, exc, failure) from exc
            finally:
                timer.observe(time.perf_counter() - started)

        run.store_operation = operation  # type: ignore[attr-defined]  # the marker tests look for
        return run

    return decorate


def unavailable(operation: str, exc: BaseException, failure: str) -> errors.StoreUnavailable:
    log.warning("store %s failed: %s: %s", operation, type(exc).__name__, exc)
    if failure:
        return errors.StoreUnavailable(f"{failure}: {type(exc).__name__}: {exc}")
    return errors.StoreUnavailable(
        "the idempotency store (PostgreSQL) is unavailable; the request was not forwarded. "
        "Retry with the same Idempotency-Key."
    )
