"""The operator's evidence about a key (contract section 11, "the request behind an unknown
key"): the request the key stands for, kept from its claim until it settles, and what the
gateway saw when the key turned `unknown`.

- `KeptRequest` is what was forwarded: method, path, query, the headers as the upstream got
  them (hop-by-hop fields and Host left out, the key header in) and the body, which the edge
  read whole and within the route's `max_body`. `encode` makes the bytes the claim stores
  (sealed like answers where sealing is on): a 4-byte length, the head as JSON, the body.
- A re-send forwards exactly that; what an operator is shown masks credentials (`shown`).
- `failure` is what the gateway saw when the answer was lost, as the JSON kept with the key.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote_plus

from ..kernel import headers
from ..model import jsontext
from ..settings import Route
from ..upstream import AnswerLost
from .messages import ProxyRequest

# Shown masked to operators: whoever reads the admin API or the page sees that a credential was
# sent, not the credential. A header or query parameter is taken for one by its name, as vendors
# spell them (`Authorization`, `X-Api-Key`, `X-Shopify-Access-Token`, `Ocp-Apim-Subscription-Key`,
# `PRIVATE-TOKEN`, `?access_token=`, Azure's `?sig=`); the key that names the request is not one.
_CREDENTIAL = re.compile(
    r"auth|token|secret|passw|passphrase|passcode|key|cookie|session|signature|credential|jwt"
    r"|bearer"
    # Short ones as words of their own (`pwd`, `user_pass`, `sig`, `userPass` once its words
    # are apart), not inside others (`compass`).
    r"|(?:^|[^a-z])(?:sig|pwd|pass|otp)(?:[^a-z]|$)",
    re.I,
)
# A camelCase name's words, set apart (`loginPwd` -> `login_Pwd`) before the pattern reads it.
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_NOT_A_CREDENTIAL = re.compile(r"idempotency|request-id", re.I)
# What a masked value reads.
MASK = "***"
_LENGTH = 4  # bytes of the head's length before it
# `json.dumps` of the head, with the encoder made once (`model.jsontext`).
_write_json = jsontext.writer()


@dataclass(frozen=True, slots=True)
class KeptRequest:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes

    @classmethod
    def of(cls, route: Route, request: ProxyRequest) -> KeptRequest:
        """The request as it is forwarded on `route`."""
        forwarded = headers.end_to_end(
            request.headers, drop=headers.REQUEST_ONLY, keep=frozenset({route.key_header_name})
        )
        return cls(request.method, request.path, request.query, forwarded, request.body)

    def encode(self) -> bytes:
        head = _write_json([self.method, self.path, self.query, self.headers]).encode()
        return len(head).to_bytes(_LENGTH, "big") + head + self.body

    @classmethod
    def decode(cls, data: bytes) -> KeptRequest:
        size = int.from_bytes(data[:_LENGTH], "big")
        method, path, query, pairs = json.loads(data[_LENGTH : _LENGTH + size])
        kept = [(str(name), str(value)) for name, value in pairs]
        return cls(method, path, query, kept, data[_LENGTH + size :])

    def to_proxy(self) -> ProxyRequest:
        return ProxyRequest(self.method, self.path, self.query, self.headers, self.body)

    def shown(self) -> dict[str, object]:
        """As the admin API shows it: credentials masked, the body in base64."""
        return {
            "method": self.method,
            "path": self.path,
            "query": masked_query(self.query),
            "headers": [[name, value] for name, value in masked(self.headers)],
            "body_base64": base64.b64encode(self.body).decode(),
        }

    def readable_body(self) -> str:
        """The body for a person: JSON indented, a form as its fields one a line, a multipart
        body as sent, each with the values of credential names masked (`is_credential`: JSON
        members at any depth, form fields, multipart parts by their name); other UTF-8 text as
        it is; else its size and base64. A body that parses as a JSON object or array is read
        as JSON whatever its declared type (`text/plain`, none, a leading byte order mark):
        what the page shows masked must not depend on what the client called it."""
        content_type = next(
            (value for name, value in self.headers if name.lower() == "content-type"), ""
        )
        media = content_type.split(";")[0].strip().lower()
        try:
            text = self.body.decode("utf-8")
        except UnicodeDecodeError:
            return (
                f"({len(self.body)} bytes, not text; base64)\n"
                + base64.b64encode(self.body).decode()
            )
        if media == "application/x-www-form-urlencoded":
            fields = parse_qsl(text, keep_blank_values=True)
            return "\n".join(
                f"{name} = {MASK if is_credential(name) else value}" for name, value in fields
            )
        if media == "multipart/form-data":
            return _masked_parts(text, content_type)
        document = _json_document(text)
        if document is not None:
            return json.dumps(_masked_members(document), indent=2, ensure_ascii=False)
        return text


def _json_document(text: str) -> Any:
    """The JSON object or array `text` holds (a byte order mark before it ignored), or None."""
    stripped = text.removeprefix("\ufeff").strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        return json.loads(stripped)
    except ValueError:
        return None


_BOUNDARY = re.compile(r';\s*boundary="?([^";]+)"?', re.I)
_PART_NAME = re.compile(r'(?<![\w*])name\s*=\s*(?:"([^"]*)"|([^\s;]+))', re.I)


def _masked_parts(text: str, content_type: str) -> str:
    """A multipart body as sent, the content of each part whose name is a credential's masked
    (read leniently, for a person: a head ends at the first blank line, CRLF or LF)."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        return text
    delimiter = "--" + found.group(1).strip()
    pieces = text.split(delimiter)
    for index in range(1, len(pieces)):
        piece = pieces[index]
        ends = [at for at in (piece.find("\r\n\r\n"), piece.find("\n\n")) if at >= 0]
        if not ends:
            continue
        head_end = min(ends)
        blank = "\r\n\r\n" if piece.startswith("\r\n\r\n", head_end) else "\n\n"
        name = _PART_NAME.search(piece[:head_end])
        if name is not None and is_credential(name.group(1) or name.group(2) or ""):
            line_end = "\r\n" if piece.endswith("\r\n") else "\n" if piece.endswith("\n") else ""
            pieces[index] = piece[: head_end + len(blank)] + MASK + line_end
    return delimiter.join(pieces)


def is_credential(name: str) -> bool:
    """Whether a header or query parameter of this name is shown masked."""
    words = _CAMEL.sub(r"\1_\2", name)
    return _CREDENTIAL.search(words) is not None and _NOT_A_CREDENTIAL.search(name) is None


def _masked_members(value: Any) -> Any:
    """A JSON document with the values of its credential-named members masked, at any depth."""
    if isinstance(value, dict):
        return {
            name: MASK if is_credential(name) else _masked_members(member)
            for name, member in value.items()
        }
    if isinstance(value, list):
        return [_masked_members(item) for item in value]
    return value


def masked(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Header pairs with credentials masked: a scheme (`Bearer`) kept, the secret not."""
    shown = []
    for name, value in pairs:
        if is_credential(name):
            scheme, space, _ = value.partition(" ")
            value = f"{scheme} {MASK}" if space and name.lower().endswith("authorization") else MASK
        shown.append((name, value))
    return shown


def masked_query(query: str) -> str:
    """A query string with the values of credential parameters masked, the rest as sent."""
    if not query:
        return query
    parts = []
    for part in query.split("&"):
        name, equals, _ = part.partition("=")
        parts.append(f"{name}={MASK}" if equals and is_credential(unquote_plus(name)) else part)
    return "&".join(parts)


def failure(exc: AnswerLost) -> str:
    """What the gateway saw when the answer was lost, as the JSON kept with the key."""
    if exc.timed_out:
        kind = "read_timeout"
    elif exc.status is None:
        kind = "no_answer"  # reset, closed or malformed before a status line came back
    else:
        kind = "answer_broken"  # reset or closed while the answer's body came
    return _seen(kind, exc.status, exc.received, str(exc))


def cut(why: str, status: int, received: int) -> str:
    """What the gateway saw of an answer it stopped reading itself (`streaming.Reading.cut`):
    its status, and the bytes of its body that came before; the rest was lost."""
    return _seen("answer_cut", status, received, f"the gateway stopped reading it: {why}")


def _seen(kind: str, status: int | None, received: int, detail: str) -> str:
    seen: dict[str, Any] = {
        "kind": kind,
        "status_line_received": status is not None,
        "status": status,
        "bytes_received": received,
        "detail": detail,
    }
    return json.dumps(seen)
