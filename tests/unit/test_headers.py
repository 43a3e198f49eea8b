"""Names and values matched whole: a pattern's `$` also matches before a final newline, so
every check of a whole name or value must refuse one that ends in a newline."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from oncegate.http.admin import Resolution
from oncegate.kernel import headers
from oncegate.kernel.sealing import Keyring
from oncegate.model import errors


def test_an_answer_header_whose_name_ends_in_a_newline_is_dropped_not_sent() -> None:
    sent, dropped = headers.relayable([("x-a\n", "1"), ("x-b", "2")], skip=headers.REQUEST_ID)
    assert dropped == ["x-a\n"]
    assert (b"x-b", b"2") in sent
    assert all(not name.endswith(b"\n") for name, _ in sent)


def test_a_request_id_that_ends_in_a_newline_is_replaced() -> None:
    given = [(headers.REQUEST_ID, "abc\n")]
    assert headers.request_id(given) != "abc\n"


@pytest.mark.parametrize("stored", [[("x-a\n", "1")], [("x-a", "1\n")]], ids=["name", "value"])
def test_an_operator_cannot_store_a_header_that_ends_in_a_newline(
    stored: list[tuple[str, str]],
) -> None:
    with pytest.raises(ValidationError, match="header"):
        Resolution(action="complete", status=200, headers=stored)


def test_an_encryption_key_name_that_ends_in_a_newline_is_refused() -> None:
    key = base64.b64encode(bytes(32)).decode()
    assert Keyring.parse(f"bench:{key}").current == "bench"
    with pytest.raises(errors.ConfigError, match="the name 1-32 letters"):
        Keyring.parse(f"bench\n:{key}")
