"""Driver errors end here: `translated` turns them into `errors.StoreUnavailable`, but for a
value the database or the driver refused (`refused_value`), which is `errors.StoreRefusedValue`:
bad input is a 400, never an outage, and it neither logs one nor marks the store down.

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

from ..model import errors
from ..telemetry import metrics

log = logging.getLogger("oncegate.store")


class NodeUnavailable(Exception):
    """One node of several could not take a statement (a Citus worker the store writes to
    directly: down, unreachable, shutting down), which that node's own `Outage` has said. The
    store as a whole is not down (the other workers' keys are served), so `translated` tells
    the store's `Outage` nothing of it; the caller gets `StoreUnavailable` as for any outage."""

    def __init__(self, node: str, cause: BaseException) -> None:
        super().__init__(f"{node}: {reason(cause)}")


# What a lost or refused database looks like from asyncpg. InternalClientError is not an
# InterfaceError: a connection whose protocol was left mid-operation by a PostgreSQL shutdown
# raises it (seen under load in tests/faults/test_store_outage.py).
DRIVER_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    NodeUnavailable,
)

# Citus's words when the coordinator could not reach a worker for a statement sent through it
# (SQLSTATE 08006, the coordinator's own report over a connection that is fine): that worker is
# down, not the coordinator. tests/faults/test_citus_workers.py fails if the words change.
REMOTE_NODE = "connection to the remote node "


def worker_unreached(exc: BaseException) -> bool:
    """The Citus coordinator answered that a worker it needed could not be reached: the store's
    server (the coordinator) is up, so its `Outage` is not told (a purge or a key count, which
    read every shard, would otherwise say the coordinator is down, and the next statement that
    it is back, each time)."""
    return isinstance(exc, asyncpg.PostgresError) and str(exc).startswith(REMOTE_NODE)


# Errors about the connection or the server as a whole: every statement would fail the same way.
_WHOLE_SERVER = (
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.exceptions.InsufficientResourcesError,  # class 53
    asyncpg.exceptions.OperatorInterventionError,  # class 57: shutting down, cancelled
    # 25006: a server that takes no writes (a standby, a primary demoted by a failover, or set
    # read-only); no row of a batch is the cause.
    asyncpg.exceptions.ReadOnlySQLTransactionError,
)


def refused_value(exc: BaseException) -> bool:
    """A value refused, not a database gone: PostgreSQL's data exceptions (SQLSTATE class 22:
    out of range, invalid format) and the driver's own refusal to encode an argument (asyncpg's
    client-side DataError, an InterfaceError that is a ValueError: a datetime it cannot turn
    into UTC)."""
    return isinstance(exc, asyncpg.DataError) or (
        isinstance(exc, asyncpg.InterfaceError) and isinstance(exc, ValueError)
    )


# A statement the server refuses as written, every time: a feature it lacks (Citus's planner
# refusals are 0A000), or an error in the SQL itself.
_REFUSED_STATEMENT = (
    asyncpg.exceptions.FeatureNotSupportedError,
    asyncpg.exceptions.SyntaxOrAccessError,
)


def isolable(exc: Exception) -> bool:
    """Whether a batched statement's error may be one row's doing (a constraint, a deadlock, a
    value PostgreSQL refused): then each operation is sent again alone. Not for a connection that
    broke or a server that is going away: those fail every statement alike."""
    return isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, _WHOLE_SERVER)


Parameters = ParamSpec("Parameters")
Result = TypeVar("Result")


class Outage:
    """Whether PostgreSQL is down for one store, so that the log says once that it is down (where,
    and why in words) and once that it is back, not a line per request while it is down.

    A store that names its database has one as its `outage` attribute; `translated` reports each
    operation's failure or success to it."""

    def __init__(
        self,
        where: str,
        primary: object = None,
        consequence: str = "answering 503 store-unavailable and forwarding nothing until it is"
        " back",
    ) -> None:
        self.where = where
        self.consequence = consequence
        # Which host is the primary (its str), for a URL with several: named in both lines.
        self.primary = primary
        self.down = False

    def _primary(self, when: str) -> str:
        return "" if self.primary is None else f"; {when} {self.primary}"

    def failed(self, operation: str, exc: BaseException) -> None:
        if self.down:
            log.debug("store %s failed: %s", operation, reason(exc))
            return
        self.down = True
        log.error(
            "PostgreSQL at %s is unavailable (%s%s): %s",
            self.where,
            reason(exc),
            self._primary("the primary was"),
            self.consequence,
        )

    def recovered(self) -> None:
        self.down = False
        log.warning("PostgreSQL at %s is back%s", self.where, self._primary("the primary is"))


def translated(
    operation: str,
    failure: str = "",
    *,
    on_the_pools: bool = True,
    routed: Callable[..., str] | None = None,
) -> Callable[
    [Callable[Parameters, Coroutine[Any, Any, Result]]],
    Callable[Parameters, Coroutine[Any, Any, Result]],
]:
    """Measure the operation and turn a driver error into `StoreUnavailable` (whose detail is
    `failure` and the error, when given: the caller's words for what could not be done).

    An operation that is not `on_the_pools` (the listening connection's) says nothing to the
    store's `Outage`: that connection has a host and a life of its own, so its success must not
    say the store is back, nor name its host as the primary; its caller says its failure.

    A `routed` operation (the request path's claim and complete, which a Citus store sends to the
    worker of their key, not through the coordinator) tells the store's `Outage` only when its
    statement went to the store's own server: `routed` reads the key from the call's arguments,
    and the room's `on_server(key)` says where it went (asked only on a failure, or while the
    store is down). A worker's statement tells that worker's `Outage`, never the store's, or a
    claim on a worker would say the coordinator is back while it is down."""

    def decorate(
        method: Callable[Parameters, Coroutine[Any, Any, Result]],
    ) -> Callable[Parameters, Coroutine[Any, Any, Result]]:
        timer = metrics.STORE_OPERATION_DURATION.labels(operation)

        def told(outage: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outage | None:
            """The store's `Outage`, where this call's statement went to the store's server."""
            if not isinstance(outage, Outage):
                return None
            if routed is not None and not args[0].on_server(routed(*args, **kwargs)):
                return None  # a Citus worker's: said by that worker's own Outage
            return outage

        @functools.wraps(method)
        async def run(*args: Parameters.args, **kwargs: Parameters.kwargs) -> Result:
            outage = getattr(args[0], "outage", None) if args and on_the_pools else None
            started = time.perf_counter()
            try:
                result = await method(*args, **kwargs)
            except DRIVER_ERRORS as exc:
                if refused_value(exc):
                    log.warning("store %s refused a value: %s", operation, reason(exc))
                    raise errors.StoreRefusedValue(
                        f"the store cannot hold a value of this request: {exc}"
                    ) from exc
                if isinstance(exc, _REFUSED_STATEMENT):
                    # Not an outage but a statement this server will not run (Citus refuses some
                    # plans, and logs them without the statement): say which one.
                    log.error("PostgreSQL refused the store's %s statement: %s", operation,
                              reason(exc))  # fmt: skip
                if isinstance(exc, NodeUnavailable):  # said by that node's own Outage
                    log.debug("store %s failed: %s", operation, reason(exc))
                elif worker_unreached(exc):
                    log.warning("store %s failed: the Citus coordinator could not reach a worker"
                                " (%s)", operation, reason(exc))  # fmt: skip
                elif (store := told(outage, args, kwargs)) is not None:
                    store.failed(operation, exc)
                elif on_the_pools:
                    log.warning("store %s failed: %s", operation, reason(exc))
                else:
                    log.debug("store %s failed: %s", operation, reason(exc))
                raise unavailable(exc, failure) from exc
            finally:
                timer.observe(time.perf_counter() - started)
            if isinstance(outage, Outage) and outage.down and told(outage, args, kwargs):
                outage.recovered()
            return result

        run.store_operation = operation  # type: ignore[attr-defined]  # the marker tests look for
        return run

    return decorate


def unavailable(exc: BaseException, failure: str) -> errors.StoreUnavailable:
    if failure:
        return errors.StoreUnavailable(f"{failure}: {reason(exc)}")
    return errors.StoreUnavailable(
        "the idempotency store (PostgreSQL) is unavailable; the request was not forwarded. "
        "Retry with the same idempotency key."
    )


def reason(exc: BaseException) -> str:
    """What went wrong, in words: not `FileNotFoundError: [Errno 2]` for a socket that is gone."""
    if isinstance(exc, FileNotFoundError | ConnectionRefusedError):
        return "no server is listening there"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"
