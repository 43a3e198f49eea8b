"""The fingerprint of a request: what makes a retry "the same request". Pure functions.

Rules (contract sections 4 and 11; docs/security.md lists every equivalence below for users):
- SHA-256 over the method, the path, the query (parameters sorted by name, repeated names keeping
  their order, as in a form body), the media type and the body.
- A JSON body (media type `application/json` or `*/*+json`) is canonicalised first: object keys
  sorted, no insignificant white space, strings in one escaping. `{"a":1,"b":2}` and
  `{ "b": 2, "a": 1 }` are the same request.
- JSON numbers compare by their exact decimal value and their kind, never as binary floats:
  an integer (`100`, no fraction, no exponent) is never a fraction (`100.0`, `1e2`), as most
  parsers read one as an int and the other as a float; two fractions are equal when their
  decimal values are (`1.0`, `1.00` and `10e-1`; `0.123456789012345678` is not
  `0.123456789012345677`). `-0` is the integer 0, while `-0.0` keeps its sign (a float's
  negative zero is a value of its own). A fraction is written as Python writes a float when a
  float holds it exactly (so such bodies keep the digest earlier gateways gave them), else with
  all its digits in the same layout; no number is ever expanded, so `1e999999999` costs what
  its 11 characters cost. An exponent of more than 15 digits makes the body its bytes.
- A JSON object that names a member twice is fingerprinted as its bytes: parsers disagree on
  which of the two counts, so it is equal to nothing but itself.
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
- A `multipart/form-data` body is fingerprinted by its parts, never by its boundary (which
  clients draw anew for every attempt): each part's name, filename, content type, any other
  header or Content-Disposition parameter it has, and its bytes, in order. The preamble and
  epilogue, which no parser reads, are left out; header names compare in any case, parameters in
  any order, `name=a` as `name="a"`; quoted values compare as sent (no escape is decoded).
- A multipart body that is not strictly well formed (no boundary, a delimiter line with
  anything after it, a part without `Content-Disposition: form-data; name=...`, a header given
  twice, a folded header line, no closing delimiter, more than `MULTIPART_PART_LIMIT` parts or
  `MULTIPART_HEADS_LIMIT` bytes of part heads, `--boundary` anywhere but at a delimiter) is
  fingerprinted as its bytes, as malformed JSON and form data are: parsers disagree on what it
  means, and whether it is acceptable is the upstream's to say, not the gateway's. Its retries
  send the same bytes and match; only a client that redraws the boundary of a malformed body is
  refused as reusing its key.
- Keys stored before form and multipart bodies were canonicalised hold the byte rule's digest:
  `as_bytes` gives it for such a body (None for any other), and a retry matching either digest
  is the same request (`Fingerprint.matches`), so upgrading the gateway under in-flight retries
  refuses none.
- A body sent with a `Content-Encoding` (other than `identity`) is fingerprinted as its bytes,
  with the codings named (lower case, `x-gzip` as `gzip`): the media type's rule does not apply
  to bytes that are not yet of that type, and the same bytes sent with and without a coding are
  two requests (the upstream reads two different documents). A gzip body's header is read
  without its time of compression, extra flags and operating system byte (RFC 1952 §2.3: every
  gzip encoder writes the time there), so a client that compresses the same document again for
  its retry sends the same request. Two compressors (or levels) may encode one document
  differently: such retries are two requests, as two spellings of a large JSON body are.
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

from ..model import jsontext

# The limits bound the longest stall one body can buy (the event loop, or the interpreter, held
# while it is canonicalised): the dearest bodies within them cost 3-25 ms of CPU
# (bench/fingerprint_cost.py; docs/security.md). Larger API requests than 64 KiB of JSON or form
# data are rare, and such a body is fingerprinted as its bytes: its retries send the same bytes.
CANONICAL_JSON_LIMIT = 64 * 1024
CANONICAL_FORM_LIMIT = 64 * 1024
# Multipart bodies are split with bytes.find whatever their size (about 1.2 ms a MiB, searched a
# window at a time so that a worker thread lets go of the interpreter between windows), but each
# part costs some Python: 500 short parts about 3 ms. Real uploads have a handful of parts.
MULTIPART_PART_LIMIT = 500
# How much of a body one bytes.find searches before the interpreter may switch threads.
_SEARCH_WINDOW = 1024 * 1024
# A part's header block longer than this is malformed: real ones are a few hundred bytes.
MULTIPART_HEAD_LIMIT = 16 * 1024
# A body whose parts' header blocks add up to more than this is its bytes: each head line and
# parameter costs some Python, so it is what they hold that must be bounded, not the parts
# (500 parts of 280 parameters each, 0.95 MB of heads, took 150 ms). Real uploads' heads are a
# few hundred bytes a part.
MULTIPART_HEADS_LIMIT = 64 * 1024
# An exponent of more digits than this is no number an API means; its body is its bytes.
EXPONENT_DIGITS_LIMIT = 15
FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
# Strictly valid form data: visible ASCII, every `%` the start of a two-hex-digit escape.
_VALID_FORM = re.compile(rb"(?:[\x21-\x24\x26-\x7e]|%[0-9A-Fa-f]{2})*")
# An RFC 9110 token: a parameter's name, or its value unquoted.
_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# `; name=token` or `; name="quoted"`; a backslash escapes the next character (RFC 9110
# §5.6.4), which only finds where the string ends: the value is kept as sent.
_PARAMETER = re.compile(rf'[ \t]*;[ \t]*({_NAME})=(?:({_NAME})|"((?:[^"\\]|\\.)*)")[ \t]*')
_PARAMETERS_END = re.compile(r"[ \t]*;?[ \t]*")
_DISPOSITION = re.compile(rf"[ \t]*({_NAME})")
_HEADER_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# RFC 2046 §5.1.1: 1 to 70 of these characters, the last not a space.
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
# A JSON number's parts, as the grammar gives them (the decoder has checked it already).
_NUMBER = re.compile(r"(-?)([0-9]+)(?:\.([0-9]+))?(?:[eE]([+-]?)([0-9]+))?")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A request's digest, and the digest the byte rule gave it before form and multipart
    bodies were canonicalised (`as_bytes`), when that differs."""

    digest: bytes
    as_bytes: bytes | None = None

    def matches(self, stored: bytes) -> bool:
        return stored == self.digest or (self.as_bytes is not None and stored == self.as_bytes)


def of_request(
    method: str,
    path: str,
    query: bytes | str,
    content_type: str | None,
    body: bytes,
    content_encoding: str | None = None,
) -> Fingerprint:
    """The request's `Fingerprint`: its digest, and the byte rule's for a form or multipart
    body (sent without a `Content-Encoding`: with one, it has only the byte rule's)."""
    media = media_type(content_type)
    codings = content_codings(content_encoding)
    if codings:
        return Fingerprint(
            _digest(method, path, query, media, codings, _encoded_body(codings, body))
        )
    form, canonical = _canonical_body(media, content_type or "", body)
    digest = _digest(method, path, query, media, form, canonical)
    if media not in (FORM, MULTIPART):
        return Fingerprint(digest)
    return Fingerprint(digest, _digest(method, path, query, media, b"bytes", (body,)))


def content_codings(content_encoding: str | None) -> bytes:
    """The form a body sent with `content_encoding` takes in the digest: `encoded ` and its
    codings in order (lower case, `x-gzip` as `gzip`, RFC 9110 §8.4.1.3), or empty for none
    (no header, or `identity` alone). The prefix keeps it apart from the other forms."""
    if not content_encoding:
        return b""
    codings = [
        "gzip" if coding == "x-gzip" else coding
        for coding in (part.strip().lower() for part in content_encoding.split(","))
        if coding and coding != "identity"
    ]
    if not codings:
        return b""
    return b"encoded " + ",".join(codings).encode("latin-1", "replace")


# RFC 1952 §2.3: ID1 ID2 CM FLG, then MTIME (4 bytes), XFL and OS: what the digest leaves out.
_GZIP_MAGIC = b"\x1f\x8b\x08"
_GZIP_FHCRC = 0x02
_GZIP_VARYING = slice(4, 10)


def _encoded_body(codings: bytes, body: bytes) -> Pieces:
    """The body's bytes; a gzip body's first header without its time, extra flags and OS
    (zeroed, not dropped, so the length stays the body's). Not when the header carries its own
    CRC (FHCRC), which covers them: such a body is its bytes."""
    if (
        codings == b"encoded gzip"
        and len(body) >= _GZIP_VARYING.stop
        and body.startswith(_GZIP_MAGIC)
        and not body[3] & _GZIP_FHCRC
    ):
        view = memoryview(body)
        return (view[: _GZIP_VARYING.start], bytes(6), view[_GZIP_VARYING.stop :])
    return (body,)


def as_bytes(
    method: str, path: str, query: bytes | str, content_type: str | None, body: bytes
) -> bytes | None:
    """The digest of a form or multipart body under the rule before they were canonicalised
    (as its bytes), or None for any other body (its digest never changed that way)."""
    media = media_type(content_type)
    if media not in (FORM, MULTIPART):
        return None
    return _digest(method, path, query, media, b"bytes", (body,))


Pieces = Sequence[bytes | memoryview]


def _canonical_body(media: str, content_type: str, body: bytes) -> tuple[bytes, Pieces]:
    """Which form the body is fingerprinted in (`json`, `form`, `multipart` or `bytes`), and its
    bytes, in pieces (a multipart body's parts are hashed where they lie, never copied)."""
    if is_json(media) and len(body) <= CANONICAL_JSON_LIMIT:
        canonical = canonical_json(body)
        if canonical is not None:
            return b"json", (canonical,)
    elif media == FORM and len(body) <= CANONICAL_FORM_LIMIT:
        canonical = canonical_form(body)
        if canonical is not None:
            return b"form", (canonical,)
    elif media == MULTIPART:
        pieces = canonical_multipart(content_type, body)
        if pieces is not None:
            return b"multipart", pieces
    return b"bytes", (body,)


def _digest(
    method: str, path: str, query: bytes | str, media: str, form: bytes, body: Pieces
) -> bytes:
    head: list[bytes] = []  # each part after its length: one update for them all
    for part in (
        method.upper().encode(),
        path.encode("utf-8", "surrogateescape"),
        canonical_query(query),
        media.encode("latin-1", "replace"),
        form,
    ):
        head += (len(part).to_bytes(8, "big"), part)
    head.append(sum(len(piece) for piece in body).to_bytes(8, "big"))
    digest = hashlib.sha256(b"".join(head))
    for piece in body:
        digest.update(piece)
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
    """The query's parameters sorted by name, stably: repeated names keep their order (`to=a&to=b`
    is a list, and its order is the client's, as in a form body); blank values kept, encoding
    normalised.

    Percent escapes are decoded byte for byte (latin-1), so `%FF` and `%FE` stay different even
    though neither is UTF-8, and `%41` and `A` are the same.
    """
    if not query:
        return b"[]"  # what the rule below gives for no parameters, without parsing nothing
    text = query.decode("latin-1") if isinstance(query, bytes) else query
    pairs: Sequence[tuple[str, str]] = parse_qsl(
        text, keep_blank_values=True, encoding="latin-1", errors="strict"
    )
    return _write_query(sorted(pairs, key=_name)).encode()


def _name(pair: tuple[str, str]) -> str:
    return pair[0]


# -- JSON ----------------------------------------------------------------------------------------


class _Decimal:
    """A JSON fraction no float holds exactly, as its canonical text."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def canonical_json(body: bytes) -> bytes | None:
    """The body as canonical JSON, or None if it is not valid JSON (or names a member twice)."""
    try:
        # What json.loads does with bytes (UTF-8, -16 or -32, told by the first bytes), on a
        # decoder made once.
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        document = _DECODER.decode(text)
        try:
            encoded = _write_canonical(document)
        except TypeError:  # a fraction no float holds: the slower encoder that writes it
            encoded = "".join(_encoded(document, []))
        return encoded.encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        # ValueError covers bad syntax, bad UTF-8, NaN/Infinity, a member named twice and an
        # absurd exponent; RecursionError absurd nesting.
        return None


def _fraction(text: str) -> float | _Decimal:
    """A JSON number with a fraction or an exponent: the float that holds it exactly (the C
    encoder writes it as `repr` does, as `_decimal_text` would), else its exact text."""
    value = float(text)
    written = repr(value)
    if written == text:
        return value  # most numbers an API sends: 19.99, 0.5
    exact = _decimal_text(text)
    if exact == written:  # never true of an infinity: its repr is `inf`
        return value
    return _Decimal(exact)


def _decimal_text(text: str) -> str:
    """A JSON number's exact value as Python writes a float (`1.00` and `10e-1` -> `1.0`,
    `1E2` -> `100.0`, `1e-5` -> `1e-05`), with every significant digit it has. Linear in the
    text: no digit string is ever built from the exponent."""
    found = _NUMBER.fullmatch(text)
    if found is None:  # the decoder hands over only numbers of the JSON grammar
        raise ValueError(f"{text!r} is not a JSON number")
    sign, whole, fraction, exponent_sign, exponent = found.groups()
    exponent = (exponent or "0").lstrip("0") or "0"
    if len(exponent) > EXPONENT_DIGITS_LIMIT:
        raise ValueError("an exponent of more than 15 digits")
    digits = whole + (fraction or "")
    # value = 0.<digits> x 10^point, digits without leading or trailing zeros
    point = len(whole) + (-int(exponent) if exponent_sign == "-" else int(exponent))
    significant = digits.lstrip("0")
    point -= len(digits) - len(significant)
    significant = significant.rstrip("0")
    if not significant:
        return f"{sign}0.0"
    if -4 < point <= 16:  # where repr writes a float without an exponent
        if point <= 0:
            return f"{sign}0.{'0' * -point}{significant}"
        if point >= len(significant):
            return f"{sign}{significant}{'0' * (point - len(significant))}.0"
        return f"{sign}{significant[:point]}.{significant[point:]}"
    mantissa = significant[0] + ("." + significant[1:] if len(significant) > 1 else "")
    return f"{sign}{mantissa}e{'-' if point <= 0 else '+'}{abs(point - 1):02d}"


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    document = dict(pairs)
    if len(document) != len(pairs):
        raise ValueError("an object names a member twice")
    return document


def _encoded(value: object, out: list[str]) -> list[str]:
    """`value` written as `_write_canonical` writes it, fractions no float holds included."""
    if isinstance(value, dict):
        out.append("{")
        for index, name in enumerate(sorted(value)):
            out.append("," if index else "")
            out.append(_encode_string(name))
            out.append(":")
            _encoded(value[name], out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for index, item in enumerate(value):
            out.append("," if index else "")
            _encoded(item, out)
        out.append("]")
    elif isinstance(value, str):
        out.append(_encode_string(value))
    elif isinstance(value, _Decimal):
        out.append(value.text)
    else:  # bool, int, float or None: what the encoder writes, as `repr` and the literals
        out.append(_SCALARS[value] if value is None or isinstance(value, bool) else repr(value))
    return out


# -- forms ---------------------------------------------------------------------------------------


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


# -- multipart -----------------------------------------------------------------------------------


def canonical_multipart(content_type: str, body: bytes) -> list[bytes | memoryview] | None:
    """A `multipart/form-data` body as its parts, each its canonical head (name, filename,
    content type, other headers and parameters) and its bytes, length-prefixed; None when the
    body is not strictly well formed."""
    _, semicolon, parameters_text = content_type.partition(";")
    parameters = _parameters(semicolon + parameters_text)
    boundary = None if parameters is None else parameters.get("boundary")
    if boundary is None or not _BOUNDARY.fullmatch(boundary):
        return None
    spans = _part_spans(body, boundary.encode("latin-1"))
    if spans is None:
        return None
    view = memoryview(body)
    pieces: list[bytes | memoryview] = []
    for head_start, head_end, content_start, content_end in spans:
        head = _canonical_part_head(body[head_start:head_end])
        if head is None:
            return None
        pieces += (head, (content_end - content_start).to_bytes(8, "big"))
        pieces.append(view[content_start:content_end])
    return pieces


def _part_spans(body: bytes, boundary: bytes) -> list[tuple[int, int, int, int]] | None:
    """Where each part's head and content lie: (head start, head end, content start, content
    end); None unless every delimiter line is exactly `--boundary` and CRLF (or `--` to close)
    and the body closes."""
    delimiter = b"--" + boundary
    separator = b"\r\n" + delimiter
    if body.startswith(delimiter):
        position = len(delimiter)
    else:  # after a preamble, which no parser reads
        found = _find(body, separator, 0)
        if found < 0:
            return None
        position = found + len(separator)
    spans: list[tuple[int, int, int, int]] = []
    heads = 0
    while True:
        after = body[position : position + 2]
        if after == b"--":
            # The epilogue after it is no part either. But `--boundary` anywhere else (in the
            # preamble, the epilogue, a part after a bare LF or CR) is a delimiter to a lenient
            # parser: such a body means different parts to different parsers.
            if not spans or _occurrences(body, delimiter, len(spans) + 2) != len(spans) + 1:
                return None
            return spans
        if after != b"\r\n" or len(spans) == MULTIPART_PART_LIMIT:
            return None
        head_start = position + 2
        if body.startswith(b"\r\n", head_start):
            head_end = head_start  # no headers at all
            content_start = head_start + 2
        else:
            head_end = body.find(b"\r\n\r\n", head_start, head_start + MULTIPART_HEAD_LIMIT)
            if head_end < 0:
                return None
            content_start = head_end + 4
        heads += head_end - head_start
        if heads > MULTIPART_HEADS_LIMIT:
            return None
        content_end = _find(body, separator, content_start)
        if content_end < 0 or body.find(separator, head_start - 2, head_end) >= 0:
            return None
        spans.append((head_start, head_end, content_start, content_end))
        position = content_end + len(separator)


def _find(body: bytes, needle: bytes, start: int) -> int:
    """`body.find(needle, start)`, a window at a time: one call over 10 MiB would hold the
    interpreter (and so the event loop, when a worker thread fingerprints) for 12 ms."""
    while start < len(body):
        found = body.find(needle, start, start + _SEARCH_WINDOW + len(needle))
        if found >= 0:
            return found
        start += _SEARCH_WINDOW + 1
    return -1


def _occurrences(body: bytes, needle: bytes, most: int) -> int:
    """How many times `needle` occurs in `body`, counting no further than `most`."""
    count, position = 0, _find(body, needle, 0)
    while position >= 0 and count < most:
        count += 1
        position = _find(body, needle, position + len(needle))
    return count


def _canonical_part_head(head: bytes) -> bytes | None:
    """A part's head as length-prefixed fields: its name, its filename (or none), its content
    type (or none), then its other Content-Disposition parameters and other headers, sorted;
    None when it is not a well-formed form-data part head."""
    headers: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n") if head else ():
        name, colon, value = line.partition(b":")
        value = value.strip(b" \t")
        if not colon or not _HEADER_NAME.fullmatch(name) or _CONTROL.search(value):
            return None  # includes folded lines, which start with white space
        name = name.lower()
        if name in headers:
            return None
        headers[name] = value
    disposition = headers.pop(b"content-disposition", None)
    if disposition is None:
        return None
    text = disposition.decode("latin-1")
    kind = _DISPOSITION.match(text)
    if kind is None or kind.group(1).lower() != "form-data":
        return None
    parameters = _parameters(text[kind.end() :])
    if parameters is None or "name" not in parameters:
        return None
    field_name = parameters.pop("name")
    filename = parameters.pop("filename", None)
    content_type = headers.pop(b"content-type", None)
    rest = sorted(
        [(b"parameter:" + name.encode("latin-1"), value.encode("latin-1"))
         for name, value in parameters.items()]
        + list(headers.items())
    )  # fmt: skip
    fields: list[bytes | None] = [
        field_name.encode("latin-1"),
        None if filename is None else filename.encode("latin-1"),
        content_type,
    ]
    fields += [part for pair in rest for part in pair]
    encoded = bytearray(len(rest).to_bytes(4, "big"))
    for field in fields:
        if field is None:
            encoded += b"-"
        else:
            encoded += b"=" + len(field).to_bytes(4, "big") + field
    return bytes(len(encoded).to_bytes(8, "big") + encoded)


def _parameters(text: str) -> dict[str, str] | None:
    """`; a=1; b="x y"` -> {"a": "1", "b": "x y"}: names in lower case, quoted values as sent
    between their quotes; None when malformed or a name is given twice."""
    parameters: dict[str, str] = {}
    position = 0
    while (found := _PARAMETER.match(text, position)) is not None:
        name = found.group(1).lower()
        if name in parameters:
            return None
        token, quoted = found.group(2), found.group(3)
        parameters[name] = token if token is not None else quoted
        position = found.end()
    if not _PARAMETERS_END.fullmatch(text, position):
        return None
    return parameters


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


# As the canonical encoder writes a string (`ensure_ascii=False`) and the three literals.
_encode_string = json.encoder.encode_basestring
_SCALARS = {None: "null", True: "true", False: "false"}


# Made once: json.loads and json.dumps make a new decoder or encoder on every call that passes
# an option (timeit, a 63-byte JSON body: 6.1-6.2 µs per fingerprint with them, 4.7-4.9 without),
# and an encoder's `encode` makes a new C encoder on every call (`model.jsontext`).
_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_fraction, object_pairs_hook=_object
)
_write_canonical = jsontext.writer(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
_write_query = jsontext.writer(separators=(",", ":"))
