"""The fingerprint of a request: what makes a retry "the same request". Pure functions.

Rules (contract section 4):
- SHA-256 over the method, the path, the query (parameters sorted), the media type and the body.
- A JSON body (media type `application/json` or `*/*+json`) is canonicalised first: object keys
  sorted, no insignificant white space, strings in one escaping. `{"a":1,"b":2}` and
  `{ "b": 2, "a": 1 }` are the same request.
- A body that claims to be JSON but does not parse (bad syntax, bad UTF-8, NaN, nesting too deep)
  is fingerprinted as its bytes: a client error never becomes a gateway error.
- A JSON body larger than `CANONICAL_JSON_LIMIT` is fingerprinted as its bytes too: parsing runs
  on the event loop, holding it (and every other request) for about 85 ms per MiB, so a client
  could stall everyone with a few large bodies. Retries send the same bytes, so this costs a
  retry nothing; two spellings of one large document are two requests.
- A form body (`application/x-www-form-urlencoded`, as Stripe's clients send) is canonicalised
  too: fields sorted by name, repeated names keeping their order (a stable sort: `a=1&a=2` is
  a list, and its order is the client's), `+` and `%20` both a space, percent escapes decoded
  byte for byte (`%41` is `A`, `%2b` is `%2B`, `%FF` stays one byte), empty fields (`a=1&&b=2`)
  dropped as every form parser drops them, and `a` kept apart from `a=` (some parsers read the
  first as null). Only what every form parser reads the same is made equal.
- A form body that is not strictly valid form data (a byte outside visible ASCII, such as raw
  white space or UTF-8, or a `%` that does not start a two-digit escape) is fingerprinted as
  its bytes: parsers disagree on what such a body means, so two spellings of it are two requests.
  So is one larger than `CANONICAL_FORM_LIMIT`.
- Keys stored before form bodies were canonicalised hold the byte rule's digest: `before_forms`
  gives it for a form body (None for any other), and a retry matching either digest is the same
  request (`Fingerprint.matches`), so upgrading the gateway under in-flight retries refuses none.
- Each field is length-prefixed and the body records which form it took, so no two different
  requests can encode to the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote_to_bytes

# 64 KiB of JSON canonicalize in about 5 ms (measured: 0.4 ms for 10 KiB, 10 ms for 100 KiB,
# 85 ms for 1 MiB); larger API requests than that are rare, and a stall longer than that is not.
CANONICAL_JSON_LIMIT = 64 * 1024
# Form bodies cost about what JSON costs to canonicalise (measured: 4 ms for 64 KiB of 4,000 short
# fields), so the same limit, for the same reason.
CANONICAL_FORM_LIMIT = 64 * 1024
FORM = "application/x-www-form-urlencoded"
# Strictly valid form data: visible ASCII, every `%` the start of a two-hex-digit escape.
_VALID_FORM = re.compile(rb"(?:[\x21-\x24\x26-\x7e]|%[0-9A-Fa-f]{2})*")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A request's digest, and the digest the byte rule gave it before form bodies were
    canonicalised (`before_forms`), when that differs."""

    digest: bytes
    before_forms: bytes | None = None

    def matches(self, stored: bytes) -> bool:
        return stored == self.digest or (
            self.before_forms is not None and stored == self.before_forms
        )


def of_request(
    method: str, path: str, query: bytes | str, content_type: str | None, body: bytes
) -> Fingerprint:
    """The request's `Fingerprint`: its digest, and the byte rule's for a form body."""
    arguments = (method, path, query, content_type, body)
    return Fingerprint(compute(*arguments), before_forms(*arguments))


def compute(
    method: str, path: str, query: bytes | str, content_type: str | None, body: bytes
) -> bytes:
    media = media_type(content_type)
    form, canonical = _canonical_body(media, body)
    return _digest(method, path, query, media, form, canonical)


def before_forms(
    method: str, path: str, query: bytes | str, content_type: str | None, body: bytes
) -> bytes | None:
    """The digest of a form body under the rule before forms were canonicalised (as its
    bytes), or None when the body is not form data (its digest never changed)."""
    media = media_type(content_type)
    if media != FORM:
        return None
    return _digest(method, path, query, media, b"bytes", body)


def _canonical_body(media: str, body: bytes) -> tuple[bytes, bytes]:
    """Which form the body is fingerprinted in (`json`, `form` or `bytes`), and its bytes."""
    if is_json(media) and len(body) <= CANONICAL_JSON_LIMIT:
        canonical = canonical_json(body)
        if canonical is not None:
            return b"json", canonical
    elif media == FORM and len(body) <= CANONICAL_FORM_LIMIT:
        canonical = canonical_form(body)
        if canonical is not None:
            return b"form", canonical
    return b"bytes", body


def _digest(
    method: str, path: str, query: bytes | str, media: str, form: bytes, body: bytes
) -> bytes:
    digest = hashlib.sha256()
    for part in (
        method.upper().encode(),
        path.encode("utf-8", "surrogateescape"),
        canonical_query(query),
        media.encode("latin-1", "replace"),
        form,
        body,
    ):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def media_type(content_type: str | None) -> str:
    """`Application/JSON; charset=utf-8` -> `application/json`; no header -> ``."""
    if not content_type:
        return ""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(media: str) -> bool:
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def canonical_query(query: bytes | str) -> bytes:
    """The query's parameters sorted by name, then value; blank values kept, encoding normalised.

    Percent escapes are decoded byte for byte (latin-1), so `%FF` and `%FE` stay different even
    though neither is UTF-8, and `%41` and `A` are the same.
    """
    if not query:
        return b"[]"  # what the rule below gives for no parameters, without parsing nothing
    text = query.decode("latin-1") if isinstance(query, bytes) else query
    pairs: Sequence[tuple[str, str]] = parse_qsl(
        text, keep_blank_values=True, encoding="latin-1", errors="strict"
    )
    return _QUERY_ENCODER.encode(sorted(pairs)).encode()


def canonical_json(body: bytes) -> bytes | None:
    """The body as canonical JSON, or None if it is not valid JSON."""
    try:
        # What json.loads does with bytes (UTF-8, -16 or -32, told by the first bytes), on a
        # decoder made once.
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        return _CANONICAL_ENCODER.encode(_DECODER.decode(text)).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        # ValueError covers bad syntax, bad UTF-8 and NaN/Infinity; RecursionError absurd nesting.
        return None


def canonical_form(body: bytes) -> bytes | None:
    """The form body's fields sorted by name (stably), each decoded and length-prefixed, or None
    if it is not strictly valid form data."""
    if _VALID_FORM.fullmatch(body) is None:
        return None
    fields: list[tuple[bytes, bytes, bytes]] = []
    for field in body.split(b"&"):
        if not field:
            continue
        name, equals, value = field.partition(b"=")
        fields.append((_form_decode(name), equals, _form_decode(value)))
    fields.sort(key=lambda field: field[0])  # stable: repeated names keep their order
    return b"".join(
        len(name).to_bytes(4, "big") + name + (b"=" if equals else b"-")
        + len(value).to_bytes(4, "big") + value
        for name, equals, value in fields
    )  # fmt: skip


def _form_decode(text: bytes) -> bytes:
    return unquote_to_bytes(text.replace(b"+", b" "))


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


# Made once: json.loads and json.dumps make a new decoder or encoder on every call that passes
# an option (timeit, a 63-byte JSON body: 6.1-6.2 µs per fingerprint with them, 4.7-4.9 without).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_CANONICAL_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
_QUERY_ENCODER = json.JSONEncoder(separators=(",", ":"))
