"""Properties of key parsing, scope derivation and the fingerprint (contract section 4), tried on
many generated inputs. The example-based tests are `test_keys.py` and `test_fingerprint.py`; the
fingerprint properties already there (equal JSON documents, changed method/path/query with simple
tokens, changed bytes) are not repeated: these add what they leave out."""

from __future__ import annotations

import json
from urllib.parse import quote, quote_plus, urlencode

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from oncegate.kernel import fingerprint, keys
from oncegate.model import errors

PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
keys_text = st.text(alphabet=PRINTABLE, min_size=1, max_size=255)
any_text = st.text(alphabet=st.characters(max_codepoint=0xFF), max_size=300)


def sf_string(key: str) -> str:
    """The key as an RFC 8941 sf-string."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- key parsing -----------------------------------------------------------------------------


@settings(max_examples=300)
@given(key=keys_text)
def test_any_key_round_trips_through_the_sf_string_form(key: str) -> None:
    assume(key.strip(" "))
    assert keys.parse([sf_string(key)]) == key


@settings(max_examples=300)
@given(key=keys_text)
def test_a_bare_key_names_the_same_key_as_its_sf_string(key: str) -> None:
    bare = key.strip(" ")
    assume(bare and "," not in bare and not bare.startswith('"'))
    assert keys.parse([bare]) == keys.parse([sf_string(bare)]) == bare


@settings(max_examples=500)
@given(value=any_text)
@example("\r\nX-Injected: 1")
@example("a\nb")
@example('"a\x00"')
def test_parsing_any_header_value_gives_a_valid_key_or_invalid_key(value: str) -> None:
    try:
        key = keys.parse([value])
    except errors.InvalidKey as error:
        assert error.status_code == 400 and error.detail
        return
    assert key is not None
    assert 1 <= len(key) <= keys.MAX_KEY_LENGTH
    assert all(0x20 <= ord(character) <= 0x7E for character in key)  # no CR, LF, NUL, ...


@settings(max_examples=200)
@given(key=keys_text, bad=st.characters(codec="latin-1").filter(lambda c: not " " <= c <= "~"))
def test_a_control_or_non_ascii_character_anywhere_is_invalid(key: str, bad: str) -> None:
    position = len(key) // 2
    for value in (key[:position] + bad + key[position:], sf_string(key)[:-1] + bad + '"'):
        with pytest.raises(errors.InvalidKey):
            keys.parse([value])


@given(values=st.lists(any_text, min_size=2, max_size=4))
def test_more_than_one_header_line_is_always_invalid(values: list[str]) -> None:
    with pytest.raises(errors.InvalidKey):
        keys.parse(values)


# -- scope -----------------------------------------------------------------------------------

route_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=12)
header_values = st.lists(
    st.lists(st.text(alphabet=st.characters(max_codepoint=0xFF), max_size=12), max_size=3),
    max_size=3,
)


@settings(max_examples=400)
@given(route=route_names, values=header_values, other_route=route_names, other=header_values)
def test_scope_is_equal_exactly_when_route_and_values_are_equal(
    route: str, values: list[list[str]], other_route: str, other: list[list[str]]
) -> None:
    same_input = (route, values) == (other_route, other)
    assert (keys.scope(route, values) == keys.scope(other_route, other)) == same_input


@given(route=route_names, values=header_values)
def test_scope_is_a_deterministic_32_byte_digest(route: str, values: list[list[str]]) -> None:
    digest = keys.scope(route, values)
    assert len(digest) == 32 and digest == keys.scope(route, [list(v) for v in values])


@given(
    route=route_names, credential=st.text(max_size=20).map(lambda s: s.encode().decode("latin-1"))
)
def test_a_credential_never_shares_the_scope_of_no_credential(route: str, credential: str) -> None:
    assert keys.scope(route, [[credential]]) != keys.scope(route, [[]])


# -- fingerprint -----------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
json_documents = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
parameters = st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6)), min_size=0, max_size=5)


def digest(body: bytes, **changes: object) -> bytes:
    request: dict[str, object] = {
        "method": "POST",
        "path": "/charges",
        "query": "",
        "content_type": "application/json",
        "body": body,
    }
    request.update(changes)
    return fingerprint.of_request(**request).digest  # type: ignore[arg-type]


@settings(max_examples=200)
@given(document=json_documents, indent=st.none() | st.integers(0, 3), ascii_only=st.booleans())
def test_equal_json_with_floats_and_big_numbers_gives_equal_fingerprints(
    document: object, indent: int | None, ascii_only: bool
) -> None:
    compact = json.dumps(document, separators=(",", ":")).encode()
    spaced = json.dumps(document, indent=indent, ensure_ascii=ascii_only, sort_keys=True)
    assert digest(compact) == digest(spaced.encode())


@settings(max_examples=200)
@given(pairs=parameters, data=st.data())
def test_the_order_of_query_parameters_matters_only_among_one_name_s_values(
    pairs: list[tuple[str, str]], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(pairs))
    same = by_name(pairs) == by_name(shuffled)  # each name's values in the same order
    assert (
        digest(b"{}", query=urlencode(pairs)) == digest(b"{}", query=urlencode(shuffled))
    ) == same


@settings(max_examples=200)
@given(pairs=parameters, other=parameters)
def test_different_query_parameters_give_different_fingerprints(
    pairs: list[tuple[str, str]], other: list[tuple[str, str]]
) -> None:
    assume(by_name(pairs) != by_name(other))
    assert digest(b"{}", query=urlencode(pairs)) != digest(b"{}", query=urlencode(other))


@settings(max_examples=200)
@given(
    segments=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4),
    other=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4),
)
def test_different_paths_give_different_fingerprints(segments: list[str], other: list[str]) -> None:
    path = "/" + "/".join(quote(segment, safe="") for segment in segments)
    other_path = "/" + "/".join(quote(segment, safe="") for segment in other)
    assume(path != other_path)
    assert digest(b"{}", path=path) != digest(b"{}", path=other_path)


@given(
    method=st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=8),
    other=st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=8),
)
def test_different_methods_give_different_fingerprints(method: str, other: str) -> None:
    assert (digest(b"{}", method=method) == digest(b"{}", method=other)) == (method == other)


@settings(max_examples=200)
@given(document=json_documents, other=json_documents)
def test_different_json_documents_give_different_fingerprints(
    document: object, other: object
) -> None:
    canonical = json.dumps(document, sort_keys=True)
    assume(canonical != json.dumps(other, sort_keys=True))
    assert digest(json.dumps(document).encode()) != digest(json.dumps(other).encode())


@given(
    media=st.sampled_from(["text/plain", "application/xml", "application/octet-stream", ""]),
    body=st.binary(max_size=32),
)
def test_the_media_type_is_part_of_the_fingerprint(media: str, body: bytes) -> None:
    assert digest(body, content_type="application/json") != digest(body, content_type=media)


@settings(max_examples=300)
@given(
    method=st.text(max_size=10),
    path=st.text(max_size=30),
    query=st.binary(max_size=40) | st.text(max_size=40),
    content_type=st.none() | st.text(max_size=40),
    body=st.binary(max_size=200) | json_documents.map(lambda d: json.dumps(d).encode()),
)
def test_the_fingerprint_of_any_request_is_a_digest_never_an_error(
    method: str, path: str, query: bytes | str, content_type: str | None, body: bytes
) -> None:
    assert len(fingerprint.of_request(method, path, query, content_type, body).digest) == 32


# -- form bodies -----------------------------------------------------------------------------

FORM = "application/x-www-form-urlencoded"
form_text = st.text(max_size=8)
form_fields = st.lists(st.tuples(form_text, form_text), max_size=6)


def by_name(fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted(fields, key=lambda field: field[0].encode())


def keeping_repeated_names_in_order(
    fields: list[tuple[str, str]], shuffled: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """`shuffled`, with the values of each repeated name put back in their order in `fields`."""
    values: dict[str, list[str]] = {}
    for name, value in fields:
        values.setdefault(name, []).append(value)
    return [(name, values[name].pop(0)) for name, _ in shuffled]


@settings(max_examples=300, deadline=None)
@given(fields=form_fields, data=st.data(), plus=st.booleans())
def test_reordering_form_fields_by_name_keeps_the_fingerprint(
    fields: list[tuple[str, str]], data: st.DataObject, plus: bool
) -> None:
    """Any order that keeps repeated names in their order is the same request, and however
    the client percent-encodes (`+` or `%20`, escapes of unreserved characters or not)."""
    shuffled = keeping_repeated_names_in_order(fields, data.draw(st.permutations(fields)))
    quoting = quote_plus if plus else quote
    body = urlencode(fields).encode()
    other = "&".join(
        f"{quoting(name, safe='')}={quoting(value, safe='')}" for name, value in shuffled
    )
    assert digest(body, content_type=FORM) == digest(other.encode(), content_type=FORM)


@settings(max_examples=300, deadline=None)
@given(fields=form_fields, other=form_fields)
def test_forms_with_different_fields_give_different_fingerprints(
    fields: list[tuple[str, str]], other: list[tuple[str, str]]
) -> None:
    assume(by_name(fields) != by_name(other))
    assert digest(urlencode(fields).encode(), content_type=FORM) != digest(
        urlencode(other).encode(), content_type=FORM
    )


def strictly_valid_form(body: bytes) -> bool:
    """Visible ASCII, and every `%` the start of a two-hex-digit escape."""
    index = 0
    while index < len(body):
        if body[index : index + 1] == b"%":
            escape = body[index + 1 : index + 3]
            if len(escape) != 2 or not all(chr(c) in "0123456789abcdefABCDEF" for c in escape):
                return False
            index += 3
            continue
        if not 0x21 <= body[index] <= 0x7E:
            return False
        index += 1
    return True


@settings(max_examples=500, deadline=None)
@given(
    body=st.binary(max_size=60) | st.text(alphabet="ab=&%+1Fz \xe9", max_size=30).map(str.encode)
)
@example(b"a=%zz")
@example(b"a=\xff")
@example(b"a=%4")
def test_a_form_body_is_canonical_exactly_when_it_is_valid_else_its_bytes(body: bytes) -> None:
    canonical = fingerprint.canonical_form(body)
    assert (canonical is not None) == strictly_valid_form(body)
    digest = fingerprint.of_request("POST", "/p", "", FORM, body).digest
    assert len(digest) == 32
    as_bytes = fingerprint.as_bytes("POST", "/p", "", FORM, body)
    assert (digest == as_bytes) == (canonical is None)


@settings(max_examples=200, deadline=None)
@given(fields=form_fields, data=st.data())
def test_a_retry_of_a_key_stored_under_the_byte_rule_matches_its_own_bytes_only(
    fields: list[tuple[str, str]], data: st.DataObject
) -> None:
    body = urlencode(fields).encode()
    stored = fingerprint.as_bytes("POST", "/p", "", FORM, body)
    assert stored is not None
    assert fingerprint.of_request("POST", "/p", "", FORM, body).matches(stored)
    shuffled = urlencode(data.draw(st.permutations(fields))).encode()
    assert fingerprint.of_request("POST", "/p", "", FORM, shuffled).matches(stored) == (
        shuffled == body
    )


# -- keys in JSON bodies (RFC 6901 pointers) ---------------------------------------------------

tokens = st.lists(st.text(max_size=6), min_size=1, max_size=4)


def escaped(token: str) -> str:
    """A reference token as a pointer spells it (RFC 6901 §3): `~` first, then `/`."""
    return token.replace("~", "~0").replace("/", "~1")


@settings(max_examples=300, deadline=None)
@given(names=tokens)
@example(["~1"])
@example(["a/b", "m~n"])
def test_any_member_names_round_trip_through_a_pointer(names: list[str]) -> None:
    assert keys.parse_pointer("".join("/" + escaped(name) for name in names)) == tuple(names)


@settings(max_examples=300, deadline=None)
@given(names=tokens, key=keys_text, noise=st.dictionaries(st.text(max_size=4), json_scalars))
def test_the_key_is_found_wherever_the_pointer_names_it(
    names: list[str], key: str, noise: dict[str, object]
) -> None:
    document: object = key
    for name in reversed(names):
        document = {**noise, name: document}
    pointer = "".join("/" + escaped(name) for name in names)
    body = json.dumps(document).encode()
    assert keys.from_body(body, keys.parse_pointer(pointer), pointer) == key


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=80) | json_documents.map(lambda d: json.dumps(d).encode()),
    names=tokens,
)
def test_any_body_gives_a_key_nothing_or_invalid_key_never_another_error(
    body: bytes, names: list[str]
) -> None:
    pointer = "".join("/" + escaped(name) for name in names)
    try:
        key = keys.from_body(body, keys.parse_pointer(pointer), pointer)
    except errors.InvalidKey as error:
        assert error.status_code == 400 and pointer in error.detail
        return
    assert key is None or (1 <= len(key) <= keys.MAX_KEY_LENGTH and key.isprintable())
