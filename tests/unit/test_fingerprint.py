"""oncegate.kernel.fingerprint: what makes a retry "the same request" (contract section 4)."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oncegate.kernel import fingerprint

JSON = "application/json"


def digest(
    body: bytes = b"{}",
    *,
    method: str = "POST",
    path: str = "/charges",
    query: bytes | str = "",
    content_type: str | None = JSON,
) -> bytes:
    return fingerprint.of_request(method, path, query, content_type, body).digest


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
        b'{"a":1,"a":2}',
        b"[1e1234567890123456]",
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
        "a-member-named-twice",
        "an-exponent-of-16-digits",
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


def test_canonical_query_sorts_by_name_and_keeps_repeated_names_in_order() -> None:
    assert fingerprint.canonical_query("b=2&a=2&a=1") == fingerprint.canonical_query("a=2&a=1&b=2")
    assert json.loads(fingerprint.canonical_query("b=2&a=2&a=1")) == [
        ["a", "2"],
        ["a", "1"],
        ["b", "2"],
    ]


def test_repeated_query_parameters_in_another_order_are_another_request() -> None:
    """`to=alice&to=bob` is a list to most servers, and its order is the client's."""
    assert digest(query="to=alice&to=bob") != digest(query="to=bob&to=alice")
    assert digest(query="to=alice&cc=carol&to=bob") == digest(query="cc=carol&to=alice&to=bob")


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
        return fingerprint.of_request("POST", "/x", "", "application/json", body).digest

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
    assert form(body) == fingerprint._digest("POST", "/charges", "", FORM, b"bytes", (body,))
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
    assert request.digest == fingerprint.of_request(*arguments).digest
    assert request.as_bytes is not None and request.as_bytes != request.digest
    # What the gateway computed before forms were canonicalised: the body as its bytes.
    assert request.as_bytes == fingerprint._digest(*arguments[:3], FORM, b"bytes", (b"b=2&a=1",))
    assert fingerprint.of_request("POST", "/charges", "", JSON, b"{}").as_bytes is None


def test_a_key_stored_under_the_byte_rule_matches_only_the_same_bytes() -> None:
    stored = fingerprint.as_bytes("POST", "/charges", "", FORM, b"b=2&a=1")
    assert stored is not None
    assert fingerprint.of_request("POST", "/charges", "", FORM, b"b=2&a=1").matches(stored)
    # The reordered body was a different request under the byte rule; it still is for that key.
    assert not fingerprint.of_request("POST", "/charges", "", FORM, b"a=1&b=2").matches(stored)
    # A new key stores the new digest, which the reordered body matches.
    new = fingerprint.of_request("POST", "/charges", "", FORM, b"b=2&a=1").digest
    assert fingerprint.of_request("POST", "/charges", "", FORM, b"a=1&b=2").matches(new)


# -- JSON numbers: exact decimal values, never binary floats ------------------------------------


def canonical(body: bytes) -> bytes | None:
    return fingerprint.canonical_json(body)


def test_numbers_a_float_cannot_tell_apart_are_different_requests() -> None:
    assert digest(b'{"amount":0.123456789012345678}') != digest(b'{"amount":0.123456789012345677}')
    assert digest(b"[0.30000000000000001]") != digest(b"[0.3]")
    assert digest(b"[9007199254740993.0]") != digest(b"[9007199254740992.0]")
    assert digest(b"[1e400]") != digest(b"[1e401]")
    assert digest(b"[1e-400]") != digest(b"[0.0]")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"1.0", b"1.00"),
        (b"1.0", b"10e-1"),
        (b"100.0", b"1e2"),
        (b"100.0", b"1E+2"),
        (b"0.5", b"5e-1"),
        (b"0.123456789012345678", b"1234567890123456780e-19"),
        (b"1e400", b"10e399"),
        (b"-0.0", b"-0e7"),
        (b"0", b"-0"),
    ],
)
def test_numbers_of_one_decimal_value_and_kind_are_one_request(first: bytes, second: bytes) -> None:
    assert digest(b'{"n":' + first + b"}") == digest(b'{"n":' + second + b"}")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"1", b"1.0"),  # an int and a float to most parsers: a validator may take only one
        (b"100", b"1e2"),
        (b"0.0", b"-0.0"),  # a float's negative zero is a value of its own
        (b"0", b"0.0"),
    ],
)
def test_an_integer_is_never_a_fraction_and_a_float_zero_keeps_its_sign(
    first: bytes, second: bytes
) -> None:
    assert digest(b'{"n":' + first + b"}") != digest(b'{"n":' + second + b"}")


@pytest.mark.parametrize(
    ("number", "written"),
    [
        (b"1.00", b"1.0"),
        (b"1E2", b"100.0"),
        (b"1e-5", b"1e-05"),
        (b"12345678901234567e-1", b"1234567890123456.7"),
        (b"0.123456789012345678", b"0.123456789012345678"),
        (b"1e999999999", b"1e+999999999"),
        (b"-15e-1000000000", b"-1.5e-999999999"),
        (b"123456789012345678901234567890", b"123456789012345678901234567890"),
    ],
)
def test_a_number_is_written_with_its_exact_value(number: bytes, written: bytes) -> None:
    assert canonical(b"[" + number + b"]") == b"[" + written + b"]"


def test_a_body_of_floats_keeps_the_canonical_form_earlier_gateways_gave_it() -> None:
    # Numbers a float holds exactly are written as Python writes the float, so the digest a
    # key was stored under before numbers were compared exactly still matches its retries.
    body = b'{"b":[19.99,1e-7,1.5e300,-0.0,3],"a":{"y":0.1,"x":1E2}}'
    before = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    assert canonical(body) == before


def test_a_huge_exponent_costs_what_its_characters_cost() -> None:
    # 1e999999999 is never expanded: canonicalising a body of them is no slower than its size.
    body = b"[" + b",".join([b"1e999999999", b"-7.25e-999999998"] * 2000) + b"]"
    result = canonical(body)
    assert result is not None and len(result) < 2 * len(body)


@settings(max_examples=300, deadline=None)
@given(
    value=st.decimals(allow_nan=False, allow_infinity=False, places=None),
    exponent=st.integers(-5, 5),
)
def test_any_decimal_written_two_ways_is_one_request(value: object, exponent: int) -> None:
    from decimal import Context, Decimal

    assert isinstance(value, Decimal)
    plain = f"{value:f}"
    if "." not in plain:
        plain += ".0"  # a fraction, as the scaled spelling below is one
    scaled = f"{value.scaleb(-exponent, Context(prec=1000)):f}e{exponent}"  # exactly
    assert digest(f"[{plain}]".encode()) == digest(f"[{scaled}]".encode())


@settings(max_examples=300, deadline=None)
@given(first=st.decimals(allow_nan=False, allow_infinity=False, places=None),
       second=st.decimals(allow_nan=False, allow_infinity=False, places=None))  # fmt: skip
def test_different_decimal_values_are_different_requests(first: object, second: object) -> None:
    from decimal import Decimal

    assert isinstance(first, Decimal) and isinstance(second, Decimal)
    one, other = f"[{first:f}e0]".encode(), f"[{second:f}e0]".encode()
    same_value = first == second and first.is_signed() == second.is_signed()
    assert (digest(one) == digest(other)) == same_value


def test_a_member_named_twice_is_its_bytes_whichever_comes_first() -> None:
    # A first-wins parser reads an amount of 1 in the first body, a last-wins parser 2: it
    # must never be one request with {"amount": 2}.
    assert digest(b'{"amount":1,"amount":2}') != digest(b'{"amount":2}')
    assert digest(b'{"amount":1,"amount":2}') != digest(b'{"amount":2,"amount":1}')
    assert digest(b'{"a":{"b":1,"b":1}}') != digest(b'{"a":{"b":1}}')


# -- multipart bodies: by their parts, never by the boundary -------------------------------------

MULTIPART = "multipart/form-data"


def multipart(
    parts: list[tuple[bytes, bytes]], boundary: str = "b0undary", preamble: bytes = b""
) -> tuple[str, bytes]:
    """The content type and body of `parts` (each its head lines and its content)."""
    delimiter = b"--" + boundary.encode()
    body = preamble + b"".join(
        delimiter + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n" for head, content in parts
    ) + delimiter + b"--\r\n"  # fmt: skip
    return f"{MULTIPART}; boundary={boundary}", body


def part(
    name: str, content: bytes, filename: str | None = None, type_: str | None = None
) -> tuple[bytes, bytes]:
    head = f'Content-Disposition: form-data; name="{name}"'
    if filename is not None:
        head += f'; filename="{filename}"'
    if type_ is not None:
        head += f"\r\nContent-Type: {type_}"
    return head.encode(), content


def multipart_digest(parts: list[tuple[bytes, bytes]], **options: object) -> bytes:
    content_type, body = multipart(parts, **options)  # type: ignore[arg-type]
    return digest(body, content_type=content_type)


UPLOAD = [
    part("purpose", b"dispute_evidence"),
    part("file", b"%PDF-1.4\r\n--b0undar\r\n\x00\xff", "receipt.pdf", "application/pdf"),
]


def test_the_boundary_does_not_matter() -> None:
    assert multipart_digest(UPLOAD) == multipart_digest(UPLOAD, boundary="a1b2c3d4e5f6")
    quoted = multipart(UPLOAD, boundary="x y")[1]
    assert digest(quoted, content_type=f'{MULTIPART}; boundary="x y"') == multipart_digest(UPLOAD)


@pytest.mark.parametrize(
    "changed",
    [
        [part("purpose", b"identity_document"), UPLOAD[1]],
        [part("Purpose", b"dispute_evidence"), UPLOAD[1]],
        [UPLOAD[0], part("file", UPLOAD[1][1], "receipt2.pdf", "application/pdf")],
        [UPLOAD[0], part("file", UPLOAD[1][1], None, "application/pdf")],
        [UPLOAD[0], part("file", UPLOAD[1][1], "receipt.pdf", "application/octet-stream")],
        [UPLOAD[0], part("file", UPLOAD[1][1], "receipt.pdf")],
        [UPLOAD[0], part("file", UPLOAD[1][1] + b" ", "receipt.pdf", "application/pdf")],
        [UPLOAD[1], UPLOAD[0]],
        [UPLOAD[0]],
        [UPLOAD[0], UPLOAD[0], UPLOAD[1]],
        [UPLOAD[0], (UPLOAD[1][0] + b"\r\nContent-Transfer-Encoding: base64", UPLOAD[1][1])],
        [(UPLOAD[0][0] + b'; filename*="x"', UPLOAD[0][1]), UPLOAD[1]],
    ],
    ids=[
        "a-value",
        "a-name's-case",
        "a-filename",
        "no-filename",
        "a-content-type",
        "no-content-type",
        "a-byte",
        "the-order",
        "a-part-fewer",
        "a-part-more",
        "another-header",
        "another-parameter",
    ],
)
def test_different_parts_are_different_requests(changed: list[tuple[bytes, bytes]]) -> None:
    assert multipart_digest(changed) != multipart_digest(UPLOAD)


def test_what_no_parser_reads_differently_does_not_matter() -> None:
    respelled = [
        (b'content-disposition:form-data;NAME=purpose', b"dispute_evidence"),
        (b"Content-Type:  application/pdf\r\n"
         b"CONTENT-DISPOSITION: form-data ; filename=\"receipt.pdf\"; name=\"file\"",
         UPLOAD[1][1]),
    ]  # fmt: skip
    assert multipart_digest(respelled) == multipart_digest(UPLOAD)
    # The preamble and the epilogue are not parts.
    content_type, body = multipart(UPLOAD, preamble=b"This is a preamble.\r\n")
    assert digest(body + b"and an epilogue", content_type=content_type) == multipart_digest(UPLOAD)


def test_quoted_values_compare_as_sent() -> None:
    # `\\` is one backslash to an RFC parser and two to a browser's: kept as sent, so equal
    # only to itself.
    escaped = [(b'Content-Disposition: form-data; name="a\\\\b"', b"1")]
    assert multipart_digest(escaped) == multipart_digest(escaped, boundary="other")
    assert multipart_digest(escaped) != multipart_digest([part("a\\b", b"1")])


def test_a_multipart_body_is_hashed_where_it_lies_not_copied() -> None:
    content_type, body = multipart(UPLOAD)
    pieces = fingerprint.canonical_multipart(content_type, body)
    assert pieces is not None
    assert [bytes(piece) for piece in pieces if isinstance(piece, memoryview)] == [
        b"dispute_evidence",
        UPLOAD[1][1],
    ]


_CONTENT_TYPE, _BODY = multipart(UPLOAD)
MALFORMED = {
    "no-boundary": (MULTIPART, _BODY),
    "another-boundary": (f"{MULTIPART}; boundary=other", _BODY),
    "boundary-twice": (f"{MULTIPART}; boundary=b0undary; boundary=b0undary", _BODY),
    "boundary-too-long": multipart(UPLOAD, boundary="b" * 71),
    "no-closing-delimiter": (_CONTENT_TYPE, _BODY[: -len("--\r\n")]),
    "truncated": (_CONTENT_TYPE, _BODY[:60]),
    "padding-after-delimiter": (
        _CONTENT_TYPE,
        _BODY.replace(b"--b0undary\r\n", b"--b0undary \r\n", 1),
    ),
    "bare-line-feeds": (_CONTENT_TYPE, _BODY.replace(b"\r\n", b"\n")),
    "no-disposition": multipart([(b"Content-Type: text/plain", b"x")]),
    "no-name": multipart([(b"Content-Disposition: form-data", b"x")]),
    "not-form-data": multipart([(b'Content-Disposition: attachment; name="a"', b"x")]),
    "name-twice": multipart([(b'Content-Disposition: form-data; name="a"; name="b"', b"x")]),
    "header-twice": multipart(
        [(part("a", b"x", None, "text/plain")[0] + b"\r\nContent-Type: text/csv", b"x")]
    ),
    "folded-header": multipart([(b'Content-Disposition: form-data;\r\n name="a"', b"x")]),
    "control-byte": multipart([(b'Content-Disposition: form-data; name="a\x01"', b"x")]),
    "unterminated-quote": multipart([(b'Content-Disposition: form-data; name="a\\"', b"x")]),
    "no-parts": (_CONTENT_TYPE, b"--b0undary--\r\n"),
    "too-many-parts": multipart([part("a", b"")] * (fingerprint.MULTIPART_PART_LIMIT + 1)),
    # Part heads past the limit, however few the parts: what they hold costs Python to read.
    "heads-too-long": multipart(
        [(part("a", b"")[0] + b"".join(b"; p%d=v" % n for n in range(1_000)), b"")] * 12
    ),
    # `--boundary` where a lenient parser (one that takes a bare LF or CR, or any text, before
    # it) reads a delimiter and a strict one does not: in the preamble, a part, the epilogue.
    "delimiter-in-the-preamble": (_CONTENT_TYPE, b"note\n" + _BODY),
    "delimiter-after-a-bare-line-feed": (
        _CONTENT_TYPE,
        _BODY.replace(b"dispute_evidence", b"dispute_evidence\n--b0undary\r\n\r\nx", 1),
    ),
    "delimiter-after-a-bare-carriage-return": (
        _CONTENT_TYPE,
        _BODY.replace(b"dispute_evidence", b"dispute_evidence\r--b0undary\r\n\r\nx", 1),
    ),
    "delimiter-in-the-epilogue": (_CONTENT_TYPE, _BODY + b"--b0undary\r\n"),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_multipart_body_is_its_bytes(case: tuple[str, bytes]) -> None:
    content_type, body = case
    assert fingerprint.canonical_multipart(content_type, body) is None
    request = fingerprint.of_request("POST", "/files", "", content_type, body)
    # Its bytes: the byte rule's digest, which its own retries match and nothing else does.
    assert request.digest == request.as_bytes
    assert request.matches(fingerprint.of_request("POST", "/files", "", content_type, body).digest)
    assert digest(body + b"\r\n", content_type=content_type) != request.digest


def test_a_part_only_a_lenient_parser_reads_makes_two_bodies_two_requests() -> None:
    # After the preamble's bare LF, a part a strict parser leaves out and a lenient one (Python's
    # email parser, Werkzeug) reads: the amounts differ, so the requests must.
    amount = part("amount", b"100")
    to = part("to", b"ann")
    content_type, body = multipart([to])
    hidden = b"--b0undary\r\n" + amount[0] + b"\r\n\r\n" + amount[1] + b"\r\n"
    one = b"note\n" + hidden + body
    other = b"note\n" + hidden.replace(b"100", b"999999") + body
    assert digest(one, content_type=content_type) != digest(other, content_type=content_type)


def test_the_heads_limit_is_a_limit_not_a_failure() -> None:
    head = part("a", b"")[0]
    padded = head + b"; p=" + b"v" * (fingerprint.MULTIPART_HEADS_LIMIT // 8 - len(head) - 4)
    assert len(padded) * 8 == fingerprint.MULTIPART_HEADS_LIMIT
    assert fingerprint.canonical_multipart(*multipart([(padded, b"")] * 8)) is not None
    assert fingerprint.canonical_multipart(*multipart([(padded + b"v", b"")] * 8)) is None


def test_the_part_limit_is_a_limit_not_a_failure() -> None:
    assert (
        fingerprint.canonical_multipart(
            *multipart([part("a", b"")] * fingerprint.MULTIPART_PART_LIMIT)
        )
        is not None
    )


def test_a_key_stored_before_multipart_was_canonical_matches_its_own_bytes() -> None:
    content_type, body = multipart(UPLOAD)
    stored = fingerprint.as_bytes("POST", "/files", "", content_type, body)
    assert stored is not None
    assert fingerprint.of_request("POST", "/files", "", content_type, body).matches(stored)
    redrawn_type, redrawn = multipart(UPLOAD, boundary="redrawn")
    assert not fingerprint.of_request("POST", "/files", "", redrawn_type, redrawn).matches(stored)


def test_multipart_rules_apply_to_form_data_only() -> None:
    content_type, body = multipart(UPLOAD)
    mixed = content_type.replace(MULTIPART, "multipart/mixed")
    other = multipart(UPLOAD, boundary="other")
    assert digest(body, content_type=mixed) != digest(
        other[1], content_type=other[0].replace(MULTIPART, "multipart/mixed")
    )


# -- bodies sent with a Content-Encoding ------------------------------------------------------


def encoded(body: bytes, coding: str | None, content_type: str | None = JSON) -> bytes:
    return fingerprint.of_request("POST", "/charges", "", content_type, body, coding).digest


def test_a_document_gzipped_again_for_a_retry_is_the_same_request() -> None:
    """Every gzip encoder writes the time of compression into its header: a retry a second
    later sends other bytes for the same document."""
    document = b'{"amount": 100, "currency": "eur"}'
    first = gzip.compress(document, mtime=1_700_000_000)
    retry = gzip.compress(document, mtime=1_700_000_001)
    assert first != retry
    assert encoded(first, "gzip") == encoded(retry, "gzip")
    assert encoded(first, "x-gzip") == encoded(retry, "GZIP ")  # one coding, however spelt


def test_two_documents_gzipped_are_two_requests() -> None:
    one = gzip.compress(b'{"amount": 100}', mtime=0)
    other = gzip.compress(b'{"amount": 900}', mtime=0)
    assert encoded(one, "gzip") != encoded(other, "gzip")


def test_the_same_bytes_with_and_without_a_coding_are_two_requests() -> None:
    """The upstream decodes one and not the other: two different documents."""
    body = gzip.compress(b'{"a":1}', mtime=0)
    assert encoded(body, "gzip") != encoded(body, None)
    assert encoded(body, "gzip") != encoded(body, "deflate")
    assert encoded(body, "gzip") != encoded(body, "gzip, br")


def test_identity_is_no_coding() -> None:
    assert encoded(b'{"b":2,"a":1}', "identity") == encoded(b'{ "a": 1, "b": 2 }', None)


def test_an_encoded_body_is_its_bytes_whatever_its_media_type_says() -> None:
    """Bytes not yet of their media type are not read as it: no JSON or form rule applies."""
    assert encoded(b'{"b":2,"a":1}', "br") != encoded(b'{ "a": 1, "b": 2 }', "br")
    assert encoded(b"b=2&a=1", "br", fingerprint.FORM) != encoded(
        b"a=1&b=2", "br", fingerprint.FORM
    )
    body = b"b=2&a=1"
    found = fingerprint.of_request("POST", "/charges", "", fingerprint.FORM, body, "br")
    assert found.as_bytes is None  # no earlier rule's digest to match for such a body


def test_a_gzip_header_with_its_own_crc_is_read_as_its_bytes() -> None:
    """FHCRC covers the time: such a body is compared as sent."""
    body = bytearray(gzip.compress(b'{"a":1}', mtime=5))
    body[3] |= 0x02
    later = bytearray(body)
    later[4] = 6
    assert encoded(bytes(body), "gzip") != encoded(bytes(later), "gzip")
