"""What an operator is shown of the request behind a key: every credential masked, however a
vendor names it, in the headers and in the query; the key that names the request shown."""

from __future__ import annotations

import pytest

from oncegate.service.evidence import masked, masked_query


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("authorization", "Bearer sk_live_81", "Bearer ***"),
        ("Proxy-Authorization", "Basic dTpw", "Basic ***"),
        ("cookie", "session=abc", "***"),
        ("x-api-key", "k_81", "***"),
        ("X-Shopify-Access-Token", "shpat_81", "***"),
        ("X-Goog-Api-Key", "AIza81", "***"),
        ("Ocp-Apim-Subscription-Key", "81", "***"),
        ("PRIVATE-TOKEN", "glpat-81", "***"),
        ("X-Id-Token", "eyJ.81", "***"),
        ("X-Client-Secret", "81", "***"),
        ("X-Hub-Signature-256", "sha256=81", "***"),
        ("Idempotency-Key", "k-81", "k-81"),
        ("X-Idempotency-Key", "k-81", "k-81"),
        ("PayPal-Request-Id", "k-81", "k-81"),
        ("content-type", "application/json", "application/json"),
        ("x-slow-first", "1", "1"),
    ],
)
def test_a_header_is_shown_masked_when_it_names_a_credential(
    name: str, value: str, shown: str
) -> None:
    assert masked([(name, value)]) == [(name, shown)]


def test_a_query_is_shown_with_its_credential_parameters_masked_and_the_rest_as_sent() -> None:
    assert masked_query("") == ""
    assert masked_query("currency=eur&limit=2") == "currency=eur&limit=2"
    assert (
        masked_query("currency=eur&access_token=ya29.81&api%5Fkey=81&flag&Session=9")
        == "currency=eur&access_token=***&api%5Fkey=***&flag&Session=***"
    )
