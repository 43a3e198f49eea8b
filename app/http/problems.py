"""The one renderer of gateway errors: RFC 9457 problem details."""

from __future__ import annotations

import json
from email.utils import formatdate

from starlette.responses import Response

from ..model import errors

# Whether a retry with the same key can help (`GatewayError.retry_advised`), in the two headers
# client libraries read: Stainless-generated SDKs (`x-should-retry`) and Stripe's.
SHOULD_RETRY = (b"x-should-retry", b"stripe-should-retry")


def parts(error: errors.GatewayError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of the problem response."""
    body = json.dumps(error.problem()).encode()
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1"))
               for name, value in error.headers.items()]  # fmt: skip
    advice = error.retry_advised
    if advice is not None:
        headers += [(name, b"true" if advice else b"false") for name in SHOULD_RETRY]
    headers += [
        (b"content-type", errors.PROBLEM_MEDIA_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
        # The server's own Date header is off (proxied answers carry the upstream's); the
        # gateway's own answers carry one, as RFC 9110 §6.6.1 asks of a server with a clock.
        (b"date", formatdate(usegmt=True).encode()),
    ]
    return error.status_code, headers, body


def render(error: errors.GatewayError) -> Response:
    status, headers, body = parts(error)
    response = Response(content=body, status_code=status)
    response.raw_headers = headers
    return response
