"""oncegate.keys: parsing the Idempotency-Key header and deriving its scope (contract section 4)."""

from __future__ import annotations

import pytest

from oncegate import errors, keys


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
