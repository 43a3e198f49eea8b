"""What an operator is shown of the request behind a key: every credential masked, however a
vendor names it, in the headers, the query and the page's readable body; the key that names the
request shown."""

from __future__ import annotations

import pytest

from oncegate.service.evidence import KeptRequest, masked, masked_query


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
        ("CB-ACCESS-PASSPHRASE", "81", "***"),
        ("OK-ACCESS-PASSPHRASE", "81", "***"),
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


@pytest.mark.parametrize(
    ("query", "shown"),
    [
        # Azure Storage's shared access signature: the signature grants the access.
        ("sv=2022-11-02&sr=b&sp=w&sig=Zm9vYmFy", "sv=2022-11-02&sr=b&sp=w&sig=***"),
        ("user=ann&pwd=hunter2", "user=ann&pwd=***"),
        ("user=ann&pass=hunter2&user_pass=h2", "user=ann&pass=***&user_pass=***"),
        ("jwt=eyJhbGciOiJIUzI1NiJ9.e30.c2ln&otp=123456", "jwt=***&otp=***"),
        (
            "passphrase=a&passcode=b&userPass=c&loginPwd=d&otpCode=e",
            "passphrase=***&passcode=***&userPass=***&loginPwd=***&otpCode=***",
        ),
        # The short names as parts of other words are not credentials.
        ("compass=n&passenger=ann&bypass=1", "compass=n&passenger=ann&bypass=1"),
    ],
)
def test_a_credential_s_short_name_in_the_query_is_masked_and_words_that_hold_it_are_not(
    query: str, shown: str
) -> None:
    assert masked_query(query) == shown


def _kept(content_type: str, body: bytes) -> KeptRequest:
    return KeptRequest("POST", "/oauth/token", "", [("content-type", content_type)], body)


def test_the_readable_form_body_masks_the_fields_the_query_would() -> None:
    # An OAuth token request (RFC 6749, section 2.3.1: the client's secret in the form body).
    kept = _kept(
        "application/x-www-form-urlencoded",
        b"grant_type=client_credentials&client_id=app&client_secret=s3cr3t-81&password=pw81",
    )
    assert kept.readable_body().splitlines() == [
        "grant_type = client_credentials",
        "client_id = app",
        "client_secret = ***",
        "password = ***",
    ]


def test_the_readable_json_body_masks_credential_members_at_any_depth() -> None:
    kept = _kept(
        "application/json; charset=utf-8",
        b'{"to": "ann", "auth": {"user": "u", "pass": "p81"}, '
        b'"hooks": [{"url": "https://x", "secret": "s81"}], "api_key": 81}',
    )
    shown = kept.readable_body()
    assert "p81" not in shown and "s81" not in shown and "81" not in shown.replace('"***"', "")
    assert '"to": "ann"' in shown and '"url": "https://x"' in shown
    assert '"auth": "***"' in shown and '"secret": "***"' in shown and '"api_key": "***"' in shown


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("text/plain", b'{"to": "ann", "password": "hunter2-81"}'),
        ("", b'{"to": "ann", "password": "hunter2-81"}'),
        ("application/json", b'\xef\xbb\xbf{"to": "ann", "password": "hunter2-81"}'),
    ],
    ids=["text-plain", "no-type", "byte-order-mark"],
)
def test_a_json_body_is_masked_whatever_its_declared_type(content_type: str, body: bytes) -> None:
    shown = _kept(content_type, body).readable_body()
    assert "hunter2-81" not in shown
    assert '"password": "***"' in shown and '"to": "ann"' in shown


@pytest.mark.parametrize("line", ["\r\n", "\n"], ids=["crlf", "bare-lf"])
def test_a_multipart_body_shows_its_parts_with_credential_parts_masked(line: str) -> None:
    body = line.join(
        [
            "--xx",
            'Content-Disposition: form-data; name="username"',
            "",
            "ann",
            "--xx",
            "Content-Disposition: form-data; name=password",
            "",
            "hunter2-81",
            "--xx",
            'Content-Disposition: form-data; name="file"; filename="api_key.txt"',
            "Content-Type: text/plain",
            "",
            "the file's own text",
            "--xx--",
            "",
        ]
    ).encode()
    shown = _kept("multipart/form-data; boundary=xx", body).readable_body()
    assert "hunter2-81" not in shown
    assert f"name=password{line}{line}***{line}--xx" in shown
    assert f"ann{line}--xx" in shown  # a part whose name is no credential, as sent
    assert "the file's own text" in shown  # the part is `file`: its filename is no field name
