"""The pure decision (contract sections 4 and 5): what to do with a request whose key someone
claimed before, from the row the store returned. No I/O and no clock: the row's `state` (the
SQL function `oncegate_key_state`) already says whether its lease or TTL ran out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from ..kernel import headers, sealing
from ..kernel.fingerprint import Fingerprint
from ..kernel.sealing import Sealer
from ..model import errors
from ..model.outcomes import Outcome
from ..model.records import Record
from ..settings import Route
from .messages import Answer

# What a client waiting on an in-flight key should wait before asking again. Short, because most
# upstream calls take well under a second; clients back off further themselves.
IN_PROGRESS_RETRY_AFTER = 1


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response."""

    answer: Answer


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer with this problem; nothing is forwarded."""

    error: errors.GatewayError


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another request holds the key now: wait for it to settle when the request asked to
    (`Prefer: wait`) and look again, else answer with `error` (409 request-in-progress)."""

    error: errors.RequestInProgress


@dataclass(frozen=True, slots=True)
class Reclaim:
    """The key expired: claim its row as a new key, then forward."""


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The outcome is unknown and the route says `on_unknown: forward`: take the row over with
    a new fencing token, then forward again."""


# Closed: `Gateway` applies a decision with `match` and `assert_never`, so a new variant is a
# type error until every place that applies one says what it does.
Decision = Replay | Refuse | InFlight | Reclaim | TakeOver


def decide(
    record: Record,
    fingerprint: Fingerprint,
    route: Route,
    sealer: Sealer,
    scope: bytes,
) -> Decision:
    """What to do with a request whose key someone claimed before (contract sections 4 and 5).
    Pure: `Gateway.handle` applies the decision through the store. A sealed answer is opened
    by `sealer`, bound to the row's id and `scope`."""
    match record.state:
        case "expired":
            return Reclaim()  # a new key, whatever was sent under it before
        case _ if not fingerprint.matches(record.fingerprint):
            return Refuse(
                errors.KeyReused(
                    "this idempotency key was first used with a different request (method, "
                    "path, query or body); use a new key for a new request"
                )
            )
        case "completed":
            return _replay(record, sealer, scope)
        case "in_progress":
            return InFlight(
                errors.RequestInProgress(
                    "a request with this idempotency key is still being processed; retry later",
                    headers={"Retry-After": str(IN_PROGRESS_RETRY_AFTER)},
                )
            )
        case "unknown" if route.forwards_unknown:
            return TakeOver()
        case "unknown":
            return Refuse(
                errors.OutcomeUnknown(
                    "the request with this idempotency key may have been performed, but its "
                    "answer was lost; an operator must resolve the key before it can be answered"
                )
            )
        case _:
            assert_never(record.state)


def _replay(record: Record, sealer: Sealer, scope: bytes) -> Replay | Refuse:
    stored = record.answer
    assert stored is not None  # a completed key has its answer
    if stored.content is None or not stored.stored:  # its status and headers only
        return Refuse(
            errors.ResponseNotStored(
                f"the request with this idempotency key completed with status {stored.status}, "
                "but its response was larger than max_stored_response and cannot be replayed; "
                "it was not performed again"
            )
        )
    try:
        answer_headers, body = sealer.open((record.id, record.token), scope, stored.content)
    except sealing.Unopenable as exc:
        return Refuse(
            errors.AnswerSealed(
                f"the request with this idempotency key was performed (status "
                f"{stored.status}), but its stored answer cannot be opened; it is replayed "
                "once the gateway has its key. It will not be performed again",
                key_name=exc.key_name,
                reason=str(exc),
            )
        )
    assert body is not None  # stored whole
    return Replay(
        Answer(
            status=stored.status,
            headers=[*answer_headers, headers.REPLAYED],
            body=body,
            outcome=Outcome.REPLAYED,
            blocked="replayed",
        )
    )
