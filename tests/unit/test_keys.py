"""oncegate.kernel.keys: parsing the Idempotency-Key header and deriving its scope (contract
section 4)."""

from __future__ import annotations

import pytest

from oncegate.kernel import keys
from oncegate.model import errors


def test_no_header_is_not_a_key() -> None:
    assert keys.parse([]) is None


@pytest.mark.parametrize(
    "value",
    ['"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"],
)
def test_sf_string_and_bare_form_name_the_same_key(value: str) -> None:
    assert keys.parse([value]) == "8e03978e-40d5-43e8-bc93-6894a57f9324"


def test_sf_string_escapes_are_unescaped() -> None:
    assert keys.parse([r'"a\"b"']) == 'a"b'
    assert keys.parse([r'"a\\b"']) == "a\\b"
    assert keys.parse([r'"\\\""']) == '\\"'


def test_sf_string_and_its_unescaped_bare_form_are_one_key() -> None:
    assert keys.parse([r'"a\\b"']) == keys.parse(["a\\b"])


def test_sf_string_may_hold_spaces_and_commas() -> None:
    assert keys.parse(['"a b,c"']) == "a b,c"


def test_surrounding_spaces_are_not_part_of_the_key() -> None:
    assert keys.parse(["  abc  "]) == "abc"
    assert keys.parse(['  "abc"  ']) == "abc"


def test_every_printable_character_is_allowed() -> None:
    printable = "".join(map(chr, range(0x21, 0x7F))).replace(",", "")
    assert keys.parse([printable]) == printable


@pytest.mark.parametrize(
    "value",
    [
        r'"a\b"',  # only \" and \\ are escapes
        r'"a\n"',
        '"abc\\',  # a backslash at the very end
        '"abc\\"',  # the closing quote is escaped: unterminated
    ],
)
def test_invalid_escape_is_invalid(value: str) -> None:
    with pytest.raises(errors.InvalidKey):
        keys.parse([value])


@pytest.mark.parametrize("value", ['"abc', '"', '"a b'])
def test_unterminated_quote_is_invalid(value: str) -> None:
    with pytest.raises(errors.InvalidKey, match="closing quote"):
        keys.parse([value])


@pytest.mark.parametrize("value", ['"abc"d', '"abc""', '"a";x=1', '"a" "b"'])
def test_characters_after_the_closing_quote_are_invalid(value: str) -> None:
    with pytest.raises(errors.InvalidKey):
        keys.parse([value])


@pytest.mark.parametrize("value", ["", '""', "   ", '  ""  '])
def test_empty_key_is_invalid(value: str) -> None:
    with pytest.raises(errors.InvalidKey, match="empty"):
        keys.parse([value])


def test_255_characters_are_allowed_in_both_forms() -> None:
    key = "k" * 255
    assert keys.parse([key]) == key
    assert keys.parse([f'"{key}"']) == key


def test_255_characters_counted_after_unescaping() -> None:
    key = '"' * 255
    assert keys.parse(['"' + '\\"' * 255 + '"']) == key


@pytest.mark.parametrize("value", ["k" * 256, '"' + "k" * 256 + '"', '"' + '\\"' * 256 + '"'])
def test_256_characters_are_too_long(value: str) -> None:
    with pytest.raises(errors.InvalidKey, match="256"):
        keys.parse([value])


@pytest.mark.parametrize(
    "character",
    ["\t", "\x7f", "\x00", "\x1b", "\n", "\x80", "\xe9", "\xff"],
    ids=["tab", "DEL", "NUL", "ESC", "LF", "0x80", "latin1-e-acute", "0xff"],
)
@pytest.mark.parametrize("quoted", [False, True], ids=["bare", "sf-string"])
def test_non_printable_characters_are_invalid(character: str, quoted: bool) -> None:
    value = f"ab{character}cd"
    with pytest.raises(errors.InvalidKey, match="printable"):
        keys.parse([f'"{value}"' if quoted else value])


def test_bare_value_with_a_comma_is_invalid() -> None:
    with pytest.raises(errors.InvalidKey, match="comma"):
        keys.parse(["a,b"])


def test_quoted_value_with_a_comma_is_fine() -> None:
    assert keys.parse(['"a,b"']) == "a,b"


@pytest.mark.parametrize("values", [["a", "b"], ["a", "a"], ['"a"', "a"], ["a", ""]])
def test_two_header_lines_are_invalid(values: list[str]) -> None:
    with pytest.raises(errors.InvalidKey, match="one Idempotency-Key header"):
        keys.parse(values)


def test_invalid_key_is_a_400_invalid_key_problem() -> None:
    with pytest.raises(errors.InvalidKey) as caught:
        keys.parse([""])
    assert caught.value.status_code == 400
    assert caught.value.type_uri == "urn:oncegate:problem:invalid-key"
    assert caught.value.detail


# -- scope -----------------------------------------------------------------------------------


def test_scope_is_a_32_byte_digest() -> None:
    digest = keys.scope("payments", [["Bearer a"]])
    assert isinstance(digest, bytes)
    assert len(digest) == 32


def test_scope_is_deterministic() -> None:
    assert keys.scope("payments", [["Bearer a"], ["t1"]]) == keys.scope(
        "payments", [["Bearer a"], ["t1"]]
    )


def test_scope_depends_on_the_route() -> None:
    assert keys.scope("payments", [["Bearer a"]]) != keys.scope("emails", [["Bearer a"]])


def test_scope_depends_on_the_header_values() -> None:
    assert keys.scope("payments", [["Bearer a"]]) != keys.scope("payments", [["Bearer b"]])


def test_scope_depends_on_the_order_of_values_in_one_header() -> None:
    assert keys.scope("r", [["a", "b"]]) != keys.scope("r", [["b", "a"]])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ([["a"], []], [[], ["a"]]),  # a value moved to the other header
        ([["a", "b"], []], [["a"], ["b"]]),
        ([["ab"], ["c"]], [["a"], ["bc"]]),  # characters moved across the boundary
        ([["ab"]], [["a", "b"]]),  # one value vs two lines
        ([[]], [[""]]),  # a missing header vs an empty one
        ([[], []], [[""], []]),
        ([[]], []),  # one scope header configured vs none
    ],
)
def test_scope_values_cannot_run_together(first: list[list[str]], second: list[list[str]]) -> None:
    assert keys.scope("r", first) != keys.scope("r", second)


def test_route_name_and_values_cannot_run_together() -> None:
    assert keys.scope("ab", [["c"]]) != keys.scope("a", [["bc"]])


def test_scope_accepts_latin1_header_values() -> None:
    assert keys.scope("r", [["caf\xe9"]]) != keys.scope("r", [["cafe"]])


# -- another header, and keys in the body (contract section 10) -----------------------------


def test_messages_name_the_routes_key_header() -> None:
    with pytest.raises(errors.InvalidKey, match="PayPal-Request-Id"):
        keys.parse(["a", "b"], "PayPal-Request-Id")
    assert keys.parse(['"abc"'], "PayPal-Request-Id") == "abc"


@pytest.mark.parametrize(
    ("pointer", "tokens"),
    [
        ("/idempotency_key", ("idempotency_key",)),
        ("/a/b/0", ("a", "b", "0")),
        ("/a~1b", ("a/b",)),  # RFC 6901 §3: ~1 is /
        ("/m~0n", ("m~n",)),  # ~0 is ~
        ("/~01", ("~1",)),  # ~0 first would make it /; the RFC decodes ~1 first
        ("/~10", ("/0",)),
        ("/", ("",)),  # the member named by the empty string
        ("//", ("", "")),
        ("/ ", (" ",)),
        ("/c%d", ("c%d",)),  # no percent-decoding in a plain pointer
    ],
)
def test_json_pointers_parse_with_their_escapes(pointer: str, tokens: tuple[str, ...]) -> None:
    assert keys.parse_pointer(pointer) == tokens


@pytest.mark.parametrize("pointer", ["", "idempotency_key", "#/a", "/a~", "/a~2", "/~a", "/a/~"])
def test_malformed_json_pointers_are_refused(pointer: str) -> None:
    with pytest.raises(ValueError, match="pointer"):
        keys.parse_pointer(pointer)


def body_key(body: bytes, pointer: str) -> str | None:
    return keys.from_body(body, keys.parse_pointer(pointer), pointer)


@pytest.mark.parametrize(
    ("body", "pointer", "key"),
    [
        (b'{"idempotency_key": "k-1", "amount": 5}', "/idempotency_key", "k-1"),
        (b'{"a": {"b": ["x", {"c": "deep"}]}}', "/a/b/1/c", "deep"),
        (b'{"a/b": "slash", "m~n": "tilde"}', "/a~1b", "slash"),
        (b'{"a/b": "slash", "m~n": "tilde"}', "/m~0n", "tilde"),
        (b'{"": "empty-name"}', "/", "empty-name"),
        (b'{"k": "first", "k": "last"}', "/k", "last"),  # as the fingerprint reads it
        (b'{"k": "\\u0041B"}', "/k", "AB"),
    ],
)
def test_the_key_is_the_string_the_pointer_names(body: bytes, pointer: str, key: str) -> None:
    assert body_key(body, pointer) == key


@pytest.mark.parametrize(
    ("body", "pointer"),
    [
        (b'{"amount": 5}', "/idempotency_key"),
        (b"", "/k"),
        (b"not json", "/k"),
        (b'{"k": "v"', "/k"),  # truncated
        (b'"just a string"', "/k"),
        (b'["a", "b"]', "/k"),
        (b'{"a": ["x"]}', "/a/1"),  # past the end
        (b'{"a": ["x"]}', "/a/-"),  # the element after the last
        (b'{"a": ["x"]}', "/a/00"),  # a leading zero is no index
        (b'{"a": ["x"]}', "/a/+0"),
        (b'{"a": "x"}', "/a/0"),  # into a string
        (b'{"a": {"0": "x"}}', "/a/00"),
        (b"\xff\xfe", "/k"),
    ],
)
def test_nothing_there_is_a_missing_key(body: bytes, pointer: str) -> None:
    assert body_key(body, pointer) is None


def test_an_object_member_named_like_an_index_is_found() -> None:
    assert body_key(b'{"a": {"00": "x"}}', "/a/00") == "x"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"k": 12345}', "number"),
        (b'{"k": null}', "null"),
        (b'{"k": true}', "boolean"),
        (b'{"k": ["a"]}', "array"),
        (b'{"k": {"a": 1}}', "object"),
        (b'{"k": ""}', "empty"),
        (b'{"k": "caf\xc3\xa9"}', "printable ASCII"),
        (b'{"k": "a\\nb"}', "printable ASCII"),
        (b'{"k": "' + b"x" * 256 + b'"}', "256 characters"),
    ],
)
def test_a_value_that_cannot_be_a_key_is_a_malformed_key(body: bytes, message: str) -> None:
    with pytest.raises(errors.InvalidKey, match=message) as caught:
        body_key(body, "/k")
    assert "/k" in caught.value.detail
