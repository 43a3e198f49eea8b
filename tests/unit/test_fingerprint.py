"""oncegate.fingerprint: what makes a retry "the same request" (contract section 4)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oncegate import fingerprint

JSON = "application/json"


def digest(
    body: bytes = b"{}",
    *,
    method: str = "POST",
    path: str = "/charges",
    query: bytes | str = "",
    content_type: str | None = JSON,
) -> bytes:
    return fingerprint.compute(method, path, query, content_type, body)


def test_fingerprint_is_a_32_byte_digest() -> None:
    result = digest(b'{"a":1}')
    assert isinstance(result, bytes)
    assert len(result) == 32


def test_fingerprint_is_deterministic() -> None:
    assert digest(b'{"a":1}', query="x=1") == digest(b'{"a":1}', query="x=1")


# -- JSON canonicalisation --------------------------------------------------------------------


def test_key_order_and_white_space_do_not_matter() -> None:
    assert digest(b'{"a":1,"b":2}') == digest(b'{ "b": 2, "a": 1 }')


def test_nested_objects_are_canonicalised() -> None:
    compact = b'{"outer":{"x":[1,{"q":true,"p":null}],"y":"s"},"z":[]}'
    spaced = b'{\n  "z": [ ],\n  "outer": { "y": "s", "x": [ 1, { "p": null, "q": true } ] }\n}'
    assert digest(compact) == digest(spaced)


def test_array_order_matters() -> None:
    assert digest(b"[1,2]") != digest(b"[2,1]")


def test_json_values_matter() -> None:
    assert digest(b'{"amount":100}') != digest(b'{"amount":1000}')
    assert digest(b'{"amount":100}') != digest(b'{"amount":"100"}')


def test_string_escaping_does_not_matter() -> None:
    assert digest('{"name":"café"}'.encode()) == digest(b'{"name":"caf\\u00e9"}')


def test_canonical_json_is_sorted_and_compact() -> None:
    assert fingerprint.canonical_json(b'{ "b": [1, 2], "a": {"d": 1, "c": 2} }') == (
        b'{"a":{"c":2,"d":1},"b":[1,2]}'
    )


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/json ;charset=UTF-8",
        "application/problem+json",
        "application/vnd.api+json; charset=utf-8",
    ],
)
def test_json_media_types_are_canonicalised(content_type: str) -> None:
    assert digest(b'{"a":1,"b":2}', content_type=content_type) == digest(
        b'{ "b": 2, "a": 1 }', content_type=content_type
    )


@pytest.mark.parametrize("content_type", ["text/plain", "application/octet-stream", None, ""])
def test_non_json_media_types_are_not_canonicalised(content_type: str | None) -> None:
    assert digest(b'{"a":1,"b":2}', content_type=content_type) != digest(
        b'{ "b": 2, "a": 1 }', content_type=content_type
    )
    assert digest(b'{"a":1}', content_type=content_type) != digest(
        b'{"a": 1}', content_type=content_type
    )


def test_media_type_parsing() -> None:
    assert fingerprint.media_type("Application/JSON; charset=utf-8") == "application/json"
    assert fingerprint.media_type("application/problem+json") == "application/problem+json"
    assert fingerprint.media_type(" text/plain ") == "text/plain"
    assert fingerprint.media_type(None) == ""
    assert fingerprint.media_type("") == ""


def test_charset_parameter_does_not_change_the_fingerprint() -> None:
    assert digest(b'{"a":1}', content_type=JSON) == digest(
        b'{"a":1}', content_type="application/json; charset=utf-8"
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":',
        b"{'a': 1}",
        b'{"a":1}}',
        b"",
        b"\xff\xfe\x00garbage",
        b'"\xff"',
        b"[NaN]",
        b"[Infinity]",
        b"[-Infinity]",
        b"[1e400]",
    ],
    ids=[
        "truncated",
        "single-quotes",
        "trailing-brace",
        "empty",
        "binary",
        "bad-utf8-string",
        "nan",
        "infinity",
        "minus-infinity",
        "overflowing-float",
    ],
)
def test_invalid_json_is_fingerprinted_as_bytes(body: bytes) -> None:
    assert fingerprint.canonical_json(body) is None
    result = digest(body)
    assert len(result) == 32
    # As bytes: the same bytes under a non-JSON type differ only by the media type, and any
    # other bytes give another digest.
    assert digest(body) == result
    assert digest(body + b" ") != result
    assert digest(b"x" + body) != result


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000],
    ids=["unclosed-arrays", "closed-arrays", "unclosed-objects"],
)
def test_absurd_nesting_does_not_raise(body: bytes) -> None:
    result = digest(body)
    assert len(result) == 32
    assert digest(body[1:]) != result


def test_invalid_json_differs_from_other_invalid_json() -> None:
    assert digest(b"[NaN]") != digest(b"[Infinity]")
    assert digest(b'{"a":') != digest(b'{"a": ')


# -- query ------------------------------------------------------------------------------------


def test_query_parameter_order_does_not_matter() -> None:
    assert digest(query="a=1&b=2") == digest(query="b=2&a=1")
    assert digest(query=b"a=1&b=2&c=3") == digest(query=b"c=3&a=1&b=2")


def test_query_as_bytes_or_text_is_the_same() -> None:
    assert digest(query=b"a=1&b=2") == digest(query="a=1&b=2")


def test_query_values_matter() -> None:
    assert digest(query="a=1&b=2") != digest(query="a=1&b=3")
    assert digest(query="a=1&b=2") != digest(query="a=2&b=1")
    assert digest(query="a=1") != digest(query="a=1&a=1")


def test_blank_query_values_are_kept() -> None:
    assert digest(query="a=1&b=") != digest(query="a=1")
    assert digest(query="b") != digest(query="")
    assert b'"b"' in fingerprint.canonical_query("a=1&b=")


def test_canonical_query_sorts_by_name_then_value() -> None:
    assert fingerprint.canonical_query("b=2&a=2&a=1") == fingerprint.canonical_query("a=1&a=2&b=2")
    assert json.loads(fingerprint.canonical_query("b=2&a=2&a=1")) == [
        ["a", "1"],
        ["a", "2"],
        ["b", "2"],
    ]


def test_query_separators_cannot_be_smuggled() -> None:
    assert digest(query="a=1%262") != digest(query="a=1&2")
    assert digest(query="a=b%3Dc") != digest(query="a%3Db=c")


def test_distinct_percent_encoded_bytes_give_distinct_fingerprints() -> None:
    assert digest(query="amount=%FF") != digest(query="amount=%FE")


# -- every part counts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changed",
    [
        {"method": "PATCH"},
        {"path": "/charges/1"},
        {"path": "/Charges"},
        {"query": "a=1"},
        {"content_type": "text/plain"},
        {"content_type": "application/problem+json"},
        {"content_type": None},
        {"body": b'{"a":2}'},
        {"body": b"[]"},
    ],
)
def test_each_part_changes_the_fingerprint(changed: dict[str, object]) -> None:
    base: dict[str, object] = {
        "method": "POST",
        "path": "/charges",
        "query": "",
        "content_type": JSON,
        "body": b'{"a":1}',
    }
    assert digest(**base) == digest(**base)  # type: ignore[arg-type]
    assert digest(**base) != digest(**{**base, **changed})  # type: ignore[arg-type]


def test_parts_cannot_run_together() -> None:
    assert digest(path="/ab", query="c=1") != digest(path="/a", query="bc=1")
    assert digest(b"ab", method="POST", content_type=None) != digest(
        b"b", method="POSTa", content_type=None
    )


# -- properties -------------------------------------------------------------------------------

json_documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)


def _reversed_insertion(document: object) -> object:
    if isinstance(document, dict):
        return {key: _reversed_insertion(document[key]) for key in reversed(list(document))}
    if isinstance(document, list):
        return [_reversed_insertion(item) for item in document]
    return document


@settings(max_examples=150, deadline=None)
@given(
    document=json_documents,
    indent=st.none() | st.integers(min_value=0, max_value=4),
    sort_keys=st.booleans(),
    reverse=st.booleans(),
    ensure_ascii=st.booleans(),
)
def test_reserialised_document_has_the_same_fingerprint(
    document: object, indent: int | None, sort_keys: bool, reverse: bool, ensure_ascii: bool
) -> None:
    original = json.dumps(document).encode()
    other_document = _reversed_insertion(document) if reverse else document
    reserialised = json.dumps(
        other_document, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    ).encode()
    assert digest(original) == digest(reserialised)


@settings(max_examples=150, deadline=None)
@given(first=json_documents, second=json_documents)
def test_different_documents_have_different_fingerprints(first: object, second: object) -> None:
    first_body = json.dumps(first).encode()
    second_body = json.dumps(second).encode()
    if json.dumps(first, sort_keys=True) != json.dumps(second, sort_keys=True):
        assert digest(first_body) != digest(second_body)


tokens = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="%&=+#?"),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(
    document=json_documents,
    method=st.sampled_from(["POST", "PATCH", "PUT", "DELETE"]),
    other_method=st.sampled_from(["POST", "PATCH", "PUT", "DELETE"]),
    path=tokens,
    other_path=tokens,
    value=tokens,
    other_value=tokens,
)
def test_changing_method_path_or_query_changes_the_fingerprint(
    document: object,
    method: str,
    other_method: str,
    path: str,
    other_path: str,
    value: str,
    other_value: str,
) -> None:
    body = json.dumps(document).encode()
    base = digest(body, method=method, path="/" + path, query="q=" + value)
    assert (base == digest(body, method=other_method, path="/" + path, query="q=" + value)) == (
        method == other_method
    )
    assert (base == digest(body, method=method, path="/" + other_path, query="q=" + value)) == (
        path == other_path
    )
    assert (base == digest(body, method=method, path="/" + path, query="q=" + other_value)) == (
        value == other_value
    )


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=64), other=st.binary(max_size=64))
def test_changing_the_body_changes_the_fingerprint(body: bytes, other: bytes) -> None:
    for content_type in ("application/octet-stream", JSON):
        same = body == other or (
            content_type == JSON
            and fingerprint.canonical_json(body) is not None
            and fingerprint.canonical_json(body) == fingerprint.canonical_json(other)
        )
        assert (
            digest(body, content_type=content_type) == digest(other, content_type=content_type)
        ) == same


def _document(items: int, reverse: bool) -> bytes:
    pairs = [(f"k{index:06d}", index) for index in range(items)]
    return json.dumps(dict(reversed(pairs) if reverse else pairs)).encode()


def test_json_up_to_the_limit_is_canonical_and_larger_json_is_its_bytes() -> None:
    def digest(body: bytes) -> bytes:
        return fingerprint.compute("POST", "/x", "", "application/json", body)

    small, small_reordered = _document(100, False), _document(100, True)
    assert len(small) <= fingerprint.CANONICAL_JSON_LIMIT
    assert digest(small) == digest(small_reordered)
    large, large_reordered = _document(8000, False), _document(8000, True)
    assert len(large) > fingerprint.CANONICAL_JSON_LIMIT
    assert digest(large) != digest(large_reordered)  # bytes, not parsed
    assert digest(large) == digest(bytes(large))  # and the same bytes are the same request


# -- form bodies -----------------------------------------------------------------------------

FORM = "application/x-www-form-urlencoded"


def form(body: bytes, content_type: str = FORM) -> bytes:
    return digest(body, content_type=content_type)


@pytest.mark.parametrize(
    ("body", "same"),
    [
        (b"email=a%40example.com&name=A", b"name=A&email=a%40example.com"),  # Stripe's reorder
        (b"a=1&b=2", b"b=2&a=1"),
        (b"a=hello+world", b"a=hello%20world"),
        (b"a=%41", b"a=A"),
        (b"a=%2b", b"a=%2B"),
        (b"a=1&&b=2", b"a=1&b=2"),
        (b"&a=1&", b"a=1"),
        (b"items[0]=x&amount=5", b"amount=5&items%5B0%5D=x"),
        (b"a=1&b=2&a=3", b"b=2&a=1&a=3"),  # repeated names keep their order
    ],
)
def test_form_bodies_that_every_parser_reads_the_same_are_the_same_request(
    body: bytes, same: bytes
) -> None:
    assert form(body) == form(same)


@pytest.mark.parametrize(
    ("body", "other"),
    [
        (b"a=1&a=2", b"a=2&a=1"),  # a list, in the client's order
        (b"a", b"a="),  # some parsers read the first as null
        (b"a=1", b"a=2"),
        (b"a=%2B", b"a=+"),  # a plus sign is not a space
        (b"a=%26b", b"a=&b"),  # an escaped separator is data
        (b"a=%3D", b"a%3D="),
        (b"a=%FF", b"a=%FE"),  # bytes that are not UTF-8 stay distinct
        (b"a=1&b=2", b"a=1&b=2&c=3"),
    ],
)
def test_form_bodies_that_a_parser_could_tell_apart_are_different_requests(
    body: bytes, other: bytes
) -> None:
    assert form(body) != form(other)


def test_form_canonicalisation_ignores_the_charset_parameter_and_case() -> None:
    assert form(b"b=2&a=1", "Application/X-WWW-Form-Urlencoded; charset=utf-8") == form(b"a=1&b=2")


def test_form_rules_apply_to_form_bodies_only() -> None:
    for content_type in ("text/plain", "application/octet-stream", None):
        assert digest(b"a=1&b=2", content_type=content_type) != digest(
            b"b=2&a=1", content_type=content_type
        )


@pytest.mark.parametrize(
    "body",
    [b"a=%zz", b"a=%4", b"a=1%", b"a=caf\xc3\xa9", b"a=1 &b=2", b"a=1\n", b"a=1\r\nb=2", b"\x00"],
    ids=["bad-escape", "short-escape", "trailing-percent", "raw-utf8", "space", "newline",
         "crlf", "nul"],
)  # fmt: skip
def test_invalid_form_data_is_fingerprinted_as_its_bytes(body: bytes) -> None:
    assert fingerprint.canonical_form(body) is None
    # As bytes: the same bytes under another media type differ only by the media type.
    assert form(body) == fingerprint._digest("POST", "/charges", "", FORM, b"bytes", body)
    swapped = b"&".join(reversed(body.split(b"&")))
    if swapped != body:
        assert form(body) != form(swapped)


def test_an_empty_form_body_is_the_form_with_no_fields() -> None:
    assert fingerprint.canonical_form(b"") == b""
    assert form(b"") == form(b"&") == form(b"&&")


def test_form_up_to_the_limit_is_canonical_and_larger_form_is_its_bytes() -> None:
    def padded(size: int, order: tuple[bytes, bytes]) -> bytes:
        head = b"&".join(order) + b"&pad="
        return head + b"x" * (size - len(head))

    limit = fingerprint.CANONICAL_FORM_LIMIT
    assert form(padded(limit, (b"a=1", b"b=2"))) == form(padded(limit, (b"b=2", b"a=1")))
    assert form(padded(limit + 1, (b"a=1", b"b=2"))) != form(padded(limit + 1, (b"b=2", b"a=1")))


def test_the_byte_rule_digest_is_given_for_form_bodies_only() -> None:
    arguments = ("POST", "/charges", "", FORM, b"b=2&a=1")
    request = fingerprint.of_request(*arguments)
    assert request.digest == fingerprint.compute(*arguments)
    assert request.before_forms is not None and request.before_forms != request.digest
    # What the gateway computed before forms were canonicalised: the body as its bytes.
    assert request.before_forms == fingerprint._digest(*arguments[:3], FORM, b"bytes", b"b=2&a=1")
    assert fingerprint.of_request("POST", "/charges", "", JSON, b"{}").before_forms is None


def test_a_key_stored_under_the_byte_rule_matches_only_the_same_bytes() -> None:
    stored = fingerprint.before_forms("POST", "/charges", "", FORM, b"b=2&a=1")
    assert stored is not None
    assert fingerprint.of_request("POST", "/charges", "", FORM, b"b=2&a=1").matches(stored)
    # The reordered body was a different request under the byte rule; it still is for that key.
    assert not fingerprint.of_request("POST", "/charges", "", FORM, b"a=1&b=2").matches(stored)
    # A new key stores the new digest, which the reordered body matches.
    new = fingerprint.compute("POST", "/charges", "", FORM, b"b=2&a=1")
    assert fingerprint.of_request("POST", "/charges", "", FORM, b"a=1&b=2").matches(new)
