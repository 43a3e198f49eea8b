"""oncegate.http.problems: the one renderer of the gateway's own answers, and the retry advice
every problem of the proxy carries for client libraries (docs/reference.md, "What client
libraries make of the gateway's answers")."""

from __future__ import annotations

import json

import pytest

from oncegate.http import problems
from oncegate.model import errors

RETRY = {
    errors.RequestInProgress: True,
    errors.UpstreamUnavailable: True,
    errors.StoreUnavailable: True,
    errors.OutcomeUnknown: False,
    errors.ResponseNotStored: False,
    errors.AnswerSealed: False,
    errors.UnsupportedTransferCoding: False,
    errors.KeyReused: False,
    errors.MissingKey: False,
    errors.InvalidKey: False,
    errors.BodyTooLarge: False,
    errors.InvalidPath: False,
    errors.InvalidHeader: False,
    errors.RouteNotFound: False,
}


def made(kind: type[errors.GatewayError]) -> errors.GatewayError:
    if kind is errors.AnswerSealed:
        return errors.AnswerSealed("sealed", key_name="k1", reason="gone")
    return kind("detail")


def rendered(error: errors.GatewayError) -> dict[bytes, bytes]:
    _, headers, _ = problems.parts(error)
    return dict(headers)


@pytest.mark.parametrize(("kind", "advice"), RETRY.items(), ids=lambda v: getattr(v, "name", v))
def test_each_proxy_problem_says_whether_a_retry_can_help_in_both_headers(
    kind: type[errors.GatewayError], advice: bool
) -> None:
    sent = rendered(made(kind))
    expected = b"true" if advice else b"false"
    assert sent[b"x-should-retry"] == sent[b"stripe-should-retry"] == expected


def test_a_5xx_or_409_that_no_retry_can_change_says_false() -> None:
    """Libraries retry every 409 and 5xx by default: those are the answers that need it."""
    for kind, advice in RETRY.items():
        if kind.status == 409 or kind.status >= 500:
            assert advice is (kind in (errors.RequestInProgress, errors.UpstreamUnavailable,
                                       errors.StoreUnavailable)), kind  # fmt: skip


def test_an_instance_may_know_better_than_its_class() -> None:
    forwarded_again = errors.OutcomeUnknown("lost", status=504, retry=True)
    assert rendered(forwarded_again)[b"x-should-retry"] == b"true"


@pytest.mark.parametrize(
    "error",
    [errors.GatewayError("a bug"), errors.RequestTimeout("slow"), errors.Unauthorized("no")],
)
def test_problems_with_no_advice_leave_the_library_to_its_defaults(
    error: errors.GatewayError,
) -> None:
    sent = rendered(error)
    assert b"x-should-retry" not in sent and b"stripe-should-retry" not in sent


def test_the_body_stays_an_rfc_9457_problem() -> None:
    status, headers, body = problems.parts(errors.KeyReused("used before"))
    assert status == 422 and dict(headers)[b"content-type"] == b"application/problem+json"
    assert json.loads(body) == {
        "type": "urn:oncegate:problem:key-reused",
        "title": errors.KeyReused.title,
        "status": 422,
        "detail": "used before",
        "message": "used before",  # the detail again, where vendors' libraries look for it
    }
