"""Parse the Idempotency-Key header and derive the scope a key belongs to. Pure functions.

Rules (contract section 4):
- The value is a Structured Fields string (`"abc"`, RFC 8941 §3.3.3: printable ASCII, with only
  `\\"` and `\\\\` as escapes) or the same characters bare (`abc`, as Stripe clients send it).
  Both forms name the same key.
- A key is 1 to 255 printable ASCII characters (0x20-0x7E).
- Two header lines, an sf-list (a bare value with a comma), an unterminated string or any other
  character make the key malformed. A missing header is not malformed: the route decides.
- A scope is the route name plus a SHA-256 of the route's `scope_headers` values, so the same key
  sent with two credentials is two independent keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from . import errors

HEADER = "idempotency-key"
MAX_KEY_LENGTH = 255
_PRINTABLE = frozenset(map(chr, range(0x20, 0x7F)))


def parse(values: Sequence[str]) -> str | None:
    """Return the key named by the request's Idempotency-Key header lines, or None if absent.

    `values` are the values of every header line with that name, in order (as received, each
    byte one character).
    Raises `errors.InvalidKey` with a detail saying what is wrong.
    """
    if not values:
        return None
    if len(values) > 1:
        raise errors.InvalidKey("send exactly one Idempotency-Key header line, not several")
    text = values[0].strip(" ")
    if not _PRINTABLE.issuperset(text):
        raise errors.InvalidKey("the Idempotency-Key must be printable ASCII characters only")
    key = _parse_sf_string(text) if text.startswith('"') else _parse_bare(text)
    if not key:
        raise errors.InvalidKey("the Idempotency-Key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise errors.InvalidKey(
            f"the Idempotency-Key is {len(key)} characters long; "
            f"at most {MAX_KEY_LENGTH} are allowed"
        )
    return key


def _parse_bare(text: str) -> str:
    if "," in text:
        raise errors.InvalidKey(
            "a bare Idempotency-Key cannot contain a comma (it would be a list); "
            'send it as a quoted string, like "a,b"'
        )
    return text


def _parse_sf_string(text: str) -> str:
    characters: list[str] = []
    index = 1
    while index < len(text):
        character = text[index]
        if character == "\\":
            if index + 1 >= len(text) or text[index + 1] not in '"\\':
                raise errors.InvalidKey(
                    'in a quoted Idempotency-Key a backslash may only escape " or \\'
                )
            characters.append(text[index + 1])
            index += 2
            continue
        if character == '"':
            if index != len(text) - 1:
                raise errors.InvalidKey(
                    "the quoted Idempotency-Key has characters after its closing quote"
                )
            return "".join(characters)
        characters.append(character)
        index += 1
    raise errors.InvalidKey("the quoted Idempotency-Key has no closing quote")


def scope(route_name: str, scope_values: Sequence[Sequence[str]]) -> bytes:
    """SHA-256 naming whose keys these are: the route and the values of its scope headers.

    `scope_values` holds, for each configured scope header in order, that header's values.
    Every part is length-prefixed, so no two different inputs can run together into one digest.
    """
    digest = hashlib.sha256()
    _update(digest, route_name.encode())
    for values in scope_values:
        _update(digest, len(values).to_bytes(4, "big"))
        for value in values:
            _update(digest, value.encode("latin-1"))
    return digest.digest()


def _update(digest: hashlib._Hash, part: bytes) -> None:
    digest.update(len(part).to_bytes(8, "big"))
    digest.update(part)
