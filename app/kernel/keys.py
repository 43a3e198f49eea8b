"""Parse the Idempotency-Key header (or the route's `key_header`, or the field its
`key_from_body` points at) and derive the scope a key belongs to. Pure functions.

Rules (contract sections 4 and 10):
- The value is a Structured Fields string (`"abc"`, RFC 8941 §3.3.3: printable ASCII, with only
  `\\"` and `\\\\` as escapes) or the same characters bare (`abc`, as Stripe clients send it).
  Both forms name the same key.
- A key is 1 to 255 printable ASCII characters (0x20-0x7E).
- Two header lines, an sf-list (a bare value with a comma), an unterminated string or any other
  character make the key malformed. A missing header is not malformed: the route decides.
- `key_from_body` is an RFC 6901 JSON pointer (`/idempotency_key`, `/a~1b` for the name `a/b`,
  `/m~0n` for `m~n`): the key is the string it points at in a JSON body, held to the same
  characters and length as a header's. Absent (or no JSON body at all) is a missing key; a
  value that is not a string is a malformed one.
- A scope is the route name plus a SHA-256 of the route's `scope_headers` values, so the same key
  sent with two credentials is two independent keys.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from ..model import errors

# The contract's key header, as messages spell it, and as request header names are matched.
HEADER = "Idempotency-Key"
HEADER_NAME = HEADER.lower()
MAX_KEY_LENGTH = 255
_PRINTABLE = frozenset(map(chr, range(0x20, 0x7F)))
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")


def parse(values: Sequence[str], header: str = HEADER) -> str | None:
    """Return the key named by the request's key header lines, or None if absent.

    `values` are the values of every header line with that name, in order (as received, each
    byte one character); `header` is the name as the route spells it, for the messages.
    Raises `errors.InvalidKey` with a detail saying what is wrong.
    """
    if not values:
        return None
    if len(values) > 1:
        raise errors.InvalidKey(f"send exactly one {header} header line, not several")
    text = values[0].strip(" ")
    if not _PRINTABLE.issuperset(text):
        raise errors.InvalidKey(f"the {header} must be printable ASCII characters only")
    key = _parse_sf_string(text, header) if text.startswith('"') else _parse_bare(text, header)
    return _checked(key, f"the {header}")


def _checked(key: str, what: str) -> str:
    if not key:
        raise errors.InvalidKey(f"{what} is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise errors.InvalidKey(
            f"{what} is {len(key)} characters long; at most {MAX_KEY_LENGTH} are allowed"
        )
    return key


def _parse_bare(text: str, header: str) -> str:
    if "," in text:
        raise errors.InvalidKey(
            f"a bare {header} cannot contain a comma (it would be a list); "
            'send it as a quoted string, like "a,b"'
        )
    return text


def _parse_sf_string(text: str, header: str) -> str:
    characters: list[str] = []
    index = 1
    while index < len(text):
        character = text[index]
        if character == "\\":
            if index + 1 >= len(text) or text[index + 1] not in '"\\':
                raise errors.InvalidKey(f'in a quoted {header} a backslash may only escape " or \\')
            characters.append(text[index + 1])
            index += 2
            continue
        if character == '"':
            if index != len(text) - 1:
                raise errors.InvalidKey(
                    f"the quoted {header} has characters after its closing quote"
                )
            return "".join(characters)
        characters.append(character)
        index += 1
    raise errors.InvalidKey(f"the quoted {header} has no closing quote")


def parse_pointer(pointer: str) -> tuple[str, ...]:
    """An RFC 6901 JSON pointer's reference tokens: `/a~1b/~0c/0` -> ("a/b", "~c", "0").

    The empty pointer (the whole document) names no field, so it is refused, as is a pointer
    that does not start with `/` or holds a `~` other than `~0` and `~1`.
    Raises ValueError saying what is wrong.
    """
    if not pointer.startswith("/"):
        raise ValueError(
            f"{pointer!r} is not a JSON pointer to a field: it starts with '/', as in "
            "/idempotency_key"
        )
    tokens = []
    for token in pointer[1:].split("/"):
        position = token.find("~")
        while position != -1:
            if token[position + 1 : position + 2] not in ("0", "1"):
                raise ValueError(
                    f"{pointer!r}: in a JSON pointer '~' is only '~0' (for ~) or '~1' (for /)"
                )
            position = token.find("~", position + 2)
        # ~1 first, then ~0: `~01` is the name `~1`, not `/` (RFC 6901 §4).
        tokens.append(token.replace("~1", "/").replace("~0", "~"))
    return tuple(tokens)


def from_body(body: bytes, pointer: Sequence[str], shown: str) -> str | None:
    """The key at `pointer` (its tokens, `parse_pointer`) in a JSON `body`, or None when the
    body is not JSON or has nothing there. `shown` is the pointer as configured, for messages.
    Raises `errors.InvalidKey` when the value there is not a string or not a valid key."""
    try:
        value: object = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (bad syntax or UTF-8), or absurdly nested
        return None
    for name in pointer:
        if isinstance(value, dict):
            if name not in value:
                return None
            value = value[name]
        elif isinstance(value, list):
            # RFC 6901 §4: an array index is `0` or digits without a leading zero; `-` (past
            # the end) and anything else name no element.
            if not _ARRAY_INDEX.fullmatch(name):
                return None
            index = int(name)
            if index >= len(value):
                return None
            value = value[index]
        else:
            return None
    if not isinstance(value, str):
        raise errors.InvalidKey(
            f"the body's {shown} is a JSON {_json_kind(value)}; the key must be a string"
        )
    if not _PRINTABLE.issuperset(value):
        raise errors.InvalidKey(f"the body's {shown} must be printable ASCII characters only")
    return _checked(value, f"the body's {shown}")


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"


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
