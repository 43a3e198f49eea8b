"""Pure: the header policy of both directions, in one place.

- Hop-by-hop fields (RFC 9110 §7.6.1, and those a `Connection` header names) are never forwarded
  or stored; `Content-Length` is recomputed on each hop.
- The upstream always gets the key header (`Idempotency-Key`, or the route's `key_header`), even
  when the client names it in `Connection`: the contract promises it, and an upstream that
  deduplicates by key relies on it.
- Credentials are never stored with an answer: one client's `Authorization`, `Cookie` or
  `Set-Cookie` must not be replayed to anyone (the first caller still gets its `Set-Cookie`).
  The request kept behind a key (`service.evidence`) does hold them, for a re-send: sealed
  where sealing is on, and shown to operators masked.
- A request whose head cannot be passed on as the client meant it is refused (`check_request`).
- An answer that announces a body it may not have (a 204 with a length) breaks its framing: its
  connection is not reused (`announces_forbidden_body`, used by the upstream client).
- Every answer carries one `X-Request-Id`: the client's, when it sent one sane one.
- An answer header that no HTTP/1.1 answer may carry (a control byte in its value: the upstream's
  parser let it through, the server's refuses to write it) is left out of what the client gets,
  and `Oncegate-Dropped-Headers` names it (`relayable`); what is stored is kept as received, so
  every replay drops it the same way and the answer stays replayable.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from ..model import errors
from . import keys

# RFC 9110 §7.6.1: connection-specific fields, never forwarded or stored. Keep-Alive and
# Proxy-Connection are the legacy ones it names; Content-Length is recomputed on each hop.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "content-length",
    }
)
# Set by the client for the upstream's address, never copied from the incoming request.
REQUEST_ONLY = frozenset({"host", "expect"})
# A HEAD answer's Content-Length is the size of the GET's body (RFC 9110 §8.6), not a framing.
HEAD_ANSWER_KEEPS = frozenset({"content-length"})

# Never stored: credentials of one client must not be replayed to anyone.
NOT_STORED = frozenset({"set-cookie", "set-cookie2", "authorization", "cookie"})
REPLAYED = ("idempotent-replayed", "true")
REQUEST_ID = "x-request-id"
PREFER = "prefer"
_WAIT = re.compile(r"^wait\s*=\s*\"?(\d+)\"?\Z", re.IGNORECASE)
# RFC 9111 §1.2.2: delta-seconds too large to hold are taken as 2^31, never ignored; the route's
# `max_wait` caps it further. Read from at most 10 digits, so a long run of them costs nothing.
_LONGEST_WAIT = 2**31
_SANE_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}\Z")
# RFC 9110 §5.1 and §5.5: what a header name (a token) and a header value may hold. Every
# pattern here that must match a whole text ends in \Z, not $: `$` also matches before a final
# newline, so "x-a\n" would pass for a name (and break the answer it is written into).
_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z"
NAME = re.compile(_HEADER_NAME)
VALUE = re.compile(r"^[\t\x20-\x7e\x80-\xff]*\Z")
# What the HTTP/1.1 servers under both ports refuse to write into an answer: a control byte (tab
# aside) in a value, where it could end the head early or drive the client's terminal.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_NAME = re.compile(_HEADER_NAME.encode())  # as the server's bytes
DROPPED = b"oncegate-dropped-headers"
# Answers that never carry a body (RFC 9110 §15.3.5, §15.4.5), whatever was stored or received.
BODILESS_STATUSES = frozenset({204, 304})


def connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Headers named in `Connection: a, b` are hop-by-hop too."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    }


def end_to_end(
    headers: Sequence[tuple[str, str]],
    drop: frozenset[str] = frozenset(),
    keep: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """`headers` without hop-by-hop fields and without the names in `drop`, but with the names in
    `keep` whatever `Connection` says (names in lower case)."""
    tokens = connection_tokens(headers)
    excluded = (HOP_BY_HOP | drop | tokens) - keep if tokens else _excluded(drop, keep)
    return [(name, value) for name, value in headers if name.lower() not in excluded]


@functools.lru_cache(maxsize=64)
def _excluded(drop: frozenset[str], keep: frozenset[str]) -> frozenset[str]:
    """What `end_to_end` leaves out when no `Connection` header names more: the same few sets
    on every request, made once."""
    return (HOP_BY_HOP | drop) - keep


def bodiless(method: str, status: int) -> bool:
    """Whether the answer to `method` with `status` has no body: HEAD's, 204's and 304's."""
    return method == "HEAD" or status in BODILESS_STATUSES


def announces_forbidden_body(status: int, headers: Mapping[str, str]) -> bool:
    """An answer that breaks its own framing: a 1xx or 204 has no body (RFC 9112 §6.3), so a
    length or a transfer coding on one means the server sent bytes nobody will read."""
    if not (status < 200 or status == 204):
        return False
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() != "0"


def storable(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers of an answer that may be stored and replayed: end-to-end ones, and no
    credentials."""
    return [pair for pair in end_to_end(headers) if pair[0].lower() not in NOT_STORED]


def relayable(
    answer: Sequence[tuple[str, str]], skip: str
) -> tuple[list[tuple[bytes, bytes]], list[str]]:
    """An answer's headers (but `skip`) as the bytes to send, and the names of those left out
    because no HTTP/1.1 answer may carry them; when any was, `Oncegate-Dropped-Headers` names
    them. Leading and trailing spaces are not part of a value (RFC 9110 §5.5) and are trimmed."""
    sent: list[tuple[bytes, bytes]] = []
    dropped: list[str] = []
    for name, value in answer:
        if name.lower() == skip:
            continue
        raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1").strip(b" \t")
        if _CONTROL.search(raw_value) or not _NAME.match(raw_name):
            dropped.append(name)
        else:
            sent.append((raw_name, raw_value))
    if dropped:
        shown = ", ".join(name for name in dropped if _NAME.match(name.encode("latin-1")))
        sent.append((DROPPED, shown.encode() or b"(a header with an invalid name)"))
    return sent, dropped


def check_request(
    http_version: str, headers: list[tuple[str, str]], key_header: str | None = keys.HEADER
) -> None:
    """Refuse what cannot be passed on as the client meant it (docs/security.md):
    - an HTTP/1.1 request without exactly one Host (RFC 9112 §3.2 says 400);
    - a transfer coding other than chunked: the body is read without it and sent with a
      Content-Length, so the upstream would get coded bytes it has no way to decode (501);
    - a header value that cannot reach the upstream byte for byte: values arrive as Latin-1
      text, one character per byte, and the upstream client writes text as UTF-8, so a value
      above ASCII passes unchanged only when its bytes are UTF-8. In `key_header` (the
      request's route's key header, as the route spells it; None when its key is in the body)
      that is a malformed key, `InvalidKey`, as any other character a key cannot hold is."""
    key_name = key_header.lower() if key_header is not None else None
    hosts = 0
    for name, value in headers:
        if name == "host":
            hosts += 1
        elif name == "transfer-encoding" and value.strip().lower() != "chunked":
            raise errors.UnsupportedTransferCoding(
                f"the gateway supports the chunked transfer coding alone, not {value!r}; send "
                "the body without a transfer coding (a Content-Encoding is passed on unchanged)"
            )
        if not value.isascii():
            try:
                value.encode("latin-1").decode("utf-8")
            except UnicodeDecodeError:
                if name == key_name:
                    raise errors.InvalidKey(
                        f"the {key_header} must be printable ASCII characters only"
                    ) from None
                raise errors.InvalidHeader(
                    f"the value of the {name!r} header is not UTF-8 text, and the gateway "
                    "forwards header values unchanged or not at all; send it as UTF-8 (or ASCII)"
                ) from None
    if hosts != 1 and (hosts or http_version == "1.1"):
        raise errors.InvalidRequest(
            f"an HTTP/{http_version} request carries exactly one Host header, not {hosts}"
        )


def request_id(headers: list[tuple[str, str]]) -> str:
    """The client's request id if it sent one sane one; else a new one, added to `headers` so
    the upstream gets it too."""
    given = [value for name, value in headers if name == REQUEST_ID]
    if len(given) == 1 and _SANE_REQUEST_ID.match(given[0]):
        return given[0]
    headers[:] = [(name, value) for name, value in headers if name != REQUEST_ID]
    request_id = new_request_id()
    headers.append((REQUEST_ID, request_id))
    return request_id


def new_request_id() -> str:
    """A random (version 4) UUID as 32 hex digits, as `uuid.uuid4().hex` gives it, without
    building a `UUID` or asking the kernel for 16 bytes on every request: its bytes come from
    `os.urandom`, `_RANDOM_BATCH` at a time. Called on the event loop's thread (the proxy
    port's), never from two threads at once."""
    global _random, _taken
    if _taken + 16 > len(_random):
        _random, _taken = os.urandom(_RANDOM_BATCH), 0
    raw = bytearray(_random[_taken : _taken + 16])
    _taken += 16
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    return raw.hex()


# Random bytes for request ids: one `getrandom` system call per 256 ids instead of one each. A
# forked worker must not hand out its parent's ids: the child starts with none taken.
_RANDOM_BATCH = 16 * 256
_random = b""
_taken = 0


def _forget_random() -> None:
    global _random, _taken
    _random, _taken = b"", 0


os.register_at_fork(after_in_child=_forget_random)


def requested_wait(values: Sequence[str]) -> int | None:
    """The seconds of `Prefer: wait=N` (RFC 7240 §4.3), or None. Preferences are separated by
    commas, their parameters by semicolons; the first `wait` counts, and one that is not a
    number of seconds is ignored, as a preference a server does not understand is."""
    for value in values:
        for preference in value.split(","):
            found = _WAIT.match(preference.split(";", 1)[0].strip())
            if found:
                digits = found.group(1).lstrip("0")
                return _LONGEST_WAIT if len(digits) > 10 else min(int(digits or 0), _LONGEST_WAIT)
    return None
